"""3. Time to 90 % and 91 % Fashion-MNIST test accuracy with the ``cpu`` profile.

Runs the command-line trainer exactly as a student would (``python -m lab_utils.cli
--profile cpu``), one process using every core, with the test set evaluated after
every epoch. The time to a threshold is the trainer's wall clock at the end of the
first epoch whose test accuracy reaches it: training plus the evaluations so far,
without interpreter start-up and data loading (listed separately). Each run uses
another seed; the figures are medians over the runs.
"""

from __future__ import annotations

import math
from typing import Any

from lab_utils import launch

from .common import Report, Settings, median
from .data import fashion_mnist

NAME = "accuracy"
TITLE = "Time to 90 % / 91 % Fashion-MNIST test accuracy, cpu profile"
THRESHOLDS = (0.90, 0.91)
TARGET_SECONDS_91 = 180.0


def first_time_reaching(epochs: list[dict[str, Any]], threshold: float) -> float | None:
    """Seconds at the end of the first epoch with ``val_acc >= threshold`` (None: never)."""
    for row in epochs:
        if float(row.get("val_acc", 0.0)) >= threshold:
            return float(row["time"])
    return None


def train_once(seed: int, quick: bool, threads: int, timeout: float) -> dict[str, Any]:
    """One run of the command-line trainer; its per-epoch records and final result."""
    args = [
        "--dataset",
        "fashion-mnist",
        "--eval-every-epoch",
        "--checkpoint",
        "",
        "--no-progress",
        "--seed",
        str(seed),
    ]
    args += (
        ["--profile", "quick", "--n-train", "1024", "--n-test", "512"]
        if quick
        else ["--profile", "cpu"]
    )
    result = launch.run(
        "lab_utils.cli",
        args,
        nprocs=1,
        launcher="python",
        module=True,
        timeout=timeout,
        echo=False,
        threads_per_proc=threads,
    ).check()
    epochs = [m for m in result.metrics if m.get("event") == "epoch"]
    final = next((m for m in result.metrics if m.get("event") == "final"), None)
    if not epochs or final is None:
        raise RuntimeError(
            "the trainer emitted no epoch or final metrics:\n" + result.output[-2000:]
        )
    return {
        "seed": seed,
        "epochs": epochs,
        "final": final,
        "wall": result.elapsed,
        "command": " ".join(result.command),
    }


def run(settings: Settings) -> Report:
    fashion_mnist()  # skips cleanly when the data is missing
    report = Report(NAME, TITLE)
    threads = settings.threads
    runs = [
        train_once(seed, settings.quick, threads, timeout=120 if settings.quick else 1200)
        for seed in range(settings.rounds(full=3))
    ]

    for threshold in THRESHOLDS:
        times = [first_time_reaching(r["epochs"], threshold) for r in runs]
        reached = [t for t in times if t is not None]
        # A run that never got there counts as infinitely slow; the median is finite
        # only when most runs got there, otherwise the figure is "not reached".
        value = None
        if len(reached) * 2 > len(runs):
            value = median([t if t is not None else math.inf for t in times])
        is_91 = threshold == 0.91
        report.add(
            f"time to {threshold:.0%} test accuracy",
            value,
            "s",
            target=f"<= {TARGET_SECONDS_91:g} s" if is_91 else "",
            met=(value is not None and value <= TARGET_SECONDS_91) if is_91 else None,
            note=f"reached in {len(reached)}/{len(runs)} runs",
        )
    finals = [r["final"]["test_acc"] for r in runs]
    per_epoch = [r["epochs"][-1]["time"] / len(r["epochs"]) for r in runs]
    overhead = [r["wall"] - r["final"]["seconds"] for r in runs]
    report.add(
        "final test accuracy",
        100 * median(finals),
        "%",
        note=f"runs {100 * min(finals):.2f}..{100 * max(finals):.2f} %, "
        f"{len(runs[0]['epochs'])} epochs",
    )
    report.add("time per epoch (train + test)", median(per_epoch), "s")
    report.add("start-up and data loading", median(overhead), "s", note="not in the times above")
    report.details = {"threads": threads, "runs": runs}
    report.notes.append(
        f"`{runs[0]['command'].split(' -m ', 1)[-1]}` with "
        f"OMP_NUM_THREADS={threads}; {len(runs)} runs (seeds 0..{len(runs) - 1})."
    )
    return report
