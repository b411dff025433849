"""Shared fixtures: every test gets its own cache and runs folder."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import psutil
import pytest
import torch

# pytest-xdist runs two workers on two cores: one thread each, or they fight.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "tests" / "jobs"


@pytest.fixture(autouse=True)
def _isolated_runs(tmp_path_factory, monkeypatch):
    """Runs (checkpoints, metrics) go to a temporary folder, never into the repo."""
    monkeypatch.setenv("LABS_RUNS", str(tmp_path_factory.mktemp("runs")))


def processes_matching(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose command line mentions ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """A lab script (not a package module) imported from its file; its folder goes on
    ``sys.path`` so that it can import its neighbours (hybrid.py imports tensor_parallel.py)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sandbox_or_skip() -> None:
    """Skip a grader test that needs bubblewrap and the real Fashion-MNIST, saying why."""
    from assessment import jail
    from lab_utils import data

    try:
        jail.check()
    except jail.JailError as e:
        pytest.skip(f"no sandbox here: {e}")
    try:
        data.load("fashion-mnist", download=False)
    except data.DataError as e:
        pytest.skip(f"Fashion-MNIST is not installed here: {str(e).splitlines()[0]}")


@pytest.fixture(scope="session")
def slurm():
    """One one-node Slurm cluster for the session (lab_utils.slurm_cluster); skipped,
    saying why, only where Slurm is not installed or the tests do not run as root."""
    from lab_utils import slurm_cluster

    problem = slurm_cluster.why_not()
    if problem:
        pytest.skip(problem)
    with slurm_cluster.local_cluster() as cluster:
        yield cluster
