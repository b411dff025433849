"""Lab 4's pipelines: the F/B timeline, the replay of a schedule from a run's own block
times (and that its check fails a timeline the schedule does not explain), the counts
of blocks and micro-batches in flight, and pipeline.py under torchrun (4 stages, a
crashed stage).
"""

import random

import pytest
import torch
from conftest import REPO, launch_quick, processes_matching, script_help, tiny_transformer

import lab4_checks as checks
from lab_utils import launch, models, parallel, timeline
from lab_utils.checks import CheckFailed
from lab_utils.source import load_script

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "pipeline.py"
TINY = tiny_transformer(layers=4)


def run(args, *, nprocs: int, timeout: float = 240, env=None) -> launch.LaunchResult:
    return launch_quick(SCRIPT, args, nprocs=nprocs, timeout=timeout, env=env)


# ------------------------------------------------------------------ timelines
def gpipe_events(p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[dict]:
    """The ideal GPipe timeline: stage s does F_i in slot s+i, then the backwards."""
    ev = []
    for s in range(p):
        for i in range(m):
            ev.append(
                {"rank": s, "kind": "F", "mb": i, "start": (s + i) * f, "end": (s + i + 1) * f}
            )
        t_end_f = (m + p - 1) * f
        for i in range(m):
            start = t_end_f + (p - 1 - s + i) * b
            ev.append({"rank": s, "kind": "B", "mb": i, "start": start, "end": start + b})
    return ev


def sequential_events(p: int, m: int) -> list[dict]:
    """A wrong schedule: each micro-batch crosses all stages before the next starts."""
    ev, t = [], 0.0
    for i in range(m):
        for s in range(p):
            ev.append({"rank": s, "kind": "F", "mb": i, "start": t, "end": t + 1})
            t += 1
        for s in reversed(range(p)):
            ev.append({"rank": s, "kind": "B", "mb": i, "start": t, "end": t + 2})
            t += 2
    return ev


def simulated(
    schedule: str, p: int, m: int, *, seed: int = 0, idle: tuple | None = None
) -> list[dict]:
    """A timeline as a busy machine gives it: blocks of uneven length, a random wait before
    each (messages, scheduling), and optionally ``idle = (rank, kind, mb, seconds)``: a
    stage that waits that long before that block for no reason the schedule knows."""
    rng = random.Random(seed)
    durations = {
        (r, k, i): (1.0 if k == "F" else 2.0) * rng.uniform(0.8, 1.2)
        for r in range(p)
        for k in "FB"
        for i in range(m)
    }
    ev = [timeline.Event(r, k, i, 0.0, d) for (r, k, i), d in durations.items()]
    order = {r: timeline.schedule_order(schedule, p, m, r) for r in range(p)}
    done: dict = {}
    pos = dict.fromkeys(range(p), 0)
    while len(done) < len(ev):
        for r in range(p):
            if pos[r] == len(order[r]):
                continue
            k, i = order[r][pos[r]]
            dep = (
                ((r - 1, "F", i) if r > 0 else None)
                if k == "F"
                else ((r + 1, "B", i) if r < p - 1 else None)
            )
            if dep is not None and dep not in done:
                continue
            prev = done[(r, *order[r][pos[r] - 1])] if pos[r] else 0.0
            start = max(prev, done[dep] if dep else 0.0) + rng.uniform(0.02, 0.08)
            if idle and idle[:3] == (r, k, i):
                start += idle[3]
            done[(r, k, i)] = start + durations[(r, k, i)]
            pos[r] += 1
    return [
        {"rank": r, "kind": k, "mb": i, "start": done[(r, k, i)] - d, "end": done[(r, k, i)]}
        for (r, k, i), d in durations.items()
    ]


def a_run(schedule: str, events: list[dict], p: int, m: int) -> dict:
    return {"schedule": schedule, "stages": p, "microbatches": m, "events": events}


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8)])
def test_ideal_gpipe_timeline_has_the_formula_bubble(p, m):
    assert timeline.bubble_fraction(gpipe_events(p, m)) == pytest.approx(
        timeline.ideal_bubble(p, m)
    )


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8)])
def test_replay_of_equal_stages_and_free_messages_is_the_formula(p, m):
    for schedule in ("gpipe", "1f1b"):
        assert timeline.replay(gpipe_events(p, m), schedule).bubble == pytest.approx(
            timeline.ideal_bubble(p, m)
        )


def test_schedule_orders_are_torchs():
    assert timeline.schedule_order("gpipe", 2, 3, 1) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]
    # Schedule1F1B: stage s runs p − s forwards first, then one backward, one forward
    assert timeline.schedule_order("1f1b", 4, 6, 1) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("F", 4),
        ("B", 2),
        ("F", 5),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    assert timeline.schedule_order("1f1b", 4, 6, 3)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize(
    "schedule,p,m", [("gpipe", 2, 8), ("1f1b", 2, 8), ("gpipe", 4, 8), ("1f1b", 4, 8)]
)
def test_bubble_check_passes_a_busy_but_consistent_timeline(schedule, p, m):
    for seed in range(5):
        run = a_run(schedule, simulated(schedule, p, m, seed=seed), p, m)
        checks.check_schedule(run)
        assert checks.check_bubble(run) >= 0


def test_bubble_check_fails_a_stage_idling_for_no_reason():
    p, m = 2, 8
    run = a_run("gpipe", simulated("gpipe", p, m, idle=(1, "B", 3, 3.0)), p, m)
    checks.check_schedule(run)  # the right blocks in the right order: only the time is wrong
    with pytest.raises(CheckFailed, match="replayed"):
        checks.check_bubble(run)


