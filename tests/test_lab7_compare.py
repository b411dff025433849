"""Lab 7's comparison (``scripts/compare_methods.py``, notebook 5): DDP, bf16, PowerSGD,
local SGD and DiLoCo in one two-rank job, inside a slow link at one rate and unshaped
(on the host's loopback where no link can be made), every byte counted."""

from __future__ import annotations

import math

import pytest
from conftest import REPO

import lab7_checks as checks
from lab_utils import launch, slow_link
from lab_utils.checks import CheckFailed

LAB7 = REPO / "labs" / "lab7_communication"
STEPS, PERIOD, RATE = 4, 2, 10
SMALL = ["--d-model", "32", "--layers", "2", "--seq-len", "16", "--batch-size", "8"]
SMALL += ["--n-chars", "20000", "--steps", str(STEPS), "--period", str(PERIOD)]
SMALL += ["--eval-batches", "1"]  # PowerSGD compresses from step 2 (its default)


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    options = dict(nprocs=2, cwd=LAB7, timeout=300, echo=False)
    if slow_link.available():
        return slow_link.run(
            LAB7 / "scripts" / "compare_methods.py",
            [*SMALL, "--rates", str(RATE), "none"],
            link=slow_link.Link(RATE),
            **options,
        ).check()
    return launch.run(LAB7 / "scripts" / "compare_methods.py", SMALL, **options).check()


def by_rate(job: launch.LaunchResult) -> dict:
    runs: dict = {r: {} for r in job.event("model")["rates"]}
    for run in job.events("run"):
        runs[run["rate_mbit"]][run["method"]] = run
    return runs


