"""Lab 5: the exercises' checks (and that wrong answers fail them) and the measurements the
scripts make. The parameter server's tests are in test_lab5_param_server.py; the
killed-and-resumed run against an uninterrupted one is in test_lab5_systems.py, whose
elastic jobs it shares.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

import lab5_checks as checks
import lab5_solutions as solutions
from lab_utils import launch, tensordata
from lab_utils.checks import CheckFailed
from lab_utils.source import load_script

LAB = REPO / "labs" / "lab5_systems"
SCRIPTS = LAB / "scripts"
QUICK = {"LABS_PROFILE": "quick"}


# ------------------------------------------------------------------ exercise checks
def test_easgd_check_accepts_the_reference():
    checks.check_easgd(solutions.easgd_worker, solutions.easgd_center)


@pytest.mark.parametrize(
    "worker, center, message",
    [
        (
            lambda x, g, c, lr, rho: x - lr * (g - rho * (x - c)),
            solutions.easgd_center,
            "away from",
        ),
        (lambda x, g, c, lr, rho: x - lr * g, solutions.easgd_center, "no elastic term"),
        (
            lambda x, g, c, lr, rho: x - lr * (g + rho * (x - c)) * 0.5,
            solutions.easgd_center,
            "relative error",
        ),
        (
            solutions.easgd_worker,
            lambda c, xs, lr, rho: c + lr * rho * sum(x - c for x in xs) / len(xs),
            "averaged",
        ),
        (
            solutions.easgd_worker,
            lambda c, xs, lr, rho: c - lr * rho * sum(x - c for x in xs),
            "relative error",
        ),
    ],
)
def test_easgd_check_rejects_wrong_equations(worker, center, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_easgd(worker, center)


def test_resume_check_sees_one_ulp():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    checks.check_resume_equal(a, {k: v.clone() for k, v in a.items()})
    b = {"w": torch.nextafter(torch.ones(3), torch.full((3,), 2.0)), "b": torch.zeros(2)}
    with pytest.raises(CheckFailed, match="1 of 2 tensors differ"):
        checks.check_resume_equal(b, a)
    with pytest.raises(CheckFailed, match="different tensors"):
        checks.check_resume_equal({"w": a["w"]}, a)


def test_lock_claims_can_fail():
    rec = {"model": "dense", "lock": True, "overlapped": 0, "updates": 10}
    checks.check_lock([rec], asserted=True)
    with pytest.raises(CheckFailed, match="no writes overlap"):
        checks.check_lock([dict(rec, overlapped=2)], asserted=True)
    dense = {"model": "dense", "lock": False, "overlapped": 5, "collided_when_overlapping": 1.0}
    sparse = {"model": "sparse", "lock": False, "overlapped": 5, "collided_when_overlapping": 0.02}
    checks.check_lock([dense, sparse], asserted=True)
    with pytest.raises(CheckFailed, match="fewer weights when sparse"):
        checks.check_lock([dense, dict(sparse, collided_when_overlapping=1.0)], asserted=True)


def test_graph_break_check_can_fail():
    checks.check_graph_breaks(0, 1)
    with pytest.raises(CheckFailed):
        checks.check_graph_breaks(1, 1)
    with pytest.raises(CheckFailed):
        checks.check_graph_breaks(0, 0)


# ------------------------------------------------------------------ measurements
def test_hogwild_collisions_are_counted_from_the_logged_writes():
    hogwild = load_script(SCRIPTS / "hogwild.py")
    np = pytest.importorskip("numpy")
    # Dense: worker 0's write [0, 2] overlaps worker 1's [1, 3]; [4, 5] overlaps nothing.
    logs = {0: [(0.0, 2.0, None), (4.0, 5.0, None)], 1: [(1.0, 3.0, None)]}
    n, overlapped, collided, when = hogwild.conflicts(logs, dense_size=100)
    assert (n, overlapped) == (3, 2)
    assert when == 1.0 and collided == pytest.approx(200 / 300)
    # Sparse: the overlapping writes share one of their four rows each.
    logs = {
        0: [(0.0, 2.0, np.array([1, 2, 3, 4]))],
        1: [(1.0, 3.0, np.array([4, 5, 6, 7]))],
        2: [(9.0, 9.5, np.array([4]))],
    }
    n, overlapped, collided, when = hogwild.conflicts(logs, dense_size=100)
    assert (n, overlapped) == (3, 2) and when == pytest.approx(2 / 8)
    # The same worker's writes never collide with each other.
    assert hogwild.conflicts({0: [(0.0, 2.0, None), (1.0, 3.0, None)]}, 10)[1] == 0


def test_hashed_features_are_sparse_and_stable():
    hogwild = load_script(SCRIPTS / "hogwild.py")
    data = tensordata.load(64, 8, seed=0)
    ids = hogwild.hashed_patches(data.x_train)
    assert ids.shape == (64, 16) and int(ids.min()) >= 0 and int(ids.max()) < hogwild.BUCKETS
    assert torch.equal(ids, hogwild.hashed_patches(data.x_train))
    assert (ids == 0).any() and (ids != 0).sum(
        1
    ).min() > 0  # empty patches, yet every image has features


def test_batch_indices_depend_on_seed_worker_and_step_only():
    a = tensordata.batch_indices(100, 8, seed=1, worker=0, step=3)
    assert torch.equal(a, tensordata.batch_indices(100, 8, seed=1, worker=0, step=3))
    assert not torch.equal(a, tensordata.batch_indices(100, 8, seed=1, worker=1, step=3))
    assert not torch.equal(a, tensordata.batch_indices(100, 8, seed=1, worker=0, step=4))


HELP = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), (path, exc.code)
    assert "usage:" in out.getvalue() and "--" in out.getvalue(), path
    print(path, "ok")
"""


def test_scripts_have_help():
    # One interpreter for all four (torch is imported once): each must print its usage.
    scripts = [
        str(SCRIPTS / n) for n in ("param_server.py", "hogwild.py", "easgd.py", "elastic_train.py")
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HELP, *scripts],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch.job_env("python", QUICK, 1, 60),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 4, proc.stdout


def test_every_notebook_and_script_is_in_the_lab_readme():
    readme = (LAB / "README.md").read_text()
    names = [p.name for p in sorted(LAB.glob("*.ipynb")) + sorted(SCRIPTS.glob("*.py"))]
    assert len(names) == 10, names
    missing = [n for n in names if f"`{n}`" not in readme]
    assert not missing, f"not described in labs/lab5_systems/README.md: {missing}"
