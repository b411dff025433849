"""Lab 6, notebooks 4–6: the trace reader on hand-made traces, the bucket and byte
exercises (and that wrong answers fail them), the hand-made DDP against
DistributedDataParallel (and that a missing average or an early bucket fails the check),
and the profiler script under mpirun. The notebooks run the scripts with torchrun.
"""

import os
import random

import pytest
import torch.distributed as dist
from conftest import REPO, tiny_transformer

import lab6_checks as checks
import lab6_solutions as solutions
from lab_utils import launch, trace
from lab_utils.checks import CheckFailed
from lab_utils.source import load_script

SCRIPTS = REPO / "labs" / "lab6_efficiency" / "scripts"
QUICK = {"LABS_PROFILE": "quick"}
TINY = tiny_transformer(steps=None)


# ------------------------------------------------------------------ the trace reader
def x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def two_steps() -> list[dict]:
    """Two 100 µs steps on thread 1; arithmetic 0–60 and 100–150; Gloo (thread 9)
    all-reduces 40–80 and 130–190; an operator on another thread that is not compute."""
    return [
        x("ProfilerStep#1", 1000, 100, cat="user_annotation"),
        x("ProfilerStep#2", 1100, 100, cat="user_annotation"),
        x("aten::mm", 1000, 40),
        x("aten::add", 1030, 30),  # nested: 0–60
        x("aten::mm", 1100, 50),
        x("c10d::allreduce_", 1040, 2),  # the launch on the main thread, not compute
        x("gloo:all_reduce", 1040, 40, tid=9),
        x("gloo:all_reduce", 1130, 60, tid=9),
        x("aten::copy_", 1060, 20, tid=7),  # a thread that is not the training loop's
        x("aten::mm", 900, 50),  # before the recorded steps
        {"ph": "M", "name": "thread_name", "tid": 9},
    ]


def test_trace_intervals_and_overlap_are_exact():
    t = trace.from_events(two_steps())
    assert t.steps == [(0.0, 100.0), (100.0, 200.0)]
    assert t.compute == [(0.0, 60.0), (100.0, 150.0)]
    assert t.comm == [(40.0, 80.0), (130.0, 190.0)]
    assert trace.intersection(t.compute, t.comm) == 20 + 20
    assert trace.overlap_fraction(t.compute, t.comm) == pytest.approx(40 / 100)
    assert trace.per_step(t, "all_reduce") == 1
    s = trace.summary(t)
    assert s["comm_ms"] == pytest.approx(0.05) and s["exposed_comm_ms"] == pytest.approx(0.03)


def test_the_gpu_timelines_copies_of_annotations_are_not_more_steps_or_collectives():
    # with CUDA, the profiler draws each CPU annotation again on the GPU's timeline (seen on
    # an H200: two ProfilerStep# spans per step, and a GPU copy of every gloo:all_reduce)
    copies = [
        x(e["name"], e["ts"] + 5, e["dur"] / 2, tid=100 + i, cat="gpu_user_annotation")
        for i, e in enumerate(two_steps())
        if e.get("cat") == "user_annotation" or e["name"].startswith("gloo:")
    ]
    t = trace.from_events(two_steps() + copies)
    assert t == trace.from_events(two_steps())
    assert len(t.steps) == 2 and trace.per_step(t, "all_reduce") == 1


def test_trace_reader_mistakes_change_the_answer():
    """A reader counting the launch or another thread's operators as compute, or
    ignoring the steps' window, would not get these numbers."""
    t = trace.from_events(two_steps())
    everything = trace.merge(
        (e["ts"] - 1000, e["ts"] + e["dur"] - 1000)
        for e in two_steps()
        if e["ph"] == "X" and e["name"].startswith("aten::")
    )
    assert trace.overlap_fraction(everything, t.comm) != trace.overlap_fraction(t.compute, t.comm)
    with pytest.raises(ValueError, match="ProfilerStep"):
        trace.from_events([x("aten::mm", 0, 1)])