def test_every_method_all_reduces_its_predicted_bytes_at_every_rate(job):
    model, runs = job.event("model"), by_rate(job)
    full = model["grad_bytes"]
    assert full == 4 * model["numel"]
    for at_rate in runs.values():
        assert list(at_rate) == ["ddp", "bf16", "powersgd", "local", "diloco"]
        checks.check_compare_bytes(model, at_rate)
        # the predictions themselves, written out: DDP 4Ψ, bf16 2Ψ, every H-th step 4Ψ
        assert at_rate["ddp"]["bytes_by_step"] == [full] * STEPS
        assert at_rate["bf16"]["bytes_by_step"] == [full // 2] * STEPS
        for method in ("local", "diloco"):
            assert at_rate[method]["bytes_by_step"] == [0, full] * (STEPS // PERIOD)
        sketch = at_rate["powersgd"]["bytes_by_step"]
        assert sketch[:2] == [full] * 2 and all(0 < b < full // 2 for b in sketch[2:])
    checks.check_counts_same_at_every_rate(runs)
    if job.event("model")["shaped"]:
        for method, run in runs[RATE].items():
            assert all(
                nb >= 2 * b
                for nb, b in zip(run["link_bytes_by_step"], run["bytes_by_step"], strict=True)
                if b  # both ranks receive what one sends; a step without one: ± an ACK
            ), method
        checks.check_training_steps_bound(
            runs[RATE], rate_mbit=RATE, burst_bytes=model["burst_bytes"], mtu=model["mtu"]
        )


def test_a_count_off_its_prediction_fails(job):
    model, at_rate = job.event("model"), by_rate(job)[job.event("model")["rates"][0]]
    every_step = {**at_rate["local"], "bytes_by_step": [model["grad_bytes"]] * STEPS}
    with pytest.raises(CheckFailed, match="step 0: counted"):
        checks.check_compare_bytes(model, {"local": every_step})
    fp32 = {**at_rate["bf16"], "bytes_by_step": at_rate["ddp"]["bytes_by_step"]}
    with pytest.raises(CheckFailed, match="bf16"):
        checks.check_compare_bytes(model, {"bf16": fp32})


def test_the_table_of_each_rate(job):
    model, runs = job.event("model"), by_rate(job)
    for rate, at_rate in runs.items():
        table = checks.compare_table(at_rate, PERIOD)
        rows = table["rows"]
        assert set(rows) == set(at_rate) and sorted(table["order"]) == sorted(rows)
        assert table["winner"] in (table["order"][0], "tie")
        for method, row in rows.items():
            run = at_rate[method]
            smooth = checks.running_mean(run["losses"], PERIOD)
            steps = row["to_target_steps"]
            assert row["bytes_per_step"] == sum(run["bytes_by_step"]) / STEPS
            # the smoothed loss first reached the target at index `steps`: charged the
            # steps before it, not its own
            assert smooth[steps] <= table["target"] and min(smooth) <= table["target"]
            assert all(x > table["target"] for x in smooth[:steps])
            assert row["to_target_s"] == pytest.approx(sum(run["seconds"][:steps]))
            assert row["to_target_s"] <= row["total_s"] == pytest.approx(sum(run["seconds"]))
            assert math.isfinite(row["held_out_loss"])
        assert [rows[m]["to_target_s"] for m in table["order"]] == sorted(
            r["to_target_s"] for r in rows.values()
        )
        if rate is not None:
            beat = checks.beat_ddp_by_the_link(
                table, at_rate, rate_mbit=rate, burst_bytes=model["burst_bytes"], mtu=model["mtu"]
            )
            assert set(beat) == {"powersgd", "local", "diloco"}
            # DDP's bound: each step put ≥ 2 × 4Ψ on the link (both ranks receive 4Ψ),
            # less a burst and 4 packets of slack, at 10 Mbit/s, for the steps before
            slack = 4 * (model["mtu"] + 14)
            least = (2 * model["grad_bytes"] - model["burst_bytes"] - slack) / (RATE * 1e6 / 8)
            for m, (t_m, bound) in beat.items():
                assert t_m == rows[m]["to_target_s"]
                assert bound >= rows["ddp"]["to_target_steps"] * max(0.0, least) - 1e-9


def test_time_to_reach_charges_the_steps_before_the_loss():
    # losses[i] is measured before step i's update: reaching it took seconds[:i]
    assert checks.time_to_reach([3.0, 2.0, 1.0], [0.5, 0.25, 1.0], 2.0) == 0.5
    assert checks.time_to_reach([3.0, 2.0, 1.0], [0.5, 0.25, 1.0], 3.0) == 0.0
    assert checks.time_to_reach([3.0, 2.0], [0.5, 0.25], 1.0) is None


def test_the_target_is_on_a_running_mean_and_close_times_tie():
    assert checks.running_mean([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    # one easy batch (step 2) that both see: on single losses both reach their lowest, 1.0,
    # there, at the same step; on 2-step means a gets there a step before b
    run = {"optimizer": "x", "bytes_by_step": [0] * 4, "held_out_loss": 0.0}
    a = {**run, "losses": [4.0, 3.0, 1.0, 2.5], "seconds": [1.0] * 4}  # means 4, 3.5, 2, 1.75
    b = {**run, "losses": [4.0, 3.5, 1.0, 3.0], "seconds": [0.25] * 4}  # 4, 3.75, 2.25, 2
    single = checks.compare_table({"a": a, "b": b}, 1)
    assert single["rows"]["a"]["to_target_steps"] == single["rows"]["b"]["to_target_steps"] == 2
    table = checks.compare_table({"a": a, "b": b}, 2)
    assert table["target"] == 2.0  # the higher of the lowest means (b's)
    assert table["rows"]["a"]["to_target_steps"] == 2 and table["rows"]["a"]["to_target_s"] == 2.0
    assert table["rows"]["b"]["to_target_steps"] == 3 and table["rows"]["b"]["to_target_s"] == 0.75
    # 1.25 s apart, more than the longest step either took before the target (1.0 s)
    assert table["order"] == ["b", "a"] and table["winner"] == "b"
    c = {**b, "seconds": [0.5] * 4}  # 1.5 s against 2.0 s: within one step's time, a tie
    assert checks.compare_table({"a": a, "c": c}, 2)["winner"] == "tie"
