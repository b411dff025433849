"""Accuracy-in-time targets, one TOML file per hardware profile.

A target says what a submission must reach (``accuracy`` on the held-out test split
of ``dataset``) within how long (``budget_s`` of wall clock, launch to exit) on how
many processes. Files live in ``assessment/targets/``; ``lab-grade --target NAME``
finds ``NAME.toml`` there, and any other path works too. See
``assessment/targets/cpu-2proc.toml`` for a commented example.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
LAUNCHERS = ("torchrun", "horovodrun", "mpirun")
DATASETS = ("fashion-mnist", "cifar10", "synthetic-cifar10")
STATUSES = ("calibrated", "to be calibrated", "test")
DATA_PARALLEL = ("require", "warn")  # what a job whose ranks did not all take part gets


class TargetError(ValueError):
    """A target file is missing or malformed; the message names the file and the key."""


@dataclass(frozen=True)
class Target:
    """One accuracy-in-time target (see the module docstring for the file format)."""

    name: str
    dataset: str
    accuracy: float
    budget_s: float
    processes: int
    archs: tuple[str, ...]
    grace_s: float = 15.0
    threads_per_proc: int | None = 1
    launcher: str = "torchrun"
    profile: str = "cpu"
    test_samples: int | None = None  # None: the whole test split
    max_checkpoint_mb: float = 512.0
    memory_mb: float = 8192.0  # memory limit of the whole job (all its processes)
    # "require": a job whose ranks did not all exchange gradients is `not_data_parallel`;
    # "warn": it keeps its verdict, with a warning (see assessment/participation.py).
    data_parallel: str = "require"
    status: str = "to be calibrated"
    description: str = ""
    path: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def deadline_s(self) -> float:
        """When the grader stops the job: the budget plus the grace."""
        return self.budget_s + self.grace_s


def available() -> list[str]:
    """Names of the targets shipped in ``assessment/targets``."""
    return sorted(p.stem for p in TARGETS_DIR.glob("*.toml"))


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The file of a target given by name (``cpu-2proc``) or path."""
    text = str(name_or_path)
    path = Path(text)
    if path.suffix == ".toml" or os.sep in text:
        if not path.is_file():
            raise TargetError(f"target file {path} does not exist")
        return path
    shipped = TARGETS_DIR / f"{text}.toml"
    if not shipped.is_file():
        raise TargetError(
            f"no target named {text!r}; shipped targets: {', '.join(available())} "
            "(or give the path of a .toml file)"
        )
    return shipped


def load(name_or_path: str | os.PathLike) -> Target:
    """Read and check one target file."""
    path = resolve(name_or_path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"{path}: not valid TOML: {e}") from e
    return from_dict(raw, path=path)


def from_dict(raw: dict[str, Any], path: str | os.PathLike = "<dict>") -> Target:
    """Build a :class:`Target` from parsed TOML, with one clear error per bad key."""
    values = _read_keys(dict(raw), path)
    for ok, problem in _checks(values):
        if not ok:
            raise TargetError(f"{path}: {problem}")
    return Target(**values, path=str(path))


def _read_keys(raw: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """Each key of the file, type-checked, with its default where it may be left out."""

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in raw:
            raise TargetError(f"{path}: missing key {key!r}")
        value = raw.pop(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TargetError(f"{path}: {key} = {value!r} has the wrong type")
        return value

    def opt(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        return need(key, kind) if key in raw else default

    number = (int, float)
    values = {
        "name": opt("name", str, Path(path).stem),
        "dataset": need("dataset", str),
        "accuracy": float(need("accuracy", number)),
        "budget_s": float(need("budget_s", number)),
        "processes": need("processes", int),
        "archs": tuple(need("archs", list)),
        "grace_s": float(opt("grace_s", number, 15.0)),
        # 0: leave the thread count alone
        "threads_per_proc": opt("threads_per_proc", int, 1) or None,
        "launcher": opt("launcher", str, "torchrun"),
        "profile": opt("profile", str, "cpu"),
        "test_samples": opt("test_samples", int, None),
        "max_checkpoint_mb": float(opt("max_checkpoint_mb", number, 512.0)),
        "memory_mb": float(opt("memory_mb", number, 8192.0)),
        "data_parallel": opt("data_parallel", str, "require"),
        "status": opt("status", str, "to be calibrated"),
        "description": opt("description", str, ""),
        "calibration": opt("calibration", dict, {}),
    }
    if raw:
        raise TargetError(f"{path}: unknown key(s) {', '.join(sorted(raw))}")
    return values


def _checks(v: dict[str, Any]) -> list[tuple[bool, str]]:
    """(holds, problem in words) for every rule a target's values must keep."""
    dataset, threads, archs = v["dataset"], v["threads_per_proc"], v["archs"]
    return [
        (dataset in DATASETS, f"dataset must be one of {', '.join(DATASETS)}, not {dataset!r}"),
        (0.0 < v["accuracy"] <= 1.0, f"accuracy is a fraction in (0, 1], not {v['accuracy']}"),
        (v["budget_s"] > 0, f"budget_s must be positive, not {v['budget_s']}"),
        (v["grace_s"] >= 0, f"grace_s must be >= 0, not {v['grace_s']}"),
        (v["processes"] >= 1, f"processes must be >= 1, not {v['processes']}"),
        (threads is None or threads >= 1, f"threads_per_proc must be >= 0, not {threads}"),
        (
            bool(archs) and all(isinstance(a, str) for a in archs),
            "archs must be a non-empty list of registry names",
        ),
        (v["launcher"] in LAUNCHERS, f"launcher must be one of {', '.join(LAUNCHERS)}"),
        (
            v["profile"] in ("quick", "cpu", "gpu"),
            f"profile must be quick, cpu or gpu, not {v['profile']!r}",
        ),
        (v["test_samples"] is None or v["test_samples"] >= 1, "test_samples must be >= 1"),
        (v["max_checkpoint_mb"] > 0, "max_checkpoint_mb must be positive"),
        (v["memory_mb"] >= 256, "memory_mb must be at least 256"),
        (v["status"] in STATUSES, f"status must be one of {', '.join(STATUSES)}"),
        (
            v["data_parallel"] in DATA_PARALLEL,
            f"data_parallel must be one of {', '.join(DATA_PARALLEL)}, not {v['data_parallel']!r}",
        ),
    ]


def default_target() -> str:
    """The shipped target for this machine: ``gpu-N`` with N GPUs, else ``cpu-2proc``."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return "cpu-2proc"
    name = f"gpu-{n}"
    if name not in available():
        raise TargetError(
            f"this machine has {n} GPUs and there is no shipped target {name}; pass "
            f"--target (shipped: {', '.join(available())}) or make one with "
            "`lab-grade calibrate`"
        )
    return name
