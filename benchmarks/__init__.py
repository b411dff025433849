"""Measured performance of the labs, the library and the distributed paths.

    python -m benchmarks                  # everything (tens of minutes on 2 cores)
    python -m benchmarks --quick          # every code path, about 2 min on 2 cores
    python -m benchmarks --only loader --json out.json

Each benchmark is one module with ``NAME``, ``TITLE`` and ``run(settings) -> Report``;
:data:`BENCHMARKS` lists them in the order they run and print.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name on the command line -> module in this package
BENCHMARKS: dict[str, str] = {
    "trainer": "trainer_overhead",
    "loader": "loader_throughput",
    "accuracy": "time_to_accuracy",
    "ddp": "ddp_scaling",
    "allreduce": "allreduce",
    "notebooks": "notebooks",
    "grading": "grading",
    "lab5_ps": "lab5_ps",
    "lab5_hogwild": "lab5_hogwild",
    "lab5_failure": "lab5_failure",
    "pipeline": "lab4_pipeline",
    "sharding": "lab4_sharding",
    "tp": "lab4_tp",
    "schedules": "lab4_schedules",
    "lab6_cost": "lab6_cost",
    "lab6_ddp": "lab6_ddp",
    "lab7_link": "lab7_link",
}


def module(name: str) -> ModuleType:
    """The module of the benchmark called ``name`` (imported on demand)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{BENCHMARKS[name]}")
