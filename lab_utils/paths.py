"""Where things live: the user cache and the runs folder."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


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


def course_root(cwd: Path | None = None) -> Path | None:
    """The course checkout: the nearest folder above the working directory holding
    ``labs/`` and ``pyproject.toml``, else the one this package sits in (an editable
    install), else None."""
    cwd = (cwd or Path.cwd()).resolve()
    here = Path(__file__).resolve().parents[1]
    for folder in (cwd, *cwd.parents, here):
        if (folder / "labs").is_dir() and (folder / "pyproject.toml").is_file():
            return folder
    return None


def lab_folder(lab: str) -> Path:
    """The folder of ``lab`` (``"lab4"`` -> ``labs/lab4_model_parallel``)."""
    root = course_root()
    found = sorted(root.glob(f"labs/{lab}_*")) if root else []
    if len(found) != 1:
        where = root / "labs" if root else "no course checkout above the working directory"
        raise FileNotFoundError(f"no single folder for {lab!r} in {where}")
    return found[0]


def lab_module(lab: str, kind: str) -> ModuleType:
    """A lab's own module (``lab_module("lab4", "solutions")`` is
    ``labs/lab4_*/lab4_solutions.py``), importable by its plain name: a notebook finds it
    in its working directory; anything else gets the lab's folder put on ``sys.path``.
    The names carry the lab's number, so several labs' modules never collide."""
    name = f"{lab}_{kind}"
    if importlib.util.find_spec(name) is None:
        sys.path.append(str(lab_folder(lab)))
    return importlib.import_module(name)


def labs_with(kind: str) -> list[str]:
    """The labs that have a module of ``kind`` (``"solutions"`` -> ``["lab1", ...]``)."""
    root = course_root()
    files = root.glob(f"labs/lab*_*/lab*_{kind}.py") if root else []
    return sorted(path.name.removesuffix(f"_{kind}.py") for path in files)
