"""Lab 7, notebook 2's script: DDP's communication hooks, every all-reduce byte counted
(``scripts/compressed_ddp.py``) and predicted from the gradients' shapes
(``lab7_compression``), exactly. One two-rank job runs every hook — inside a slow link
of its own where this machine can make one, unshaped and at RATE in turn (the bytes the
same at both, no step faster than the token bucket allows)."""

from __future__ import annotations

import math

import pytest
from conftest import REPO, check_bytes_cross_the_link, runs_by_rate

import lab7_checks as checks
import lab7_compression as compression
from lab_utils import launch, slow_link
from lab_utils.checks import CheckFailed

LAB7 = REPO / "labs" / "lab7_communication"
STEPS, START = 4, 2
RATE = 20  # Mbit/s: the uncompressed step's 0.27 MB on the link take ~0.1 s, four bursts
# a small transformer: every count holds whatever the shapes, and its steps cost little
MODEL = ["--d-model", "32", "--layers", "2"]
LINK = bool(slow_link.available())
needs_link = pytest.mark.skipif(
    not LINK, reason="no slow link here (python -m lab_utils.slow_link --check)"
)


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    rates = ["--rates", "none", str(RATE)] if LINK else []
    return slow_link.run(
        LAB7 / "scripts" / "compressed_ddp.py",
        [
            "--hooks",
            "none",
            "fp16",
            "bf16",
            "powersgd",
            "--steps",
            str(STEPS),
            "--start-iter",
            str(START),
            "--bucket-cap-mb",
            "0.05",
            *MODEL,
            *rates,
        ],
        link=slow_link.Link(None) if LINK else None,
        nprocs=2,
        launcher="mpirun",  # no torchrun process importing torch: ~2 CPU-s less
        cwd=LAB7,
        timeout=240,
        echo=False,
    ).check()


def hook(job: launch.LaunchResult, name: str, rate: float | None = None) -> dict:
    return job.event("hook", hook=name, rate=rate)


def test_uncompressed_and_half_width_hooks_send_what_the_gradients_weigh(job):
    numel = job.event("model")["numel"]
    assert hook(job, "none")["bytes_by_step"] == [4 * numel] * STEPS
    assert hook(job, "fp16")["bytes_by_step"] == [2 * numel] * STEPS
    shapes = job.event("model")["shapes"]
    assert compression.bucket_bytes(shapes, "none") == 4 * numel
    assert compression.bucket_bytes(shapes, "fp16") == 2 * numel


def test_powersgd_sends_r_times_rows_plus_columns_where_it_compresses(job):
    run = hook(job, "powersgd")
    assert run["buckets"] == 1, "on Gloo the script gives PowerSGD one bucket"
    predicted = sum(
        compression.bucket_bytes(b, "powersgd", rank=run["rank"]) for b in run["shapes_by_bucket"]
    )
    numel = job.event("model")["numel"]
    assert run["bytes_by_step"] == [4 * numel] * START + [predicted] * (STEPS - START)
    assert predicted < numel  # more than 4x fewer bytes for this model
    # what the count tells apart: every tensor compressed (1-D ones too), or none
    every = sum(
        4 * run["rank"] * sum(compression.matrix_of(s)) for b in run["shapes_by_bucket"] for s in b
    )
    assert every != predicted


def test_bf16s_hook_runs_exactly_where_ddp_takes_it(job):
    """DDP decides by torch's BUILD (CUDA or ROCm with NCCL 2.10+, or XPU with XCCL), not
    by the group's backend: the same test here, and the skip reports torch's own message."""
    import inspect
    import re

    import torch
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_source

    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = dist.is_xccl_available() and torch.xpu.is_available()
    if (cuda and nccl) or xccl:
        assert not job.events("skipped") and [h["hook"] for h in job.events("hook", hook="bf16")]
    else:
        reason = job.event("skipped", hook="bf16")["reason"]
        # torch's own TypeError, raised by DDP's check of the hook (distributed.py)
        thrown = re.escape(f'"{reason}"')
        assert reason and re.search(r"TypeError,\s*" + thrown, inspect.getsource(ddp_source))


def test_the_compressed_runs_train(job):
    base = hook(job, "none")["losses"]
    for name in ("fp16", "powersgd"):
        losses = hook(job, name)["losses"]
        assert losses[0] == pytest.approx(base[0]), "same weights, same first batch"
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "shape, rank, compressed",
    [((64, 64), 1, 1), ((64,), 4, None), ((8, 4), 4, None), ((256, 64), 4, 4), ((3, 100), 8, None)],
)
def test_which_tensors_powersgd_compresses(shape, rank, compressed):
    """torch's rule: (n + m)·r·2 < n·m, r = min(n, m, rank)."""
    assert compression.powersgd_split(shape, rank) == compressed


