"""8. Lab 5's Hogwild!: lock-free vs locked updates per second, dense and sparse model.

Runs ``labs/lab5_systems/scripts/hogwild.py`` (2 processes sharing one model through
``torch.multiprocessing``), with and without an ``mp.Lock`` around each update,
alternately. Updates per second = all updates / (first write start to last write end);
the ratio lock-free / locked is the median of the per-round ratios.
"""

from __future__ import annotations

from lab_utils import launch

from .common import REPO_ROOT, Report, Settings, alternate, median, paired_ratios

NAME = "lab5_hogwild"
TITLE = "Hogwild!: lock-free / locked updates per second"
SCRIPT = REPO_ROOT / "labs" / "lab5_systems" / "scripts" / "hogwild.py"


def record(model: str, lock: bool, steps: int, timeout: float) -> dict:
    args = [
        "--model",
        model,
        "--steps",
        str(steps),
        "--workers",
        "2",
        "--n-train",
        "10000",
        "--n-test",
        "500",
        *(["--lock"] if lock else []),
    ]
    result = launch.run(
        SCRIPT, args, nprocs=1, launcher="python", echo=False, timeout=timeout
    ).check()
    return result.event("hogwild")


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    steps = 50 if settings.quick else 2000
    rounds = settings.rounds(full=3)
    for model in ("dense",) if settings.quick else ("dense", "sparse"):
        seen: dict[bool, list[dict]] = {True: [], False: []}

        def one(lock: bool, model: str = model, seen: dict = seen) -> float:
            r = record(model, lock, steps, timeout=120 if settings.quick else 600)
            seen[lock].append(r)
            return 1.0 / r["updates_per_s"]

        times = alternate({"lock": lambda: one(True), "free": lambda: one(False)}, rounds, warmup=0)
        ratio = median(paired_ratios(times["lock"], times["free"]))  # = free rate / lock rate
        free, locked = (median(r["updates_per_s"] for r in seen[k]) for k in (False, True))
        collided = median(r["collided_when_overlapping"] for r in seen[False])
        report.add(
            f"{model} model: lock-free / locked updates per second",
            ratio,
            "x",
            note=f"lock-free {free:,.0f}/s, locked {locked:,.0f}/s; overlapping lock-free "
            f"writes collided on {collided:.1%} of their weights",
        )
        report.details[model] = {"lock": seen[True], "free": seen[False]}
    report.notes.append("> 1: dropping the lock gave more updates per second.")
    return report
