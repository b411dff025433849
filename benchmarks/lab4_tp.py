"""Tensor-parallel step time of the char transformer on 2 processes vs one process.

``labs/lab4_model_parallel/scripts/tensor_parallel.py`` trains the model split with
``parallelize_module`` and the unsplit model in one process on the same batches; the
ratio is the tensor-parallel step time over one process's (below 1: faster).
"""

from __future__ import annotations

from .common import Report, Settings
from .lab4_model_parallel import launched, model_args

NAME = "tp"
TITLE = "Lab 4 tensor parallelism: step time on 2 processes vs one"


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    job = launched(
        "tensor_parallel.py",
        model_args(settings.quick),
        nprocs=2,
        timeout=120 if settings.quick else 600,
    )
    train = job.event("tp_train")
    report.add("tensor-parallel step, 2 processes", train["step_s"] * 1e3, "ms")
    report.add("one process step", train["one_process_step_s"] * 1e3, "ms")
    report.add(
        "tensor-parallel / one-process step time",
        train["step_s"] / train["one_process_step_s"],
        "x",
        note=f"weights equal to one process within {train['weights_rel_err']:.1e}",
    )
    report.details = {"train": train}
    return report
