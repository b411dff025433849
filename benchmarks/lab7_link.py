"""Lab 7 on a slow link: DDP's step time against the link's rate, and the bytes and time
per step of the five ways to train (DDP, bf16, PowerSGD, local SGD, DiLoCo) at one slow
rate.

Both jobs run inside ``lab_utils.slow_link`` (the job's own loopback, rate-limited by the
kernel's token bucket; rank 0 changes its rate between measurements):
``labs/lab7_communication/scripts/allreduce_sweep.py --ddp`` times PyTorch's DDP step at
every rate, in rounds that visit every rate (notebook 1), and
``scripts/compare_methods.py`` trains the five methods one after the other at the slow
rate and counts every all-reduce byte (notebook 5). Skipped where the link cannot be made.
"""

from __future__ import annotations

import statistics

from lab_utils import paths, slow_link

from .common import REPO_ROOT, Report, Settings, Skip

NAME = "lab7_link"
TITLE = "Lab 7 slow link: DDP step vs rate; five methods' bytes and time per step"
SCRIPTS = REPO_ROOT / "labs" / "lab7_communication" / "scripts"
SWEEP = SCRIPTS / "allreduce_sweep.py"
COMPARE = SCRIPTS / "compare_methods.py"


def _model(quick: bool) -> list[str]:
    """Notebook 5's character transformer (its cpu profile), or the smallest one."""
    if quick:
        return ["--d-model", "32", "--layers", "2", "--seq-len", "16", "--batch-size", "8"]
    s = paths.lab_module("lab7", "settings").COMPARE
    return s.args("d_model", "layers", "heads", "seq_len", "batch_size", profile="cpu")


def _rates(quick: bool) -> tuple[list[str], str]:
    """The rates of the DDP sweep (Mbit/s, 'none': unshaped) and the slow one."""
    return (["10", "none"], "10") if quick else (["20", "50", "100", "200", "none"], "20")


def run(settings: Settings) -> Report:
    for script in (SWEEP, COMPARE):
        if not script.is_file():
            raise Skip(f"{script.relative_to(REPO_ROOT)} does not exist yet")
    support = slow_link.available()
    if not support:
        raise Skip(f"no slow link here: {support.reason}")
    quick = settings.quick
    rates, slow = _rates(quick)
    options = dict(
        nprocs=2,
        threads_per_proc=1,
        echo=False,
        timeout=300 if quick else 1800,
        env={"LABS_PROFILE": "quick"},
        cwd=SCRIPTS.parent,
    )
    report = Report(NAME, TITLE)
    sweep = slow_link.run(
        SWEEP,
        [
            *_model(quick),
            "--n-chars",
            "20000" if quick else "200000",
            "--sizes-kb",  # one all-reduce size: the DDP steps are what this times
            "64",
            "--max-seconds",
            "5",
            "--repeats",
            str(settings.rounds(9, 1)),
            "--ddp",
            "--rates",
            *rates,
        ],
        link=slow_link.Link(float(rates[0])),
        **options,
    ).check()
    for d in sweep.events("ddp"):
        label = "unshaped" if d["rate_mbit"] is None else f"{d['rate_mbit']:g} Mbit/s"
        times = d["variants"]["DDP"]
        report.add(
            f"DDP step at {label}",
            statistics.median(times) * 1e3,
            "ms",
            note=f"{len(times)} interleaved rounds, range {min(times) * 1e3:.1f}–"
            f"{max(times) * 1e3:.1f} ms",
        )
    steps = 8 if quick else 32
    compare = slow_link.run(
        COMPARE,
        [
            *_model(quick),
            "--n-chars",
            "20000" if quick else "200000",
            "--steps",
            str(steps),
            "--period",
            "4" if quick else "8",
            "--rates",
            slow,
        ],
        link=slow_link.Link(float(slow)),
        **options,
    ).check()
    grad_bytes = compare.event("model")["grad_bytes"]
    for r in compare.events("run"):
        per_step = sum(r["bytes_by_step"]) / len(r["bytes_by_step"])
        report.add(
            f"{r['method']} at {slow} Mbit/s: all-reduce bytes per step",
            per_step,
            "B",
            note=f"{per_step / grad_bytes:.3f} of DDP's (counted)",
        )
        # the mean, not the median: local SGD's and DiLoCo's steps that average are few
        report.add(
            f"{r['method']} at {slow} Mbit/s: time per step",
            sum(r["seconds"]) / len(r["seconds"]) * 1e3,
            "ms",
            note=f"mean of {len(r['seconds'])} steps (median "
            f"{statistics.median(r['seconds']) * 1e3:.1f} ms)",
        )
    report.details = {"ddp": sweep.events("ddp"), "compare": compare.events("run")}
    report.notes.append(
        "2 processes, 1 thread each, Gloo, on the job's own loopback shaped by tc's tbf "
        "(burst 64 KiB, MTU 16000); times are wall-clock on shared cores: the sweep's "
        "medians, the comparison's means per step (the median beside each)."
    )
    return report