def test_bubble_check_fails_a_sequential_schedule():
    p, m = 2, 4
    run = a_run("gpipe", sequential_events(p, m), p, m)
    with pytest.raises(CheckFailed, match="replayed"):
        checks.check_bubble(run)
    with pytest.raises(CheckFailed, match="out of the schedule's order"):
        checks.check_schedule(run)


def test_old_formula_check_passed_a_wrong_schedule_the_replay_catches():
    # Within ±0.12 of (p−1)/(m+p−1), as the notebook used to assert, yet a stage idled
    # three forward-times for no reason: only the replay from the run's own times sees it.
    p, m = 2, 8
    run = a_run("gpipe", simulated("gpipe", p, m, idle=(0, "F", 5, 3.0)), p, m)
    assert abs(timeline.bubble_fraction(run["events"]) - timeline.ideal_bubble(p, m)) <= 0.12
    with pytest.raises(CheckFailed):
        checks.check_bubble(run)


def test_schedule_check_counts_missing_blocks():
    p, m = 2, 4
    events = [
        e for e in gpipe_events(p, m) if not (e["rank"] == 1 and e["kind"] == "B" and e["mb"] == 3)
    ]
    with pytest.raises(CheckFailed, match="stage 1: B blocks"):
        checks.check_schedule(a_run("gpipe", events, p, m))


def test_in_flight_counts_and_its_check():
    flights = {"gpipe": {r: v[0] for r, v in timeline.in_flight(gpipe_events(2, 4)).items()}}
    assert flights["gpipe"] == {0: 4, 1: 4}
    flights["1f1b"] = {0: 2, 1: 1}
    checks.check_in_flight(flights, 2, 4)
    flights["1f1b"] = flights["gpipe"]  # a "1F1B" that holds everything is wrong
    with pytest.raises(CheckFailed):
        checks.check_in_flight(flights, 2, 4)


def test_timed_stage_records_and_keeps_gradients():
    torch.manual_seed(0)
    model = models.build("char_transformer", d_model=16, n_heads=2, n_layers=2, max_len=8)
    x = torch.randint(0, 96, (4, 8))
    y = torch.randint(0, 96, (4, 8))
    parallel.lm_loss(model(x), y).backward()
    want = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    stage = timeline.TimedStage(list(model.layers), rank=0)
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        (parallel.lm_loss(stage(xm), ym) / 2).backward()
    got = {n: q.grad for n, q in model.named_parameters()}
    assert parallel.relative_error(got, want) < 1e-6
    kinds = sorted((e.kind, e.mb) for e in stage.events)
    assert kinds == [("B", 0), ("B", 1), ("F", 0), ("F", 1)]
    assert all(e.end >= e.start for e in stage.events)
    assert all(e.saved_bytes > 0 for e in stage.events if e.kind == "F")


# ------------------------------------------------------------------ the script
def test_help_shows_the_profiles_defaults(monkeypatch):
    out = script_help(monkeypatch, SCRIPT)
    assert "default: 2" in out and "'quick' profile" in out


def test_one_process_and_pipeline_alternate_a_b_b_a():
    assert load_script(SCRIPT).interleaved(3) == [
        "serial",
        "pipe",
        "pipe",
        "serial",
        "serial",
        "pipe",
    ]


@pytest.mark.launcher
def test_pipeline_on_4_stages(tmp_path):
    ckpt = tmp_path / "pp4.pt"
    result = run(
        [*TINY, "--microbatches", "4", "--repeats", "2", "--checkpoint", ckpt], nprocs=4
    ).check()
    runs = result.events("pipeline")
    assert {(r["schedule"], r["microbatches"]) for r in runs} == {("gpipe", 4), ("1f1b", 4)}
    for r in runs:
        checks.check_equal(r["grad_rel_err"], what=f"{r['schedule']} on 4 stages")
        checks.check_schedule(r)
        checks.check_bubble(r)  # a comparison inside the run: holds on a busy machine too
        assert (
            len(r["serial_samples"]) == len(r["pipe_samples"]) == len(r["every_step_bubble"]) == 2
        )
    held = {r["schedule"]: {int(k): v[0] for k, v in r["in_flight"].items()} for r in runs}
    checks.check_in_flight(held, 4, 4)
    assert isinstance(models.load(ckpt), models.CharTransformer)


@pytest.mark.launcher
def test_a_crashed_stage_ends_the_pipeline(tmp_path):
    timeout = 120
    result = run(
        [
            *TINY,
            "--microbatches",
            "2",
            "--repeats",
            "1",
            "--schedules",
            "gpipe",
            "--crash-stage",
            "1",
        ],
        nprocs=2,
        timeout=timeout,
        env={"LABS_DIST_TIMEOUT": "30"},
    )
    assert not result.ok and not result.timed_out and result.elapsed < timeout
    assert "deliberate crash" in result.output
    assert processes_matching(str(SCRIPT)) == []


def test_bubble_check_takes_the_least_disturbed_of_the_timed_steps():
    """One step delayed by another program passes; a disturbance in every step fails."""
    quiet = [0.30, 0.30, 0.01]  # measured, replayed, noise
    disturbed = [0.42, 0.37, 0.01]
    run = {
        "schedule": "gpipe",
        "microbatches": 4,
        "stages": 2,
        "every_step_bubble": [disturbed, quiet, disturbed],
    }
    assert checks.check_bubble(run) > 0
    run["every_step_bubble"] = [disturbed, disturbed, disturbed]
    with pytest.raises(CheckFailed, match="0 of 3 agree"):
        checks.check_bubble(run)
