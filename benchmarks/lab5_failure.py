"""9. Lab 5's fault tolerance: time lost to one killed rank vs the checkpoint interval.

Runs ``labs/lab5_systems/scripts/elastic_train.py`` with 2 ranks under ``torchrun``:
once uninterrupted, then once per checkpoint interval with rank 1 SIGKILLed at the same
step and ``--max-restarts 1``. Time lost = the killed job's wall time minus the
uninterrupted job's; steps redone = kill step mod interval. Each killed run's final
weights are compared with the uninterrupted run's.
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


def train(folder: Path, steps: int, interval: int, kill_at: int, timeout: float
          ) -> tuple[float, dict]:
    args = ["--steps", str(steps), "--ckpt-every", str(interval), "--ckpt-dir", str(folder),
            "--out", str(folder / "final.pt"), "--n-train", "5000", "--n-test", "500",
            "--kill-at", str(kill_at)]
    result = launch.run(SCRIPT, args, nprocs=2, threads_per_proc=1, echo=False, timeout=timeout,
                        launcher_args=["--max-restarts=1"]).check()
    return result.elapsed, torch.load(folder / "final.pt", weights_only=True)["state_dict"]


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    steps, kill_at = (30, 25) if settings.quick else (600, 590)
    intervals = [10] if settings.quick else [10, 50, 200, 590]
    timeout = 180 if settings.quick else 600
    with tempfile.TemporaryDirectory() as tmp:
        clean_s, clean = train(Path(tmp) / "clean", steps, 0, -1, timeout)
        equal = True
        for interval in intervals:
            killed_s, weights = train(Path(tmp) / f"k{interval}", steps, interval, kill_at, timeout)
            same = all(torch.equal(weights[k], clean[k]) for k in clean)
            equal = equal and same
            redone = kill_at % interval
            report.add(f"checkpoint every {interval} steps: time lost", killed_s - clean_s, "s",
                       note=f"{redone} steps redone; resumed weights "
                            f"{'equal' if same else 'DIFFER'}")
            report.details[str(interval)] = {"killed_s": killed_s, "redone": redone, "equal": same}
        report.details["clean_s"] = clean_s
    report.add("resumed runs equal the uninterrupted run (bitwise)", float(equal), "",
               target="1", met=equal)
    report.notes.append(f"uninterrupted run: {clean_s:.1f} s for {steps} steps; rank 1 killed "
                        f"at step {kill_at}.")
    return report
