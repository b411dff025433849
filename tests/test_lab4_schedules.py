"""Lab 4.6's schedules: torch's own plans (built without processes) against the closed forms
the notebook prints ((p−1)/m, (p−1)/(v·m), (p−1)/(3·v·m)), the paper's zero-bubble measure
(only ZB-V reaches 0) and the peak activations each plan holds (the zero-bubble plans keep
1F1B's); the bubble exercise's check (the reference passes, each named mistake fails); the
replay of a run's plans from its block times, W blocks holding activations, the checks of a
run's blocks and bubble (and that they fail a wrong timeline), and pipeline_schedules.py
under torchrun.
"""

import inspect
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from conftest import REPO, launch_quick, script_help, script_stop, tiny_transformer
from torch.distributed import pipelining as pp

import lab4_checks as checks
import lab4_solutions as reference
from lab_utils import launch, models, timeline
from lab_utils.checks import CheckFailed
from lab_utils.source import load_script

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "pipeline_schedules.py"
TINY = [*tiny_transformer(layers=4), "--microbatches", "4", "--repeats", "2"]
SCHEDULES = ["1f1b", "interleaved", "zbv"]


def run(args, *, nprocs: int, timeout: float = 240) -> launch.LaunchResult:
    return launch_quick(SCRIPT, args, nprocs=nprocs, timeout=timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One run of the four schedules on 2 processes, shared by the tests below."""
    ckpt = tmp_path_factory.mktemp("schedules") / "ps.pt"
    result = run([*TINY, "--schedules", *SCHEDULES, "--checkpoint", ckpt], nprocs=2).check()
    return {r["schedule"]: r for r in result.events("schedule")}, ckpt


def ideal(order: dict, f: float = 1.0, b: float = 2.0, w: float = 0.0) -> list[dict]:
    """Blocks of equal length per kind (B + W = b when the schedule splits W off) and no
    overhead, at the stages and ranks of ``order``; placed by the replay."""
    cost = {"F": f, "B": b - w if w else b, "W": w}
    ev = [
        {"rank": int(r), "kind": k, "mb": i, "stage": s, "start": 0.0, "end": cost[k]}
        for r, acts in order.items()
        for s, k, i in acts
    ]
    return [e.as_dict() for e in timeline.replay(ev, order).events]


# ------------------------------------------------------------------ the model
@pytest.mark.launcher
def test_replay_of_equal_blocks_gives_the_interleaving_formula(two_ranks):
    """torch's interleaved 1F1B plan, equal blocks, free messages: idle / compute = (p−1)/(v·m);
    1F1B's: (p−1)/m."""
    runs, _ = two_ranks
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        ev = ideal(runs[name]["order"])
        bubble = timeline.bubble_fraction(ev)
        assert bubble / (1 - bubble) == pytest.approx((2 - 1) / (v * 4))


@pytest.mark.launcher
def test_zero_bubble_plans_fill_the_bubble_with_w(two_ranks):
    runs, _ = two_ranks
    one = timeline.bubble_fraction(ideal(runs["1f1b"]["order"], b=2.0))
    assert timeline.bubble_fraction(ideal(runs["zbv"]["order"], b=2.0, w=1.0)) < one


def test_w_holds_the_activations_until_it_ends():
    """A micro-batch is held until its W: counted as released at its B, 2 were held here."""
    ev = [
        {"rank": 0, "stage": 0, "kind": "F", "mb": 0, "start": 0, "end": 1, "saved_bytes": 10},
        {"rank": 0, "stage": 0, "kind": "F", "mb": 1, "start": 1, "end": 2, "saved_bytes": 10},
        {"rank": 0, "stage": 0, "kind": "B", "mb": 0, "start": 2, "end": 3},
        {"rank": 0, "stage": 0, "kind": "F", "mb": 2, "start": 3, "end": 4, "saved_bytes": 10},
        {"rank": 0, "stage": 0, "kind": "W", "mb": 0, "start": 4, "end": 5},
    ]
    assert timeline.in_flight(ev)[0] == (3, 30)


# ------------------------------------------------------------------ torch's own plans
# Each torch schedule's plan (its action list, built without processes), replayed with equal
# F, B and W blocks and free messages: counts, no timing.
PLANS = {  # name: (class, stages per rank, V-shaped)
    "1f1b": (pp.Schedule1F1B, 1, False),
    "interleaved": (pp.ScheduleInterleaved1F1B, 2, False),
    "interleaved_zb": (pp.ScheduleInterleavedZeroBubble, 2, False),
    "zbv": (pp.ScheduleZBVZeroBubble, 2, True),
    "dualpipev": (pp.ScheduleDualPipeV, 2, True),
}


def torch_plan(name: str, p: int, m: int, v: int | None = None) -> dict:
    cls, v0, vs = PLANS[name]
    return timeline.plan(cls, p, m, v or v0, vs)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_closed_forms_equal_torchs_plans(p, k):
    """The formulas the notebook prints are the plans' own bubbles (idle / compute, equal
    F, B, W): 1F1B (p−1)/m, interleaved (p−1)/(v·m), interleaved zero bubble (torch's
    ZB1P), ZB-V and DualPipeV (p−1)/(3·v·m) — not zero, however large m."""
    mod = load_script(SCRIPT)
    m = k * p
    for name in ("1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev"):
        for v in (2, 3) if name in ("interleaved", "interleaved_zb") else (PLANS[name][1],):
            want = mod.formula_ratio(name, p, m, v)
            if want is None:
                assert name in ("zbv", "dualpipev") and m < 2 * p
                continue
            got = timeline.plan_ratio(torch_plan(name, p, m, v))
            assert got == pytest.approx(want, rel=1e-9), (name, p, m, v)
            assert got > 0


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_only_zb_v_is_zero_bubble_the_papers_way(p, m):
    """Measured as Qi et al. measure (each rank from its own first block): ZB-V has no
    bubble; torch's interleaved zero bubble (ZB1P) and DualPipeV (its pairs run one after
    the other) keep (p−1)/(3·v·m), the same as on a step that ends together."""
    assert timeline.stage_ratio(torch_plan("zbv", p, m)) == pytest.approx(0, abs=1e-12)
    for name in ("interleaved_zb", "dualpipev"):
        plan = torch_plan(name, p, m)
        assert timeline.stage_ratio(plan) == pytest.approx((p - 1) / (3 * 2 * m), rel=1e-9)
        assert timeline.plan_ratio(plan) == pytest.approx((p - 1) / (3 * 2 * m), rel=1e-9)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (8, 16)])
