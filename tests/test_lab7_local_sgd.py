"""Lab 7's local SGD (``scripts/local_sgd.py``): PyTorch's PostLocalSGDOptimizer and
PeriodicModelAverager against DDP, in one two-rank job."""

from __future__ import annotations

import pytest
from conftest import REPO

from lab_utils import launch

LAB7 = REPO / "labs" / "lab7_communication"
STEPS = 8


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    return launch.run(
        LAB7 / "scripts" / "local_sgd.py",
        ["--periods", "1", "4", "--steps", str(STEPS)],
        nprocs=2,
        cwd=LAB7,
        timeout=240,
        echo=False,
    ).check()


def averaged_after(period: int, warmup: int, steps: int) -> list[bool]:
    """The steps after which torch's PeriodicModelAverager averages (its rule)."""
    return [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]


def test_ddp_all_reduces_every_step_and_local_sgd_every_h_th(job):
    full = job.event("model")["param_bytes"]
    assert job.event("run", method="ddp")["bytes_by_step"] == [full] * STEPS
    for period in (1, 4):
        sent = job.event("run", method="local", period=period)["bytes_by_step"]
        every_h = [full if (s + 1) % period == 0 else 0 for s in range(STEPS)]
        assert sent == every_h, period
        assert sum(sent) * period == sum([full] * STEPS)  # bytes fall by H
        # warmup_steps=0 would average after steps 1, H+1, ... instead
        wrong = [full if a else 0 for a in averaged_after(period, 0, STEPS)]
        assert period == 1 or sent != wrong


def test_local_sgd_with_h_1_is_ddp(job):
    """With plain SGD, averaging θ − lr·gᵢ is θ − lr·mean(gᵢ): the same weights to float32
    rounding (8 steps of a few roundings each); one skipped average is far off (H = 4)."""
    same = job.event("agreement", period=1)
    assert same["max_abs_diff"] <= 1e-5 * same["max_abs_weight"]
    apart = job.event("agreement", period=4)
    assert apart["max_abs_diff"] > 1e3 * same["max_abs_diff"]
