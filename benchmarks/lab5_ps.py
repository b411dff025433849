"""7. Lab 5's parameter server: asynchronous vs synchronous throughput, 2 and 4 workers.

Runs ``labs/lab5_systems/scripts/param_server.py`` (one server, N workers, MLP on
Fashion-MNIST) under ``torchrun``, sync and async alternately, one thread per process.
Throughput is gradients applied per second as the server measured it (first worker
start to last worker end); the ratio async / sync is the median of the per-round ratios.
With more processes than cores (5 on 2 cores) the processes share cores.
"""

from __future__ import annotations

from lab_utils import launch

from .common import REPO_ROOT, Report, Settings, alternate, median, paired_ratios

NAME = "lab5_ps"
TITLE = "Parameter server (RPC): async / sync throughput"
SCRIPT = REPO_ROOT / "labs" / "lab5_systems" / "scripts" / "param_server.py"


def summary(mode: str, workers: int, steps: int, timeout: float) -> dict:
    """One job's ``ps_summary`` record."""
    args = ["--mode", mode, "--steps", str(steps), "--n-train", "5000", "--n-test", "500"]
    result = launch.run(
        SCRIPT, args, nprocs=1 + workers, threads_per_proc=1, echo=False, timeout=timeout
    ).check()
    return result.event("ps_summary")


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    steps = 20 if settings.quick else 200
    rounds = settings.rounds(full=3)
    for workers in (2,) if settings.quick else (2, 4):
        seen: dict[str, list[dict]] = {"sync": [], "async": []}

        def one(mode: str, workers: int = workers, seen: dict = seen) -> float:
            s = summary(mode, workers, steps, timeout=120 if settings.quick else 600)
            seen[mode].append(s)
            return 1.0 / s["grads_per_s"]  # seconds per gradient: alternate() wants times

        times = alternate({m: (lambda m=m: one(m)) for m in ("sync", "async")}, rounds, warmup=0)
        ratio = median(paired_ratios(times["sync"], times["async"]))  # = async rate / sync rate
        rates = {m: median(s["grads_per_s"] for s in seen[m]) for m in seen}
        stale = median(s["mean_staleness"] for s in seen["async"])
        report.add(
            f"{workers} workers: async / sync gradients per second",
            ratio,
            "x",
            note=f"async {rates['async']:.0f}/s (mean staleness {stale:.2f}), "
            f"sync {rates['sync']:.0f}/s, {steps} steps per worker",
        )
        report.details[f"{workers}_workers"] = seen
    report.notes.append("> 1: the asynchronous server applied more gradients per second.")
    return report