def test_zero_bubble_plans_hold_what_1f1b_holds(p, m):
    """Peak activations per rank (micro-batches through a rank's layers), counted from
    each plan's order: torch's interleaved zero bubble and ZB-V hold at most 1F1B's p on
    every rank (ZB-H1 and ZB-V are built to 1F1B's peak); interleaved 1F1B and DualPipeV
    hold more."""
    peak = {
        name: max(timeline.peak_held(torch_plan(name, p, m), PLANS[name][1]).values())
        for name in PLANS
    }
    assert peak["1f1b"] == p
    assert peak["interleaved_zb"] == peak["zbv"] == p
    assert peak["interleaved"] > p and peak["dualpipev"] > p


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_zb_v_keeps_p_minus_1_over_6m_on_the_common_span(p, m):
    """4.6's table row for ZB-V: measured from the first block on any rank to the last on
    any rank (what the run measures, after a start barrier), torch's ZB-V plan keeps
    (p−1)/(6m), the later ranks' warm-up; counted per rank (Qi et al.) it keeps 0."""
    plan = torch_plan("zbv", p, m)
    assert timeline.plan_ratio(plan) == pytest.approx((p - 1) / (6 * m), rel=1e-9)
    assert timeline.stage_ratio(plan) == pytest.approx(0, abs=1e-12)
    assert load_script(SCRIPT).formula_ratio("zbv", p, m, 2) == pytest.approx((p - 1) / (6 * m))


def test_zb_v_needs_m_of_2p_for_that_bubble():
    """Below m = 2p the row does not hold: p=4, m=4 keeps 0.25, not (p−1)/(6m) = 0.125."""
    assert timeline.plan_ratio(torch_plan("zbv", 4, 4)) == pytest.approx(0.25)
    assert load_script(SCRIPT).formula_ratio("zbv", 4, 4, 2) is None


def _zbv_run(events: list[dict]) -> dict:
    order = torch_plan("zbv", 2, 4)
    return {"schedule": "zbv", "microbatches": 4, "stages": 2, "order": order, "events": events}


