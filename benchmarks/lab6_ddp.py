"""Lab 6's data parallelism by hand: overlapped vs naive hand-made DDP, and hand-made
DDP vs DistributedDataParallel, on 2 processes.

``labs/lab6_efficiency/scripts/ddp_by_hand.py`` checks HandDDP's gradients and weights
against DDP's, then times three variants with the same bucket size, interleaved (each
round times every variant once, the order reversed every other round): all-reduce after
backward (naive), during backward (overlapped) and DDP. Ratios are the medians of the
per-round ratios; all of them use DDP's own buckets (the run checks HandDDP's buckets
against DDP's at every cap). It also fits α and β of the all-reduce (t = α + β·bytes each
rank sends) with its largest residual, and names the bucket size each α–β replay predicts
as best (communication beside backward on free cores, or on the same cores) beside the one
measured best.
"""

from __future__ import annotations

import statistics

from lab_utils import launch, parallel, paths

from .common import REPO_ROOT, Report, Settings, Skip

NAME = "lab6_ddp"
TITLE = "Lab 6 data parallelism by hand: overlap and DDP"
SCRIPT = REPO_ROOT / "labs" / "lab6_efficiency" / "scripts" / "ddp_by_hand.py"


def _args(quick: bool) -> list[str]:
    if quick:
        return [
            "--d-model",
            "32",
            "--layers",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "1",
            "--n-chars",
            "20000",
            "--bucket-kb",
            "8",
            "64",
            "--repeats",
            "2",
        ]
    # the cpu profile's model (parallel.MODEL) and notebook 5's steps, with a benchmark's
    # own corpus, buckets and rounds
    return [
        *parallel.MODEL.args("d_model", "layers", "seq_len", "batch_size", profile="cpu"),
        *paths.lab_module("lab6", "settings").DDP_BY_HAND.args("steps", profile="cpu"),
        "--n-chars",
        "500000",
        "--bucket-kb",
        "32",
        "8",
        "128",
        "512",
        "2048",
        "--repeats",
        "15",
    ]


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b (same round, interleaved)."""
    return statistics.median(x / y for x, y in zip(a, b))


def run(settings: Settings) -> Report:
    if not SCRIPT.is_file():
        raise Skip(f"{SCRIPT.relative_to(REPO_ROOT)} does not exist yet")
    report = Report(NAME, TITLE)
    result = launch.run(
        SCRIPT,
        _args(settings.quick),
        nprocs=2,
        threads_per_proc=1,
        echo=False,
        timeout=120 if settings.quick else 900,
        env={"LABS_PROFILE": "quick"},
    ).check()
    eq = result.event("equivalence")
    bucketings = result.event("buckets")["caps"]
    same = sum(c["hand"] == c["ddp"] for c in bucketings)
    timing = result.event("timing")
    v = timing["variants"]
    report.add(
        "hand-made DDP vs DDP: largest relative gradient difference",
        eq["grad_rel_err"],
        "",
        target="<= 1e-6",
        met=eq["grad_rel_err"] <= 1e-6,
    )
    report.add(
        "caps at which HandDDP's buckets = DDP's",
        same,
        f"of {len(bucketings)}",
        target=f"= {len(bucketings)}",
        met=same == len(bucketings),
    )
    report.add(
        f"overlapped / naive hand-made DDP step, {timing['bucket_kb']:g} KiB buckets",
        _paired(v["overlapped"], v["naive"]),
        "x",
    )
    report.add(
        "hand-made (overlapped) / DistributedDataParallel step",
        _paired(v["overlapped"], v["DDP"]),
        "x",
    )
    report.add("all-reduce α (fitted)", timing["alpha_s"] * 1e6, "us")
    report.add(
        "all-reduce bandwidth 1/β (fitted)", 1 / max(timing["beta_s_per_byte"], 1e-30) / 1e9, "GB/s"
    )
    fit = timing["allreduce_fit_s"]
    worst = max(abs(m / f - 1) for m, f in zip(timing["allreduce_s"], fit))
    report.add("all-reduce α–β fit: largest relative residual", worst * 100, "%")
    caps = timing["caps"]
    measured = min(caps, key=lambda c: statistics.median(c["step_s"]))["bucket_kb"]
    for name, key in (
        ("overlapped", "predicted_exposed_s"),
        ("shared cores", "predicted_serial_s"),
    ):
        predicted = min(caps, key=lambda c: c[key])["bucket_kb"]
        report.add(
            f"best bucket: α–β replay ({name}) / measured",
            predicted / measured,
            "x",
            note=f"predicted {predicted:g} KiB, measured {measured:g} KiB",
        )
    report.details = {"equivalence": eq, "timing": timing}
    report.notes.append(
        f"{timing['repeats']} interleaved rounds; 2 processes, 1 thread each, Gloo."
    )
    return report
