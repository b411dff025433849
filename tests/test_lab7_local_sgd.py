"""Lab 7's local SGD (``scripts/local_sgd.py``): PyTorch's PostLocalSGDOptimizer and
PeriodicModelAverager against DDP, in one two-rank job — inside a slow link of its own
where this machine can make one, unshaped and at RATE in turn (the bytes the same at
both, no step faster than the token bucket allows, H = 1 still DDP)."""

from __future__ import annotations

import pytest
from conftest import REPO, check_bytes_cross_the_link, runs_by_rate

import lab7_checks as checks
from lab_utils import launch, slow_link

LAB7 = REPO / "labs" / "lab7_communication"
STEPS = 8
RATE = 20  # Mbit/s: an average's 0.27 MB on the link take ~0.1 s, four bursts
# a small transformer: H = 1 still agrees with DDP to ~1e-6 and H = 4 is over 1e3 times further off
MODEL = ["--d-model", "32", "--layers", "2"]
LINK = bool(slow_link.available())
needs_link = pytest.mark.skipif(
    not LINK, reason="no slow link here (python -m lab_utils.slow_link --check)"
)


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    rates = ["--rates", "none", str(RATE)] if LINK else []
    return slow_link.run(
        LAB7 / "scripts" / "local_sgd.py",
        ["--periods", "1", "4", "--steps", str(STEPS), *MODEL, *rates],
        link=slow_link.Link(None) if LINK else None,
        nprocs=2,
        launcher="mpirun",  # no torchrun process importing torch: ~2 CPU-s less
        cwd=LAB7,
        timeout=240,
        echo=False,
    ).check()


def averaged_after(period: int, warmup: int, steps: int) -> list[bool]:
    """The steps after which torch's PeriodicModelAverager averages (its rule)."""
    return [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]


def test_ddp_all_reduces_every_step_and_local_sgd_every_h_th(job):
    full = job.event("model")["param_bytes"]
    assert job.event("run", method="ddp", rate=None)["bytes_by_step"] == [full] * STEPS
    for period in (1, 4):
        sent = job.event("run", method="local", period=period, rate=None)["bytes_by_step"]
        every_h = [full if (s + 1) % period == 0 else 0 for s in range(STEPS)]
        assert sent == every_h, period
        assert sum(sent) * period == sum([full] * STEPS)  # bytes fall by H
        # warmup_steps=0 would average after steps 1, H+1, ... instead
        wrong = [full if a else 0 for a in averaged_after(period, 0, STEPS)]
        assert period == 1 or sent != wrong


def test_local_sgd_with_h_1_is_ddp(job):
    """With plain SGD, averaging θ − lr·gᵢ is θ − lr·mean(gᵢ): the same weights to float32
    rounding (8 steps of a few roundings each); one skipped average is far off (H = 4)."""
    for rate in job.event("link")["rates"]:  # on the slow link too: the link changes no value
        same = job.event("agreement", period=1, rate=rate)
        assert same["max_abs_diff"] <= 1e-5 * same["max_abs_weight"]
        apart = job.event("agreement", period=4, rate=rate)
        assert apart["max_abs_diff"] > 1e3 * same["max_abs_diff"]


def by_rate(job: launch.LaunchResult) -> dict:
    return runs_by_rate(job, "run", lambda m: f"{m['method']} {m['period']}")


@needs_link
def test_the_bytes_are_the_same_at_every_rate_and_all_cross_the_link(job):
    runs = by_rate(job)
    assert list(runs) == [None, RATE] and all(len(r) == 3 for r in runs.values())
    checks.check_counts_same_at_every_rate(runs)
    check_bytes_cross_the_link(job, runs)  # local SGD's steps between syncs send nothing


@needs_link
def test_no_step_beats_the_slow_links_bound(job):
    info = job.event("link")
    bound = checks.check_training_steps_bound(
        by_rate(job)[RATE], rate_mbit=RATE, burst_bytes=info["burst_bytes"], mtu=info["mtu"]
    )
    assert bound > 0.03, "an average's bytes take a while at RATE: the check bites"
