"""Where things live: the user cache and the runs folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache (``$LABS_CACHE`` or ``~/.cache/lab_utils``), created on demand."""
    path = Path(os.environ.get("LABS_CACHE") or Path.home() / ".cache" / "lab_utils")
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_runs_root(cwd: Path | None = None) -> Path:
    """``runs/`` of the course checkout the working directory is in (the nearest folder
    above it holding ``labs/`` and ``pyproject.toml``), else ``runs/`` in the working
    directory itself. Derived from where the notebook runs, not from where the package
    is installed: with a shared install (JupyterHub) that is nobody's folder."""
    cwd = (cwd or Path.cwd()).resolve()
    for folder in (cwd, *cwd.parents):
        if (folder / "labs").is_dir() and (folder / "pyproject.toml").is_file():
            return folder / "runs"
    return cwd / "runs"


def runs_dir(name: str = "") -> Path:
    """A folder for a lab's outputs (checkpoints, metrics, figures), created on demand:
    ``$LABS_RUNS/<name>`` if set, else :func:`default_runs_root` ``/<name>`` (git
    ignores every ``runs/``)."""
    root = Path(os.environ.get("LABS_RUNS") or default_runs_root())
    path = root / name if name else root
    path.mkdir(parents=True, exist_ok=True)
    return path
