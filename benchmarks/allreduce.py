"""5. The hand-built ring all-reduce vs Gloo's all-reduce, 1 KB to 64 MB, 2 and 4 processes.

``lab_utils.collectives.ring_all_reduce`` (Python: ``2 (N-1)`` isend/recv steps over
Gloo) against ``torch.distributed.all_reduce`` (Gloo's own C++ algorithms), in one
job per process count (``benchmarks/jobs/allreduce_timing.py`` under ``torchrun``),
alternating call by call. Times are of the slowest rank; the ratio ring / Gloo is the
median of the per-call ratios. With more processes than cores (4 on 2 cores) the
ranks share cores, so those figures show the algorithms under contention.
"""

from __future__ import annotations

from pathlib import Path

from lab_utils import launch

from .common import Report, Settings, median, paired_ratios

NAME = "allreduce"
TITLE = "Ring all-reduce (ours) vs Gloo all-reduce"
JOB = Path(__file__).resolve().parent / "jobs" / "allreduce_timing.py"
FULL_SIZES = [4**k * 1024 for k in range(9)]  # 1 KB, 4 KB, ..., 64 MB
QUICK_SIZES = [1024, 65536]


def size_label(nbytes: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def time_sizes(nprocs: int, sizes: list[int], repeats: int, timeout: float) -> list[dict]:
    """One job with ``nprocs`` ranks timing every size; its per-size records."""
    args = ["--sizes", *map(str, sizes), "--repeats", str(repeats)]
    result = launch.run(
        JOB,
        args,
        nprocs=nprocs,
        launcher="torchrun",
        threads_per_proc=1,
        echo=False,
        timeout=timeout,
    ).check()
    records = result.events("allreduce")
    if len(records) != len(sizes):
        raise RuntimeError(
            f"expected {len(sizes)} timings, got {len(records)}:\n{result.output[-2000:]}"
        )
    return records


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    sizes = QUICK_SIZES if settings.quick else FULL_SIZES
    procs = (2,) if settings.quick else (2, 4)
    repeats = settings.rounds(full=7, quick=2)
    worst_err = 0.0
    for n in procs:
        records = time_sizes(n, sizes, repeats, timeout=120 if settings.quick else 600)
        for rec in records:
            ring, gloo = median(rec["ring_s"]), median(rec["gloo_s"])
            ratio = median(paired_ratios(rec["ring_s"], rec["gloo_s"]))
            worst_err = max(worst_err, float(rec["max_rel_err"]))
            busbw = 2 * (n - 1) / n * rec["nbytes"] / gloo / 1e6  # what each link carries
            report.add(
                f"{n} procs, {size_label(rec['nbytes'])}: ring / Gloo",
                ratio,
                "x",
                note=f"ring {ring * 1e3:.3g} ms, Gloo {gloo * 1e3:.3g} ms "
                f"({busbw:,.0f} MB/s bus), {len(rec['ring_s'])} calls",
            )
        report.details[f"{n}_procs"] = records
    report.add(
        "largest relative difference ring vs Gloo",
        worst_err,
        "",
        target="< 1e-5",
        met=worst_err < 1e-5,
    )
    report.notes.append(
        "ring / Gloo > 1 means ours is slower. Bus bandwidth = 2 (N-1)/N × size / Gloo's time."
    )
    return report