def test_merge_and_intersection():
    assert trace.merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert trace.intersection([(0, 10)], [(2, 3), (9, 12)]) == 2
    assert trace.overlap_fraction([(0, 1)], []) == 0.0


# ------------------------------------------------------------------ exercises
def test_reference_solutions_pass_their_checks():
    checks.check_make_buckets(solutions.make_buckets)
    checks.check_bytes_sent_per_rank(solutions.bytes_sent_per_rank)


def old_rule(nbytes, ready, cap, first_cap):
    """What notebook 5 used to teach: close a bucket BEFORE it would pass the cap, walking
    from the last parameter to the first, no first-bucket cap."""
    out, size = [], 0
    for i in reversed(range(len(nbytes))):
        if out and size + nbytes[i] <= cap:
            out[-1].append(i)
            size += nbytes[i]
        else:
            out.append([i])
            size = nbytes[i]
    return out


def torch_assignment(nbytes, ready, cap, first_cap):
    """PyTorch's own function, called as DDP's reducer calls it when it rebuilds its
    buckets: fp32 tensors in gradient-ready order, limits [first_cap, cap]."""
    import torch
    import torch.distributed as dist

    tensors = [torch.empty(nbytes[i] // 4) for i in ready]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, [first_cap, cap], [False] * len(ready), list(ready)
    )
    return [list(b) for b in buckets]


def random_bucket_cases(n: int, seed: int):
    """Random fp32 size lists, gradient-ready orders (reversed, or with neighbours swapped
    as a LayerNorm's weight and bias arrive), caps and first-bucket caps (equal, smaller,
    larger)."""
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(1, 20)
        nbytes = [4 * rng.randint(1, 64) for _ in range(k)]
        ready = list(reversed(range(k)))
        for _ in range(rng.randint(0, 3)):
            j = rng.randrange(max(1, k - 1))
            ready[j : j + 2] = ready[j : j + 2][::-1]
        cap = 4 * rng.randint(1, 96)
        first_cap = rng.choice([cap, 4 * rng.randint(1, 96)])
        yield nbytes, ready, cap, first_cap


def disagreements(fn, n: int = 500, seed: int = 1) -> int:
    return sum(
        fn(list(b), list(r), c, f) != torch_assignment(b, r, c, f)
        for b, r, c, f in random_bucket_cases(n, seed)
    )


def test_make_buckets_is_torchs_own_assignment():
    """The exercise's reference equals torch.distributed._compute_bucket_assignment_by_size
    (what DDP's reducer calls) on 500 random size lists, orders, caps and first caps; the
    rule the notebook used to teach does not (the issue's example included)."""
    assert disagreements(solutions.make_buckets) == 0
    example = ([40, 8, 40, 8, 16], [4, 3, 2, 1, 0], 48, 48)
    assert torch_assignment(*example) == [[4, 3, 2], [1, 0]]
    assert solutions.make_buckets(*example) == [[4, 3, 2], [1, 0]]
    assert old_rule(*example) == [[4, 3], [2, 1], [0]]
    assert disagreements(old_rule) > 250


def test_other_dtypes_and_sparse_gradients_get_their_own_buckets():
    """What notebook 5 says beside the exercise, on torch's own function: a gradient of
    another dtype goes to a bucket of its own dtype, a sparse one to a bucket alone."""
    import torch

    mixed = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4)]
    assert dist._compute_bucket_assignment_by_size(mixed, [1000])[0] == [[0, 2], [1]]
    same = [torch.empty(4) for _ in range(3)]
    sparse = dist._compute_bucket_assignment_by_size(same, [1000], [False, True, False])[0]
    assert sparse == [[0, 2], [1]]


def test_the_checks_cases_are_torchs():
    """The self-check's own expected buckets come from torch's function."""
    for b, r, c, f in checks.bucket_cases():
        assert checks.torch_buckets(b, r, c, f) == torch_assignment(b, r, c, f)