def test_the_rule_against_torch_itself():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    for shape in [(64, 64), (64,), (8, 4), (256, 64), (3, 100), (16, 3, 3), (1, 1000)]:
        n, m = compression.matrix_of(shape)
        for rank in (1, 2, 4, 8):
            r = min(n, m, rank)
            assert (compression.powersgd_split(shape, rank) is not None) == _should_compress(
                n, m, r, 2
            )[0], (shape, rank)


# ------------------------------------------------ the same job at two link rates
def by_rate(job: launch.LaunchResult) -> dict:
    return runs_by_rate(job, "hook", lambda h: h["hook"])


@needs_link
def test_the_bytes_are_the_same_at_every_rate_and_all_cross_the_link(job):
    runs = by_rate(job)
    assert list(runs) == [None, RATE] and all(len(r) == 3 for r in runs.values())
    checks.check_counts_same_at_every_rate(runs)
    assert all(all(run["bytes_by_step"]) for r in runs.values() for run in r.values())
    check_bytes_cross_the_link(job, runs)


@needs_link
def test_no_step_beats_the_slow_links_bound(job):
    info = job.event("link")
    slow = by_rate(job)[RATE]
    bound = checks.check_training_steps_bound(
        slow, rate_mbit=RATE, burst_bytes=info["burst_bytes"], mtu=info["mtu"]
    )
    assert bound > 0.03, "the uncompressed step's bytes take a while at RATE: the check bites"


def test_the_rate_checks_name_the_mistake():
    run = {"bytes_by_step": [100, 100], "link_bytes_by_step": [10**6, 10**6], "seconds": [1, 1]}
    checks.check_counts_same_at_every_rate({None: {"none": run}, 8: {"none": run}})
    with pytest.raises(CheckFailed, match="differs"):
        changed = {**run, "bytes_by_step": [100, 50]}
        checks.check_counts_same_at_every_rate({None: {"none": run}, 8: {"none": changed}})
    with pytest.raises(CheckFailed, match="run the same methods"):
        checks.check_counts_same_at_every_rate({None: {"none": run}, 8: {"none": run, "x": run}})
    # 1 MB at 8 Mbit/s takes ~0.9 s after the burst: 1 s passes, 0.5 s cannot be
    assert (
        checks.check_training_steps_bound({"none": run}, rate_mbit=8, burst_bytes=65536, mtu=16000)
        > 0.8
    )
    with pytest.raises(CheckFailed, match="beat the link's bound"):
        fast = {**run, "seconds": [0.5, 1]}
        checks.check_training_steps_bound({"none": fast}, rate_mbit=8, burst_bytes=65536, mtu=16000)
    with pytest.raises(CheckFailed, match="not counted"):
        uncounted = {**run, "link_bytes_by_step": None}
        checks.check_training_steps_bound(
            {"none": uncounted}, rate_mbit=8, burst_bytes=65536, mtu=16000
        )


# ------------------------------------------------------ notebook 2's exercise: a hook
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lab7_solutions as solutions  # noqa: E402


def hook_of(dtype, divide=True, decompress=True, chain=True, world=True):
    def hook(process_group, bucket):
        # DDP passes None when given no group; world=False forgets that
        group = process_group if process_group is not None or not world else dist.group.WORLD
        buffer = bucket.buffer()
        sent = buffer.to(dtype)
        if divide:
            sent = sent.div_(group.size())
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()
        if not chain:  # copies back before the other ranks' values arrived
            buffer.copy_(sent)
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if not decompress:
            return future.then(lambda f: f.value()[0])
        return future.then(lambda f: buffer.copy_(f.value()[0]))

    return hook


def test_gloo_has_two_worker_threads_by_default():
    """Notebook 2's reason for one PowerSGD bucket on Gloo: the group's two worker threads
    (ProcessGroupGloo.hpp line 264, ``int threads{2};``), which run the hook's callbacks."""
    assert dist.ProcessGroupGloo._Options()._threads == 2


def test_the_reference_hook_passes_within_bfloat16s_error():
    assert checks.check_bf16_hook(solutions.bf16_hook) <= 1.0


@pytest.mark.parametrize(
    "mistake, hook, named",
    [
        ("no compression", hook_of(torch.float32), "bfloat16"),
        ("float16", hook_of(torch.float16), "bfloat16"),
        ("the sum, not the average", hook_of(torch.bfloat16, divide=False), "divide"),
        ("returned in bfloat16", hook_of(torch.bfloat16, decompress=False), "float32"),
        ("not chained on the all-reduce", hook_of(torch.bfloat16, chain=False), r"\.then"),
        ("process_group.size() of None", hook_of(torch.bfloat16, world=False), "WORLD"),
    ],
)
def test_the_hook_check_names_the_mistake(mistake, hook, named):
    with pytest.raises(CheckFailed, match=named):
        checks.check_bf16_hook(hook)
