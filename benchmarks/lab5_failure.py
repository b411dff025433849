"""9. Lab 5's fault tolerance: time lost to one killed rank vs the checkpoint interval.

Runs ``labs/lab5_systems/scripts/elastic_train.py`` with 2 ranks under ``torchrun``:
for each checkpoint interval, an uninterrupted run and a run with rank 1 SIGKILLed at the
same step under ``--max-restarts 1``, back to back. Time lost = the killed job's wall time
minus the uninterrupted job's of the same pair (pairing keeps a drift in the machine's
load out of the difference); steps redone = kill step mod interval, or the kill step when
no checkpoint came before it. Every final state is compared with the first uninterrupted
run's, bit for bit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from lab_utils import launch

from .common import REPO_ROOT, Report, Settings

NAME = "lab5_failure"
TITLE = "Time lost to one killed rank vs checkpoint interval"
SCRIPT = REPO_ROOT / "labs" / "lab5_systems" / "scripts" / "elastic_train.py"


def train(
    folder: Path, steps: int, interval: int, kill_at: int, timeout: float
) -> tuple[float, dict]:
    args = [
        "--steps",
        str(steps),
        "--ckpt-every",
        str(interval),
        "--ckpt-dir",
        str(folder),
        "--out",
        str(folder / "final.pt"),
        "--n-train",
        "5000",
        "--n-test",
        "500",
        "--kill-at",
        str(kill_at),
    ]
    result = launch.run(
        SCRIPT,
        args,
        nprocs=2,
        threads_per_proc=1,
        echo=False,
        timeout=timeout,
        launcher_args=["--max-restarts=1"],
    ).check()
    return result.elapsed, torch.load(folder / "final.pt", weights_only=True)["state_dict"]


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    steps, kill_at = (30, 25) if settings.quick else (600, 590)
    intervals = [10] if settings.quick else [10, 50, 200, 600]
    timeout = 180 if settings.quick else 600
    equal, reference = True, None
    with tempfile.TemporaryDirectory() as tmp:
        for interval in intervals:
            clean_s, clean = train(Path(tmp) / f"c{interval}", steps, interval, -1, timeout)
            killed_s, killed = train(Path(tmp) / f"k{interval}", steps, interval, kill_at, timeout)
            reference = reference or clean
            same = all(torch.equal(w[k], reference[k]) for w in (clean, killed) for k in reference)
            equal = equal and same
            redone = kill_at % interval if interval <= kill_at else kill_at
            report.add(
                f"checkpoint every {interval} steps: time lost",
                killed_s - clean_s,
                "s",
                note=f"{redone} steps redone; uninterrupted run {clean_s:.1f} s; "
                f"resumed weights {'equal' if same else 'DIFFER'}",
            )
            report.details[str(interval)] = {
                "clean_s": clean_s,
                "killed_s": killed_s,
                "redone": redone,
                "equal": same,
            }
    report.add(
        "resumed runs equal the uninterrupted run (bitwise)",
        float(equal),
        "",
        target="1",
        met=equal,
    )
    report.notes.append(
        f"{steps} steps on 2 ranks; rank 1 killed at step {kill_at}. The time "
        "lost is the restart (new processes, imports, rendezvous, data) plus the "
        "steps redone."
    )
    return report
