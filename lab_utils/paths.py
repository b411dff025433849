"""Where things live: the user cache, the runs folder and the repository root."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """The user cache (``$LABS_CACHE`` or ``~/.cache/lab_utils``), created on demand."""
    path = Path(os.environ.get("LABS_CACHE") or Path.home() / ".cache" / "lab_utils")
    path.mkdir(parents=True, exist_ok=True)
    return path


def runs_dir(name: str = "") -> Path:
    """A folder for a lab's outputs (checkpoints, metrics, figures), created on demand.

    ``$LABS_RUNS`` overrides the default ``<repo>/runs``, which git ignores.
    """
    root = Path(os.environ.get("LABS_RUNS") or REPO_ROOT / "runs")
    path = root / name if name else root
    path.mkdir(parents=True, exist_ok=True)
    return path
