"""Lab 7, notebook 2's script: DDP's communication hooks, every all-reduce byte counted
(``scripts/compressed_ddp.py``) and predicted from the gradients' shapes
(``lab7_compression``), exactly. One two-rank job runs every hook."""

from __future__ import annotations

import math

import pytest
from conftest import REPO

import lab7_compression as compression
from lab_utils import launch

LAB7 = REPO / "labs" / "lab7_communication"
STEPS, START = 4, 2


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    return launch.run(
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
        ],
        nprocs=2,
        cwd=LAB7,
        timeout=240,
        echo=False,
    ).check()


def hook(job: launch.LaunchResult, name: str) -> dict:
    return job.event("hook", hook=name)


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


def test_bf16s_hook_is_refused_without_nccl(job):
    skipped = job.event("skipped", hook="bf16")
    assert "NCCL" in skipped["reason"]


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


# ------------------------------------------------------ notebook 2's exercise: a hook
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lab7_checks as checks  # noqa: E402
import lab7_solutions as solutions  # noqa: E402
from lab_utils.checks import CheckFailed  # noqa: E402


def hook_of(dtype, divide=True, decompress=True):
    def hook(process_group, bucket):
        buffer = bucket.buffer()
        sent = buffer.to(dtype)
        if divide:
            sent = sent.div_(process_group.size())
        future = dist.all_reduce(sent, group=process_group, async_op=True).get_future()
        if not decompress:
            return future.then(lambda f: f.value()[0])
        return future.then(lambda f: buffer.copy_(f.value()[0]))

    return hook


def test_the_reference_hook_passes_within_bfloat16s_error():
    assert checks.check_bf16_hook(solutions.bf16_hook) <= 1.0


@pytest.mark.parametrize(
    "mistake, hook, named",
    [
        ("no compression", hook_of(torch.float32), "bfloat16"),
        ("float16", hook_of(torch.float16), "bfloat16"),
        ("the sum, not the average", hook_of(torch.bfloat16, divide=False), "divide"),
        ("returned in bfloat16", hook_of(torch.bfloat16, decompress=False), "float32"),
    ],
)
def test_the_hook_check_names_the_mistake(mistake, hook, named):
    with pytest.raises(CheckFailed, match=named):
        checks.check_bf16_hook(hook)
