"""Run distributed jobs many times in a row and count the runs that did not end cleanly.

    python scripts/exit_soak.py --runs 50 ddp_bench uneven_shards    # jobs named below
    python scripts/exit_soak.py --runs 50 all                        # every job below
    python scripts/exit_soak.py --runs 50 --script my_job.py --nprocs 2 --launcher mpirun -- --steps 2

A run is abnormal when it hangs past ``--timeout``, a rank ends by a signal or with a
non-zero status, or the output holds "terminate called" (the C++ runtime's message
before it aborts). Each job runs with the smallest sizes its options allow, in the
``quick`` profile, from a fresh temporary folder (the files a job writes start anew).
Run it under ``nice -n 10`` on a shared machine. The last lines are a Markdown table:
job, launcher, runs, clean, abnormal, and the kinds of abnormal endings.

The jobs are every script that joins a process group (each arms
``lab_utils.gloo_exit.arm()``, the workaround this soak measures; tests/test_gloo_exit.py
checks that none is missing here) and the Horovod scripts, which join none.
"""

import collections
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab_utils import data, launch, profile  # noqa: E402

LAB2 = REPO / "labs" / "lab2_data_parallel" / "scripts"
LAB3 = REPO / "labs" / "lab3_large_batch" / "scripts"
LAB4 = REPO / "labs" / "lab4_model_parallel" / "scripts"
LAB5 = REPO / "labs" / "lab5_systems" / "scripts"
LAB6 = REPO / "labs" / "lab6_efficiency" / "scripts"
LAB7 = REPO / "labs" / "lab7_communication" / "scripts"
TRAIN = [
    "--n-train",
    "256",
    "--n-test",
    "128",
    "--max-steps",
    "2",
    "--batch-size",
    "16",
    "--width",
    "8",
]
TRANSFORMER = [
    "--d-model",
    "32",
    "--heads",
    "4",
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
]


@dataclass(frozen=True)
class Job:
    """One distributed script with the smallest arguments it accepts."""

    script: Path
    args: tuple[str, ...] = ()
    nprocs: int = 2
    launcher: str = "torchrun"
    launcher_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    stand_in: int = 0  # training images of a synthetic-cifar10 written for each run ($LABS_DATA)


JOBS = {
    "collectives_demo": Job(LAB2 / "collectives_demo.py"),
    "ring_check": Job(LAB2 / "ring_check.py", ("--sizes", "1024", "--repeats", "1")),
    "ddp_bench": Job(
        LAB2 / "ddp_bench.py",
        (
            "--steps",
            "2",
            "--bucket-caps",
            "25",
            "--accum",
            "1",
            "--batch-size",
            "8",
            "--width",
            "8",
        ),
    ),
    "uneven_shards": Job(LAB2 / "uneven_shards.py", ("--fix", "join", "--batches", "2")),
    "train_ddp": Job(LAB2 / "train_ddp.py", tuple(TRAIN)),
    "train_horovod": Job(LAB2 / "train_horovod.py", tuple(TRAIN), launcher="horovodrun"),
    "train_large_batch": Job(
        LAB3 / "train_large_batch.py",
        ("--epochs", "1", "--batch-per-worker", "16", "--n-train", "256", "--n-test", "128"),
    ),
    "hybrid": Job(LAB4 / "hybrid.py", (*TRANSFORMER, "--tp", "2")),
    "pipeline": Job(
        LAB4 / "pipeline.py",
        (*TRANSFORMER, "--schedules", "gpipe", "--microbatches", "2", "--repeats", "1"),
    ),
    "sharded": Job(LAB4 / "sharded.py", tuple(TRANSFORMER)),
    "tensor_parallel": Job(LAB4 / "tensor_parallel.py", tuple(TRANSFORMER)),
    "easgd": Job(
        LAB5 / "easgd.py",
        (
            "--methods",
            "sgd",
            "--taus",
            "1",
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--hidden",
            "16",
            "--n-train",
            "200",
            "--n-test",
            "50",
            "--eval-every",
            "100",
        ),
    ),
    "elastic_train": Job(
        LAB5 / "elastic_train.py",
        (
            "--steps",
            "4",
            "--n-train",
            "200",
            "--n-test",
            "50",
            "--hidden",
            "16",
            "--ckpt-every",
            "2",
        ),
        launcher_args=("--max-restarts=1",),
    ),
    "param_server": Job(
        LAB5 / "param_server.py",
        (
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--hidden",
            "16",
            "--n-train",
            "200",
            "--n-test",
            "50",
            "--snapshots",
            "2",
        ),
        nprocs=3,
    ),
    "allreduce_timing": Job(
        REPO / "benchmarks" / "jobs" / "allreduce_timing.py",
        ("--sizes", "1024", "--repeats", "1", "--budget-s", "0.1"),
    ),
    "pipeline_schedules": Job(
        LAB4 / "pipeline_schedules.py",
        (
            *TRANSFORMER,
            "--layers",
            "4",
            "--schedules",
            "1f1b",
            "--microbatches",
            "4",
            "--repeats",
            "1",
        ),
    ),
    "context_parallel": Job(
        LAB4 / "context_parallel.py",
        ("--d-model", "32", "--seq-len", "32", "--seq-lens", "32", "--repeats", "1"),
    ),
    "experts": Job(LAB4 / "experts.py", (*TRANSFORMER, "--experts", "2")),
    "reshard_checkpoint": Job(
        LAB4 / "reshard_checkpoint.py", (*TRANSFORMER, "--save", "ckpt", "--reference", "ref.pt")
    ),
    "ddp_by_hand": Job(LAB6 / "ddp_by_hand.py", (*TRANSFORMER, "--bucket-kb", "4", "--no-timing")),
    "profile_ddp": Job(
        LAB6 / "profile_ddp.py",
        (*TRANSFORMER, "--active", "1", "--out", "trace"),
        launcher="mpirun",
    ),
    "predicted_bytes": Job(LAB6 / "predicted_bytes.py", ("--strategies", "ddp", "pp")),
    "allreduce_sweep": Job(LAB7 / "allreduce_sweep.py", ("--sizes-kb", "4", "--repeats", "1")),
    "compressed_ddp": Job(LAB7 / "compressed_ddp.py", (*TRANSFORMER, "--hooks", "powersgd")),
    "local_sgd": Job(LAB7 / "local_sgd.py", (*TRANSFORMER, "--periods", "2")),
    "diloco": Job(
        LAB7 / "diloco.py",
        (*TRANSFORMER, "--steps", "2", "--periods", "2", "--fragments", "2", "--check-period", "0"),
    ),
    "compare_methods": Job(LAB7 / "compare_methods.py", (*TRANSFORMER, "--period", "1")),
    "reference_ddp": Job(
        REPO / "assessment" / "solutions" / "reference_ddp.py",
        ("--dataset", "synthetic-cifar10", "--epochs", "1"),
        stand_in=256,
    ),
    "tiny_submission": Job(REPO / "benchmarks" / "jobs" / "tiny_submission.py", stand_in=256),
    "reference_horovod": Job(
        REPO / "assessment" / "solutions" / "reference_horovod.py",
        ("--dataset", "synthetic-cifar10", "--epochs", "1"),
        launcher="mpirun",
        stand_in=256,
    ),
}