def test_step_bubble_check_fails_a_timeline_with_no_idle_time():
    """The plan's own timeline agrees with its replay; the same blocks run back to back on
    every rank (no idle at all) fail, since their replay keeps the plan's bubble."""
    order = torch_plan("zbv", 2, 4)
    assert checks.check_step_bubble(_zbv_run(ideal(order, b=2.0, w=1.0))) > 0
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    packed, t = [], dict.fromkeys(order, 0.0)
    for r, acts in order.items():
        for s, k, i in acts:
            packed.append({"rank": r, "kind": k, "mb": i, "stage": s, "start": t[r]})
            t[r] += cost[k]
            packed[-1]["end"] = t[r]
    assert timeline.bubble_fraction(packed) == pytest.approx(0)
    with pytest.raises(CheckFailed, match="replayed with this run's block times"):
        checks.check_step_bubble(_zbv_run(packed))


def test_a_margin_wider_than_the_bubble_is_shown_not_passed():
    """Where the run's spread allows more than the replayed bubble, a timeline with no idle
    time (measured 0) would agree: reported as not resolved, never passed."""
    out = io.StringIO()
    with redirect_stdout(out):
        got = checks.bubble_agrees(0.0, 0.2, 0.06, what="no idle at all")
    assert got is None
    assert "not resolved" in out.getvalue() and "✔" not in out.getvalue()
    with pytest.raises(CheckFailed):  # a margin the bubble exceeds: the same timeline fails
        checks.bubble_agrees(0.0, 0.2, 0.01, what="no idle at all")
    with redirect_stdout(io.StringIO()):
        assert checks.bubble_agrees(0.19, 0.2, 0.01, what="agrees") > 0


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_interleaved_zero_bubble_with_one_stage_per_rank_is_the_papers_zb1p(p, m):
    """torch's ScheduleInterleavedZeroBubble with v = 1 keeps the paper's ZB-1p bubble,
    (p−1)/(3m) with equal F, B, W, and 1F1B's peak of p micro-batches; the v = 2 the lab
    runs divides it by v."""
    stages = [timeline._PlanStage(0, p, p, 0)]
    plan = timeline.schedule_actions(pp.ScheduleInterleavedZeroBubble(stages, m, loss_fn=None))
    assert timeline.plan_ratio(plan) == pytest.approx((p - 1) / (3 * m), rel=1e-9)
    assert max(timeline.peak_held(plan, 1).values()) == p
    assert timeline.plan_ratio(torch_plan("interleaved_zb", p, m, 2)) == pytest.approx(
        (p - 1) / (3 * 2 * m), rel=1e-9
    )


@pytest.mark.parametrize("p, m, more", [(2, 2, False), (4, 4, False), (2, 4, True), (4, 8, True)])
def test_interleaved_1f1b_keeps_more_than_p_only_for_m_above_p(p, m, more):
    """4.6: interleaved 1F1B's first rank keeps more than 1F1B's p micro-batches for m > p;
    at m = p it keeps p."""
    peak = max(timeline.peak_held(torch_plan("interleaved", p, m), 2).values())
    assert (peak > p) == more and peak >= p


def test_the_line_the_notebook_quotes_from_torch():
    """4.6 quotes torch/distributed/pipelining/schedules.py line 3015: the interleaved zero
    bubble schedule is the paper's ZB1P."""
    source = Path(inspect.getsourcefile(pp.ScheduleInterleavedZeroBubble)).read_text()
    line = source.splitlines()[3015 - 1]
    assert "In particular this is implementing the ZB1P schedule in the paper." in line


def test_bubble_exercise_reference_passes_and_equals_the_replay():
    assert checks.check_schedule_bubble(reference.schedule_bubble) < 1e-9
    for _, actions, cost in checks._bubble_cases():
        want = timeline.ideal_replay(actions, cost).bubble
        assert reference.schedule_bubble(actions, cost) == pytest.approx(want, abs=1e-12)


def _ratio(actions, cost):  # idle / compute instead of idle / step
    b = reference.schedule_bubble(actions, cost)
    return b / (1 - b)


def _w_idle(actions, cost):  # W blocks counted as idle
    b = reference.schedule_bubble(actions, cost)
    n = len(actions)
    blocks = [x for a in actions.values() for x in a]
    ws = {(s, i) for s, k, i in blocks if k == "W"}
    busy = sum(cost[k] + cost["W"] * (k == "B" and (s, i) not in ws) for s, k, i in blocks) / n
    w = sum(cost["W"] for _, k, _ in blocks if k == "W") / n
    return 1 - (busy - w) / (busy / (1 - b))


