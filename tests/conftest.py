"""Shared fixtures: every test gets its own cache and runs folder."""

from __future__ import annotations

import os
from pathlib import Path

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