def _closing(nbytes, ready, cap, first_cap, *, passed=False, first=None, order=None):
    """The right rule with one thing changed."""
    out, open_bucket, size = [], [], 0
    for i in order if order is not None else ready:
        open_bucket.append(i)
        size += nbytes[i]
        limit = cap if out else (first_cap if first is None else first)
        if (size > limit) if passed else (size >= limit):
            out.append(open_bucket)
            open_bucket, size = [], 0
    return out + ([open_bucket] if open_bucket else [])


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (old_rule, "does not close a bucket before it would pass the limit"),
        (lambda b, r, c, f: _closing(b, r, c, f, passed=True), r"reach the limit \(>=\)"),
        (lambda b, r, c, f: _closing(b, r, c, f, first=c), "own, smaller limit first_cap"),
        (
            lambda b, r, c, f: _closing(b, r, c, f, order=list(reversed(range(len(b))))),
            "not always the reverse",
        ),
        (lambda b, r, c, f: _closing(b, r, c, f, order=list(range(len(b)))), "registration"),
        (lambda b, r, c, f: [sorted(x) for x in _closing(b, r, c, f)], "order they were added"),
        (lambda b, r, c, f: [list(r)], "close the bucket once its bytes reach its limit"),
        (lambda b, r, c, f: _closing(b, r, c, f)[:-1], "exactly one bucket"),
    ],
)
def test_wrong_buckets_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_make_buckets(wrong)


def patched(strategy_to_break: str, change):
    def fn(strategy, **kw):
        right = solutions.bytes_sent_per_rank(strategy, **kw)
        return change(right, kw) if strategy == strategy_to_break else right

    return fn


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (patched("ddp", lambda v, kw: v / 2), "reduce-scatter followed by an all-gather"),
        (patched("ddp", lambda v, kw: 2 * kw["psi"] * 4), r"\(n−1\)/n"),
        (
            patched("zero1_torch", lambda v, kw: solutions.bytes_sent_per_rank("ddp", **kw)),
            "then each rank broadcasts",
        ),
        (
            # what notebook 6 used to say: sharding the state costs one more Ψ
            patched("zero2", lambda v, kw: solutions.bytes_sent_per_rank("zero1_torch", **kw)),
            r"ZeroRedundancyOptimizer .*§7\.2\.1",
        ),
        (patched("zero2", lambda v, kw: v / 2), "all-gather of the parameters"),
        (patched("fsdp", lambda v, kw: solutions.bytes_sent_per_rank("ddp", **kw)), "twice"),
        (patched("tp", lambda v, kw: v / 2), "backward all-reduces too"),
        (patched("pp", lambda v, kw: v / 2), "comes back in backward"),
        (patched("tp", lambda v, kw: solutions.bytes_sent_per_rank("ddp", **kw)), "activations"),
    ],
)
def test_wrong_byte_predictions_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_bytes_sent_per_rank(wrong)


def test_ring_bytes_per_rank():
    assert checks.ring_bytes_per_rank({"all_reduce": 100, "all_gather": 40}, 2, 30) == 100 + 20 + 15
    with pytest.raises(CheckFailed):
        checks.ring_bytes_per_rank({"all_to_all": 8}, 2)


def test_script_buckets_are_the_reference_rule():
    script = load_script(SCRIPTS / "ddp_by_hand.py")
    assert script.make_buckets is solutions.make_buckets
    # DDP's caps (torch/nn/parallel/distributed.py, _BucketCapacityConfig.create)
    assert script.ddp_bucket_caps(None) == (25 * 2**20, dist._DEFAULT_FIRST_BUCKET_BYTES)
    assert script.ddp_bucket_caps(0.01) == (int(0.01 * 2**20),) * 2


