"""Interleaved and zero-bubble pipeline schedules against 1F1B, and ring attention against
one process.

``pipeline_schedules.py`` times 1F1B, interleaved 1F1B (v = 2), interleaved zero bubble
and ZB-V on 2 processes, their steps interleaved round after round; each row is 1F1B's
median step time / the schedule's (above 1: the schedule is faster), with the measured
and replayed bubbles and the bubble of torch's plan with equal F, B, W blocks.
``context_parallel.py`` times a forward and backward of causal attention on one process
and as ring attention on 2 processes, contiguous and zig-zag layouts (A B C C B A ...).
"""

from __future__ import annotations

import statistics

from lab_utils import parallel

from .common import Report, Settings
from .lab4_model_parallel import launched, model_args

NAME = "schedules"
TITLE = "Lab 4 interleaved / zero-bubble schedules vs 1F1B, ring attention vs one process"
SCHEDULES = ["1f1b", "interleaved", "interleaved_zb", "zbv"]


def ring_attention(settings: Settings, report: Report) -> tuple[list[str], dict]:
    """``context_parallel.py``'s one process / ring attention row: (its args, its record)."""
    seq = ["64"] if settings.quick else ["1024"]
    cp_args = [
        *parallel.MODEL.args("d_model", profile="quick" if settings.quick else "cpu"),
        "--seq-len",
        seq[0],
        "--seq-lens",
        *seq,
        "--repeats",
        str(settings.rounds(full=5, quick=1)),
    ]
    job = launched("context_parallel.py", cp_args, nprocs=2, timeout=180 if settings.quick else 900)
    t = job.event("ring_time")
    one, ring = statistics.median(t["one_samples"]), statistics.median(t["ring_samples"])
    report.add(
        f"ring attention on 2 processes, T={t['seq_len']}: one process / ring (forward + backward)",
        one / ring,
        "x",
    )
    report.add(
        f"ring attention on 2 processes, T={t['seq_len']}: contiguous / zig-zag ring",
        ring / statistics.median(t["zigzag_samples"]),
        "x",
    )
    return cp_args, t


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    m = "4" if settings.quick else "8"
    batch = [] if settings.quick else ["--batch-size", "64"]
    args = [
        *model_args(settings.quick),
        *batch,
        "--schedules",
        *SCHEDULES,
        "--microbatches",
        m,
        "--repeats",
        str(settings.rounds(full=5, quick=1)),
        "--steps",
        "1",
    ]
    job = launched("pipeline_schedules.py", args, nprocs=2, timeout=180 if settings.quick else 900)
    runs = {r["schedule"]: r for r in job.events("schedule")}
    base = statistics.median(runs["1f1b"]["samples"])
    for name in SCHEDULES[1:]:
        r = runs[name]
        report.add(
            f"{name} (v={r['virtual']}) m={m}: 1F1B / schedule step time",
            base / statistics.median(r["samples"]),
            "x",
            note=f"bubble {r['bubble']:.2f} measured, {r['replay_bubble']:.2f} replayed, "
            f"{r['plan_ratio'] / (1 + r['plan_ratio']):.2f} plan (equal F, B, W); "
            f"1F1B {runs['1f1b']['bubble']:.2f}",
        )
    cp_args, t = ring_attention(settings, report)
    report.details = {
        "schedule_args": args,
        "context_args": cp_args,
        "runs": [
            {k: v for k, v in r.items() if k not in ("events", "order")} for r in runs.values()
        ],
        "ring_time": t,
    }
    report.notes.append(
        f"`{' '.join(args)}` and `{' '.join(cp_args)}`; 2 processes, 1 thread each; "
        "medians of the interleaved timed steps."
    )
    return report
