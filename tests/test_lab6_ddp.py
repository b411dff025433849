"""Lab 6, notebooks 4–6: the trace reader on hand-made traces, the bucket and byte
exercises (and that wrong answers fail them), the hand-made DDP against
DistributedDataParallel (and that a missing average or an early bucket fails the check),
and the profiler script under mpirun. The notebooks run the scripts with torchrun.
"""

import os

import pytest
from conftest import REPO, tiny_transformer

from lab_utils import launch, trace
from lab_utils.checks import CheckFailed
from lab_utils.checks import lab6 as checks
from lab_utils.solutions import lab6 as solutions
from lab_utils.source import load_script

SCRIPTS = REPO / "labs" / "lab6_efficiency" / "scripts"
QUICK = {"LABS_PROFILE": "quick"}
TINY = tiny_transformer(steps=None)


def events_of(result: launch.LaunchResult, kind: str) -> list[dict]:
    return [m for m in result.metrics if m.get("event") == kind]


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


def forward_order(nbytes, cap):
    out, size = [], 0
    for i, b in enumerate(nbytes):
        if out and size + b <= cap:
            out[-1].append(i)
            size += b
        else:
            out.append([i])
            size = b
    return out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (forward_order, "LAST layer"),
        (lambda nbytes, cap: [list(reversed(range(len(nbytes))))], "passed the cap"),
        (lambda nbytes, cap: [[i] for i in reversed(range(len(nbytes)))], "would not fit"),
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
        (patched("zero1", lambda v, kw: solutions.bytes_sent_per_rank("ddp", **kw)), "broadcasts"),
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
    for sizes, cap in (([40, 8, 40, 8, 16], 48), ([4] * 9, 8), ([100], 1)):
        assert script.make_buckets(sizes, cap) == solutions.make_buckets(sizes, cap)


def test_replay_exposed_communication():
    script = load_script(SCRIPTS / "ddp_by_hand.py")
    # one bucket: it starts when backward ends, so all of it is exposed
    assert script.replay_exposed([100], 1.0, 0.1, 0.01) == pytest.approx(0.1 + 1.0)
    # two halves: the first (0.6 s) runs 0.5–1.1, the second 1.1–1.7, so 0.7 s after backward
    assert script.replay_exposed([50, 50], 1.0, 0.1, 0.01) == pytest.approx(0.7)
    assert script.fit_alpha_beta([0, 10, 20], [1.0, 2.0, 3.0]) == pytest.approx((1.0, 0.1))


# ------------------------------------------------------------------ the hand-made DDP, run
@pytest.fixture(scope="module")
def hand_ddp_runs():
    """One 2-process run: HandDDP as written, without the average, and with a bucket sent early."""
    result = launch.run(
        SCRIPTS / "ddp_by_hand.py",
        [
            *TINY,
            "--steps",
            "2",
            "--bucket-kb",
            "4",
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
    return {m["bug"]: m for m in events_of(result, "equivalence")}


@pytest.mark.launcher
def test_hand_ddp_equals_ddp(hand_ddp_runs):
    run = hand_ddp_runs["none"]
    assert run["buckets"] > 2  # several buckets, so the hooks' order matters
    checks.check_hand_ddp(run)


@pytest.mark.launcher
@pytest.mark.parametrize(
    "bug, hint",
    [("no_average", "divide by the number of ranks"), ("early_bucket", "before all its gradients")],
)
def test_hand_ddp_mistakes_fail(hand_ddp_runs, bug, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_hand_ddp(hand_ddp_runs[bug])


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
    (run,) = events_of(result, "trace")
    assert run["buckets"] > 1
    for path in run["paths"]:
        t = trace.load(path)
        assert trace.per_step(t, "all_reduce") == run["buckets"]
        assert 0.0 <= trace.overlap_fraction(t.compute, t.comm) <= 1.0