def test_replay_and_fit():
    script = load_script(SCRIPTS / "ddp_by_hand.py")
    # one bucket: it starts when backward ends, so all of it is exposed
    assert script.replay_exposed([100], 1.0, 0.1, 0.01) == pytest.approx(0.1 + 1.0)
    # two halves: the first (0.6 s) runs 0.5–1.1, the second 1.1–1.7, so 0.7 s after backward
    assert script.replay_exposed([50, 50], 1.0, 0.1, 0.01) == pytest.approx(0.7)
    # on shared cores nothing hides: every all-reduce adds α + β·bytes
    assert script.replay_serial([50, 50], 0.1, 0.01) == pytest.approx(1.2)
    assert script.fit_alpha_beta([0, 10, 20], [1.0, 2.0, 3.0]) == pytest.approx((1.0, 0.1))
    # a ring all-reduce: each rank sends 2(N−1)/N of the data
    assert script.ring_bytes(100, 2) == 100 and script.ring_bytes(100, 4) == 150


# ------------------------------------------------------------------ the hand-made DDP, run
# 3.7 MB of fp32 gradients: more than DDP's 1 MiB first bucket, so its own cap shows
WIDE = ["--d-model", "192", "--heads", "4", "--layers", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def hand_ddp_runs():
    """One 2-process run: HandDDP as written, without the average, and with a bucket sent
    early; then HandDDP's buckets beside DDP's at 4 KiB, 0.01 MB and DDP's default caps."""
    result = launch.run(
        SCRIPTS / "ddp_by_hand.py",
        [
            *WIDE,
            "--batch-size",
            "4",
            "--n-chars",
            "20000",
            "--steps",
            "2",
            "--bucket-kb",
            "4",
            "--compare-mb",
            "0.01",
            "default",
            "--no-timing",
            "--bugs",
            "none",
            "no_average",
            "early_bucket",
        ],
        nprocs=2,
        timeout=240,
        echo=False,
        env=QUICK,
    ).check()
    runs = {m["bug"]: m for m in result.events("equivalence")}
    (buckets,) = result.events("buckets")
    return runs, buckets["caps"]


@pytest.mark.launcher
def test_hand_ddp_equals_ddp(hand_ddp_runs):
    run = hand_ddp_runs[0]["none"]
    assert run["buckets"] > 2  # several buckets, so the hooks' order matters
    assert run["buckets"] == run["ddp_buckets"]
    checks.check_hand_ddp(run)


@pytest.mark.launcher
def test_hand_ddp_buckets_are_ddps(hand_ddp_runs):
    """HandDDP's buckets, and the reference make_buckets on the order the gradients
    arrived, equal the buckets DistributedDataParallel itself made, parameter by
    parameter, at every cap, DDP's default (a 1 MiB first bucket, then 25 MiB) included.
    The old rule (close before passing the cap, no first-bucket cap) misses them."""
    caps = hand_ddp_runs[1]
    assert [c["bucket_cap_mb"] for c in caps] == [4 / 1024, 0.01, None]
    old_matches = 0
    for c in caps:
        assert c["hand"] == c["ddp"]
        assert solutions.make_buckets(c["nbytes"], c["order"], c["cap"], c["first_cap"]) == c["ddp"]
        old_matches += old_rule(c["nbytes"], c["order"], c["cap"], c["first_cap"]) == c["ddp"]
    assert old_matches == 0
    default = caps[-1]
    first = sum(default["nbytes"][i] for i in default["ddp"][0])
    assert len(default["ddp"]) == 2 and first >= dist._DEFAULT_FIRST_BUCKET_BYTES


@pytest.mark.launcher
@pytest.mark.parametrize(
    "bug, hint",
    [("no_average", "divide by the number of ranks"), ("early_bucket", "before all its gradients")],
)
def test_hand_ddp_mistakes_fail(hand_ddp_runs, bug, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_hand_ddp(hand_ddp_runs[0][bug])


# ------------------------------------------------------------------ the profiler script, mpirun
@pytest.mark.launcher
def test_profile_ddp_under_mpirun(tmp_path):
    """Under mpirun too, each rank writes its trace, and the trace holds one all-reduce per
    DDP bucket per recorded step."""
    result = launch.run(
        SCRIPTS / "profile_ddp.py",
        [*TINY, "--bucket-cap-mb", "0.005", "--active", "1", "--out", str(tmp_path)],
        nprocs=2,
        launcher="mpirun",
        timeout=240,
        echo=False,
        env=dict(QUICK, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
    ).check()
    (run,) = result.events("trace")
    assert run["buckets"] > 1
    for path in run["paths"]:
        t = trace.load(path)
        assert trace.per_step(t, "all_reduce") == run["buckets"]
        assert 0.0 <= trace.overlap_fraction(t.compute, t.comm) <= 1.0


# ------------------------------------------------------------------ ZeRO's bytes, counted
@pytest.mark.launcher
def test_zero2_sends_ddps_bytes_and_zero_redundancy_optimizer_more():
    """Counted in a run (Gloo, 2 processes): ZeRO stage 2 as Rajbhandari et al. define it
    (reduce-scatter of the gradients, all-gather of the updated parameters, §7.2.1) sends
    per rank exactly DDP's 2(N−1)/N·Ψ values and trains the weights one process would;
    PyTorch's ZeroRedundancyOptimizer sends (N−1)/N·Ψ more (its broadcast). The exercise's
    reference predicts each; "sharding the state costs one extra Ψ" holds for
    ZeroRedundancyOptimizer only."""
    result = launch.run(
        SCRIPTS / "predicted_bytes.py",
        [*TINY, "--strategies", "ddp", "zero1_torch", "zero2"],
        nprocs=2,
        timeout=240,
        echo=False,
        env=QUICK,
    ).check()
    (shape,) = result.events("model")
    runs = {m["strategy"]: m for m in result.events("counted")}
    n, psi = shape["procs"], shape["psi"]
    sent = {s: checks.ring_bytes_per_rank(r["bytes"], n) for s, r in runs.items()}
    assert set(runs["zero2"]["bytes"]) == {"reduce_scatter", "all_gather"}
    assert set(runs["zero1_torch"]["bytes"]) == {"all_reduce", "broadcast"}
    assert sent["zero2"] == sent["ddp"] == 2 * (n - 1) / n * psi * 4
    assert sent["zero1_torch"] == 3 * (n - 1) / n * psi * 4
    sizes = {k: shape[k] for k in ("batch_size", "seq_len", "d_model", "layers")}
    for strategy, counted in sent.items():
        predicted = solutions.bytes_sent_per_rank(
            strategy,
            n=n,
            psi=psi,
            batch=sizes["batch_size"],
            seq_len=sizes["seq_len"],
            d_model=sizes["d_model"],
            layers=sizes["layers"],
        )
        assert counted == pytest.approx(predicted, rel=1e-12)
    assert runs["zero2"]["weight_rel_err"] <= 1e-5


def test_when_ddp_rebuilds_its_buckets_is_what_notebook_5_says():
    """6.5 says: DDP starts with one bucket of everything (``sys.maxsize``) unless
    ``find_unused_parameters=True``; it rebuilds in gradient-ready order at the start of
    the second forward, one iteration later with ``static_graph=True``, and never with
    ``find_unused_parameters=True`` (buckets stay in reversed registration order). Run
    against torch itself (tests/jobs/ddp_rebuild.py: sizes before and after each of four
    iterations)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "jobs" / "ddp_rebuild.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    default, static, unused = (
        seen[k] for k in ("default", "static_graph", "find_unused_parameters")
    )
    everything = sum(default[0])
    assert default[0] == [everything] and static[0] == [everything]  # one bucket at first
    rebuilt = default[2]
    assert default[1] == default[0] and rebuilt != default[0]  # rebuilt at the 2nd forward
    assert default[2:] == [rebuilt] * 3  # once only
    assert static[:3] == [[everything]] * 3 and static[3:] == [rebuilt] * 2  # a step later
    assert len(unused[0]) > 1 and unused == [unused[0]] * 5  # never rebuilt
    assert unused[0][0] == 4 * 8 and rebuilt[0] == 64 * 8  # reversed registration vs ready