# A rank that a signal ended, as torchrun ("exitcode  : -6", "Signal 6 (SIGABRT)"),
# mpirun ("exited on signal 6") and horovodrun report it.
_SIGNAL = re.compile(
    r"exitcode\s*:\s*-\d+|signal \d+|\bSIG(?:ABRT|SEGV|BUS|KILL|TERM)\b", re.IGNORECASE
)


def verdict(result: launch.LaunchResult) -> str:
    """``clean``, or how the run ended abnormally: hung, signal, terminate called, status N."""
    if result.timed_out:
        return "hung"
    text = result.output
    if "terminate called" in text:
        return "terminate called"
    if result.returncode < 0 or _SIGNAL.search(text):
        return "signal"
    if result.returncode != 0:
        return f"status {result.returncode}"
    return "clean"


def run_once(job: Job, timeout: float) -> tuple[str, launch.LaunchResult]:
    with tempfile.TemporaryDirectory(prefix="exit_soak_") as tmp:
        env = {"LABS_PROFILE": "quick", **job.env}
        if job.stand_in:
            data.write_synthetic_cifar10(
                Path(tmp) / "data" / "synthetic-cifar10", n_train=job.stand_in, n_test=64
            )
            env["LABS_DATA"] = str(Path(tmp) / "data")
        result = launch.run(
            job.script,
            list(job.args),
            nprocs=job.nprocs,
            launcher=job.launcher,
            timeout=timeout,
            env=env,
            cwd=tmp,
            echo=False,
            launcher_args=list(job.launcher_args),
        )
    return verdict(result), result


def soak(name: str, job: Job, runs: int, timeout: float) -> collections.Counter:
    """``runs`` runs of ``job`` in a row; prints each abnormal one's tail as it happens."""
    endings: collections.Counter = collections.Counter()
    start = time.monotonic()
    for i in range(runs):
        ending, result = run_once(job, timeout)
        endings[ending] += 1
        print(f"{name} {i + 1}/{runs}: {ending} ({result.elapsed:.0f} s)", flush=True)
        if ending != "clean":
            print(result.output[-1500:], flush=True)
    print(
        f"{name}: {endings['clean']}/{runs} clean in {time.monotonic() - start:.0f} s", flush=True
    )
    return endings


def table(rows: dict[str, tuple[Job, collections.Counter]]) -> str:
    lines = [
        "| job | launcher | runs | clean | abnormal | abnormal endings |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, (job, endings) in rows.items():
        runs = sum(endings.values())
        bad = {k: v for k, v in endings.items() if k != "clean"}
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(bad.items())) or "–"
        lines.append(
            f"| {name} | {job.launcher} | {runs} | {endings['clean']} | "
            f"{runs - endings['clean']} | {kinds} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = profile.script_parser(__doc__.splitlines()[0])
    p.add_argument("jobs", nargs="*", help=f"'all' or some of: {', '.join(JOBS)}")
    p.add_argument("--runs", type=int, default=50, help="runs of each job, in a row")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a run counts as hung"
    )
    p.add_argument("--script", type=Path, help="a script of your own instead of named jobs")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--launcher", choices=launch.LAUNCHERS, default="torchrun")
    args, extra = p.parse_known_args()
    if args.script:
        jobs = {
            args.script.stem: Job(
                args.script.resolve(),
                tuple(a for a in extra if a != "--"),
                args.nprocs,
                args.launcher,
            )
        }
    else:
        unknown = [j for j in args.jobs if j != "all" and j not in JOBS]
        if unknown or not args.jobs or extra:
            p.error(f"name jobs among {', '.join(JOBS)} or 'all' (not {unknown or extra})")
        jobs = JOBS if "all" in args.jobs else {j: JOBS[j] for j in args.jobs}
    rows = {name: (job, soak(name, job, args.runs, args.timeout)) for name, job in jobs.items()}
    print(table(rows), flush=True)
    return 0 if all(e["clean"] == sum(e.values()) for _, e in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
