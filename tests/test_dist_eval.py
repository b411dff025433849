"""Distributed evaluation equals single-process evaluation, exactly."""

import sys

import pytest
from conftest import JOBS

from lab_utils import launch
from lab_utils.loader import TensorLoader
from lab_utils.train import evaluate


@pytest.mark.launcher
def test_three_process_evaluation_matches_one_process():
    sys.path.insert(0, str(JOBS))
    try:
        from dist_eval import fixed_problem
    finally:
        sys.path.remove(str(JOBS))
    model, x, y = fixed_problem()
    single = evaluate(model, TensorLoader(x, y, 100, shuffle=False, mean=(0.5,), std=(0.25,)))
    result = launch.run(
        JOBS / "dist_eval.py", nprocs=3, launcher="torchrun", timeout=120, echo=False
    ).check()
    (got,) = result.metrics
    assert got["n"] == single["n"] == 1001
    assert got["acc"] == single["acc"]  # exact: counts are summed, nothing padded
    assert got["loss"] == pytest.approx(single["loss"], rel=1e-6)
