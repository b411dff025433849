"""Pipeline throughput: GPipe and 1F1B on 2 stages vs one process, m = 1, 2, 3, 4, 6, 8.

``labs/lab4_model_parallel/scripts/pipeline.py`` times one process running the whole
char transformer on the batch (forward + backward), then each schedule; the ratio is
one process's step time / the pipeline's (above 1: the pipeline is faster). The
measured bubble is shown next to (p−1)/(m+p−1).
"""

from __future__ import annotations

from .common import Report, Settings
from .lab4_model_parallel import launched, model_args

NAME = "pipeline"
TITLE = "Lab 4 pipeline (GPipe, 1F1B) on 2 stages vs one process"


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    # m must divide the batch: 48 sequences take every m in 1..8 but 5 and 7
    ms = ["1", "2"] if settings.quick else ["1", "2", "3", "4", "6", "8"]
    batch = [] if settings.quick else ["--batch-size", "48"]
    args = [
        *model_args(settings.quick),
        *batch,
        "--microbatches",
        *ms,
        "--repeats",
        str(settings.rounds(full=3)),
        "--steps",
        "1",
    ]
    job = launched("pipeline.py", args, nprocs=2, timeout=120 if settings.quick else 600)
    serial = job.event("serial")["step_s"]
    runs = job.events("pipeline")
    for r in runs:
        report.add(
            f"{r['schedule']} m={r['microbatches']}: one process / pipeline step time",
            serial / r["step_s"],
            "x",
            note=f"bubble {r['bubble']:.2f} measured, {r['ideal_bubble']:.2f} ideal",
        )
    report.details = {
        "args": args,
        "serial_step_s": serial,
        "runs": [{k: v for k, v in r.items() if k != "events"} for r in runs],
    }
    report.notes.append(f"`{' '.join(args)}`; 2 processes, 1 thread each; best of the timed steps.")
    return report
