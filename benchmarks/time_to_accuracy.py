"""3. Time to 90 % and 91 % Fashion-MNIST test accuracy with the ``cpu`` profile.

Runs the command-line trainer exactly as a student would (``python -m lab_utils.cli
--profile cpu``), one process using every core, with the test set evaluated after
every epoch. The time to a threshold is the trainer's wall clock at the end of the
first epoch whose test accuracy reaches it: training plus the evaluations so far,
without interpreter start-up and data loading (listed separately). Each run uses
another seed; the figures are medians over the runs.

The course's README quotes this benchmark's per-epoch figures in the block between
``FIGURES_START`` and ``FIGURES_END``, written by :func:`figures` from the run that
``python -m benchmarks --only accuracy --readme`` records (``benchmarks/recorded/``).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from lab_utils import launch

from .common import REPO_ROOT, Report, Settings, describe, median
from .data import fashion_mnist

NAME = "accuracy"
TITLE = "Time to 90 % / 91 % Fashion-MNIST test accuracy, cpu profile"
THRESHOLDS = (0.90, 0.91)
TARGET_SECONDS_91 = 180.0
# Where --readme writes this benchmark's figures besides its table.
FIGURES_IN = REPO_ROOT / "README.md"
FIGURES_START = "<!-- trainer-figures:start -->"
FIGURES_END = "<!-- trainer-figures:end -->"
REGENERATE = "python -m benchmarks --only accuracy --readme"


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
    epochs = result.events("epoch")
    if not epochs or not result.events("final"):
        raise RuntimeError(
            "the trainer emitted no epoch or final metrics:\n" + result.output[-2000:]
        )
    final = result.event("final")
    # The trainer's own line naming what it trains (profile, threads, model, batch, lr,
    # precision), quoted as printed where the figures are shown.
    setup = next((text for _, text in result.lines if text.startswith("profile=")), "")
    return {
        "seed": seed,
        "epochs": epochs,
        "final": final,
        "wall": result.elapsed,
        "command": " ".join(result.command),
        "args": args,
        "setup": setup,
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
        f"`python -m lab_utils.cli {shlex.join(runs[0]['args'])}` with "
        f"OMP_NUM_THREADS={threads}; {len(runs)} runs (seeds 0..{len(runs) - 1})."
    )
    return report


def per_epoch(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """For each epoch all runs reached: its test accuracies' median, lowest and highest,
    and the median seconds from the start of training to its end."""
    out = []
    for k in range(min(len(r["epochs"]) for r in runs)):
        accs = [float(r["epochs"][k]["val_acc"]) for r in runs]
        out.append(
            {
                "epoch": k + 1,
                "median": median(accs),
                "low": min(accs),
                "high": max(accs),
                "seconds": median(float(r["epochs"][k]["time"]) for r in runs),
            }
        )
    return out


def figures(machine: dict[str, Any], report: Report) -> str:
    """The README's block on the command-line trainer: what ran, where, and the test
    accuracy after each epoch, all from the recorded ``report`` of this benchmark."""
    if report.name != NAME or report.error or report.skipped:
        raise ValueError(f"figures need a run of {NAME} that worked, not {report.name!r}")
    runs, details = report.details["runs"], report.details
    load = details.get("load_average") or {}
    busy = ""
    if load.get("start") and load.get("end"):
        busy = f"; load average {load['start'][0]:g} → {load['end'][0]:g} (1 min)"
    seeds = f"seeds {runs[0]['seed']}–{runs[-1]['seed']}" if len(runs) > 1 else "one seed"
    lines = [
        f"`{REGENERATE}` wrote this block, and the benchmark's part of",
        "[benchmarks/README.md](benchmarks/README.md#latest-results), from the run it",
        f"recorded in `benchmarks/recorded/{NAME}.json`:",
        "",
        f"- **Runs:** {len(runs)} ({seeds}) of `python -m lab_utils.cli "
        f"{shlex.join(runs[0]['args'])}` with OMP_NUM_THREADS={details['threads']}",
        f"- **The trainer printed:** `{runs[0]['setup']}`",
        f"- **Measured:** {details.get('date', '?')} at commit `{details.get('commit', '?')}`"
        f"{busy}, on {describe(machine)}",
        "",
        "| after epoch | test accuracy (median) | lowest – highest | seconds (median) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for e in per_epoch(runs):
        lines.append(
            f"| {e['epoch']} | {100 * e['median']:.2f} % | "
            f"{100 * e['low']:.2f} – {100 * e['high']:.2f} % | {e['seconds']:.1f} |"
        )
    reached = []
    for threshold in THRESHOLDS:
        times = [first_time_reaching(r["epochs"], threshold) for r in runs]
        got = sorted(t for t in times if t is not None)
        when = f" (after {', '.join(f'{t:.1f}' for t in got)} s)" if got else ""
        reached.append(f"{100 * threshold:g} % in {len(got)} of {len(runs)} runs{when}")
    lines += [
        "",
        f"Test accuracy reached {' and '.join(reached)}. The seconds count training and the",
        "test after each epoch since training began, not start-up and data loading.",
    ]
    return "\n".join(lines)