def _no_wait(actions, cost):  # every rank runs its blocks back to back from t = 0
    return 0.0


def _own_spans(actions, cost):  # each rank from its own first block to its own last
    by_rank = {}
    for e in timeline.ideal_replay(actions, cost).events:
        by_rank.setdefault(e.rank, []).append(e)
    work = sum(e.end - e.start for v in by_rank.values() for e in v)
    spans = sum(max(e.end for e in v) - min(e.start for e in v) for v in by_rank.values())
    return 1 - work / spans


def _papers_way(actions, cost):  # Qi et al.'s count: the longest rank's own span
    q = timeline.stage_ratio(actions, cost)
    return q / (1 + q)


def _b_alone(actions, cost):  # every B lasts cost["B"], a whole backward too
    ev = [
        timeline.Event(int(r), k, i, 0.0, cost[k], stage=s)
        for r, acts in actions.items()
        for s, k, i in acts
    ]
    return timeline.replay(ev, actions).bubble


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (_ratio, "idle / compute"),
        (_w_idle, "W blocks are work"),
        (_no_wait, "must wait"),
        (_b_alone, r"B \+ W"),
        (_own_spans, "its own first block"),
        (_papers_way, "its own first block"),
    ],
    ids=[
        "idle over compute",
        "W counted as idle",
        "no waiting (no warm-up)",
        "B without W",
        "each rank its own span",
        "the paper's per-rank count",
    ],
)
def test_bubble_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_schedule_bubble(wrong)


# ------------------------------------------------------------------ the run and its checks
@pytest.mark.launcher
def test_every_schedule_gives_the_unsplit_gradients_and_its_own_blocks(two_ranks):
    runs, ckpt = two_ranks
    assert set(runs) == set(SCHEDULES)
    for r in runs.values():
        checks.check_equal(r["grad_rel_err"], what=r["schedule"])
        checks.check_schedule_blocks(r)
        checks.check_bubble(r)  # a comparison inside the run: holds on a busy machine too
        assert len(r["every_step_bubble"]) == 2
    assert any(e["kind"] == "W" for e in runs["zbv"]["events"])
    assert not any(e["kind"] == "W" for e in runs["interleaved"]["events"])
    assert {e["stage"] for e in runs["zbv"]["events"] if e["rank"] == 0} == {0, 3}  # the V
    assert isinstance(models.load(ckpt), models.CharTransformer)


@pytest.mark.launcher
def test_block_check_fails_a_timeline_out_of_order(two_ranks):
    run_ = dict(two_ranks[0]["interleaved"])
    ev = sorted(run_["events"], key=lambda e: (e["rank"], e["start"]))
    first, second = ev[1], ev[2]  # swap two blocks of rank 0
    run_["events"] = [
        dict(e, start=second["start"])
        if e is first
        else dict(e, start=first["start"])
        if e is second
        else e
        for e in ev
    ]
    with pytest.raises(CheckFailed, match="order"):
        checks.check_schedule_blocks(run_)


@pytest.mark.launcher
def test_bubble_check_fails_a_rank_idling_for_no_reason(two_ranks):
    """The ideal timeline of the plan passes; the same with rank 1 idle for 5 block lengths
    before one of its blocks (and everything after it on that rank late) fails."""
    r = two_ranks[0]["zbv"]
    ev = ideal(r["order"], b=2.0, w=1.0)
    good = {**r, "events": ev, "every_step_bubble": None}
    checks.check_bubble(good)
    cut = sorted(e["start"] for e in ev if e["rank"] == 1)[4]
    late = [
        dict(e, start=e["start"] + 5, end=e["end"] + 5)
        if e["rank"] == 1 and e["start"] >= cut
        else e
        for e in ev
    ]
    with pytest.raises(CheckFailed):
        checks.check_bubble({**good, "events": late})


# ------------------------------------------------------------------ the script's edges
def test_help_shows_the_profiles_defaults(monkeypatch):
    out = script_help(monkeypatch, SCRIPT)
    assert "'quick' profile" in out and "--virtual" in out


def test_stage_placement():
    mod = load_script(SCRIPT)
    assert mod.stage_ids("interleaved", 1, 4, 2) == [1, 5]
    assert mod.stage_ids("zbv", 1, 4, 2) == [1, 6]


def test_one_process_is_a_clean_error(monkeypatch, capsys):
    assert script_stop(monkeypatch, SCRIPT, TINY) == 2
    assert "at least 2 processes" in capsys.readouterr().err
