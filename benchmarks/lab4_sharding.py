"""Per-rank training state of ZeRO-1 and FSDP2 vs DDP, for N = 2 and 4 processes.

``labs/lab4_model_parallel/scripts/sharded.py`` measures the bytes of parameters,
gradients and optimizer state on every rank (Adam, fp32). Ratios are the largest
rank's bytes over DDP's. Goal: the sharded part within 1/N + 10 % (ZeRO-1 shards
the optimizer state, FSDP all three).
"""

from __future__ import annotations

from .common import Report, Settings
from .lab4_model_parallel import launched, model_args

NAME = "sharding"
TITLE = "Lab 4 per-rank memory: ZeRO-1 and FSDP2 vs DDP"
KINDS = ("params", "grads", "optimizer")


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    details = {}
    for n in [2] if settings.quick else [2, 4]:
        job = launched(
            "sharded.py",
            model_args(settings.quick),
            nprocs=n,
            timeout=120 if settings.quick else 600,
        )
        runs = {r["strategy"]: r for r in job.events("sharded")}

        def largest(name: str, kinds: tuple[str, ...] = KINDS, runs: dict = runs) -> float:
            return max(sum(r[k] for k in kinds) for r in runs[name]["per_rank"])

        goal = 1 / n + 0.10
        zero = largest("zero1", ("optimizer",)) / largest("ddp", ("optimizer",))
        fsdp = largest("fsdp") / largest("ddp")
        report.add(
            f"ZeRO-1 optimizer state / DDP's, N={n}",
            zero,
            "x",
            target=f"<= {goal:.2f}x",
            met=zero <= goal,
        )
        report.add(f"ZeRO-1 whole state / DDP's, N={n}", largest("zero1") / largest("ddp"), "x")
        report.add(
            f"FSDP2 whole state / DDP's, N={n}",
            fsdp,
            "x",
            target=f"<= {goal:.2f}x",
            met=fsdp <= goal,
        )
        report.add(
            f"FSDP2 / DDP step time, N={n}", runs["fsdp"]["step_s"] / runs["ddp"]["step_s"], "x"
        )
        details[n] = list(runs.values())
    report.details = {"runs": details}
    report.notes.append("Adam in fp32; the largest rank's measured bytes; 1 thread per process.")
    return report
