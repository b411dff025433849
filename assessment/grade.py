"""The autograder: run a submission, then judge the checkpoint it leaves.

    lab-grade my_train.py                                # the target for this machine
    lab-grade my_train.py --target cpu-2proc --launcher mpirun --json report.json
    python -m assessment.grade my_train.py --launcher horovodrun --nprocs 2
    lab-grade batch submissions/ --target cpu-2proc      # a class: see assessment/batch.py
    lab-grade calibrate ...                              # see assessment/calibrate.py

It trusts nothing the submission prints. Before starting the job it loads the
held-out test split and hashes its own code, the target and the test data; it then
runs the submission in a fresh working directory inside the sandbox of
:mod:`assessment.jail` (the training split only, read-only everything but the working
directory, no network, its own PID namespace, memory and process limits), measures
the wall clock and each rank's CPU time itself, stops the whole process tree at
budget + grace, checks the hashes again, and then, in a fresh ``python -I`` that
imports only the verified code (:mod:`assessment.evaluate`), reads ``checkpoint.pt``
with ``torch.load(weights_only=True)``, rebuilds the model from the
``lab_utils.models`` registry and evaluates it on the test split with
``lab_utils.train.evaluate``. A run that met the target but whose ranks did not all
exchange gradients (counted by the kernel: :mod:`assessment.participation`) is
``not_data_parallel``, or passes with a warning where the target says
``data_parallel = "warn"``. Where no sandbox can be made it refuses, unless given
``--unsafe-no-sandbox``.

Exit codes: 0 pass; 1 fail (it ran, but missed the accuracy or the time, or had to
be stopped at budget + grace, or was not data-parallel); 2 broken submission (syntax error, crash, no usable
checkpoint); 3 grader error (bad target or usage, missing data, a fault of the grader).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import traceback
from pathlib import Path

import torch

from lab_utils import data as ldata
from lab_utils import profile as lprofile

from . import evaluate as eval_mod
from . import integrity, jail, sandbox
from . import participation as part
from . import targets as targets_mod
from .evaluate import TestSplit, check_fits, measure_accuracy  # noqa: F401 - public here too
from .report import EXIT_ERROR, Report
from .targets import Target

TEST_SUBSET_SEED = 0
IDLE_CORES = 0.15  # a stopped job using less CPU than this was waiting, not computing
IDLE_RANK = 0.25  # a rank using less CPU than this share of the busiest one did not train
UNSAFE_HEADLINE = (
    "UNSAFE: graded without a sandbox (--unsafe-no-sandbox): the submission "
    "could read the test split and change files; do not trust this verdict"
)
REPO = Path(__file__).resolve().parent.parent


def load_test_split(target: Target) -> tuple[TestSplit, Path]:
    """The test split of the target's dataset (a fixed subset if the target says so),
    and the folder it was read from."""
    ds = ldata.load(target.dataset)
    source = Path(ds.source)
    if target.test_samples is not None and target.test_samples < len(ds.x_test):
        ds = ds.subset(n_train=0, n_test=target.test_samples, seed=TEST_SUBSET_SEED)
    # Private copies: nothing the submission does to shared caches can reach them.
    return TestSplit(ds.x_test.clone(), ds.y_test.clone(), tuple(ds.mean), tuple(ds.std)), source


def default_target() -> str:
    """The shipped target for this machine: ``gpu-N`` with N GPUs, else ``cpu-2proc``."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return "cpu-2proc"
    name = f"gpu-{n}"
    if name not in targets_mod.available():
        raise targets_mod.TargetError(
            f"this machine has {n} GPUs and there is no shipped target {name}; pass "
            f"--target (shipped: {', '.join(targets_mod.available())}) or make one with "
            "`lab-grade calibrate`"
        )
    return name


def _environment(target: Target) -> dict:
    env = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": str(lprofile.device()),
        "target_status": target.status,
    }
    if hasattr(os, "getloadavg"):
        env["load_before"] = round(os.getloadavg()[0], 2)
    return env


def grade(
    submission: str | os.PathLike,
    target: Target,
    *,
    launcher: str | None = None,
    nprocs: int | None = None,
    entry: str = "train.py",
    echo: bool = False,
    keep: bool = False,
    unsafe: bool = False,
    data_dir: Path | None = None,
) -> Report:
    """Run and judge ``submission`` against ``target``; never raises for its faults.

    The job runs in the sandbox of :mod:`assessment.jail`; where none can be made the
    grade is a grader error, unless ``unsafe`` (then the report says so first).
    ``data_dir`` is a training-only copy of the data made by the caller
    (:func:`assessment.jail.training_copy`), shared by a batch; by default one is made.
    """
    launcher = launcher or target.launcher
    nprocs = nprocs or target.processes
    report = Report(
        submission=str(submission),
        target=target.name,
        dataset=target.dataset,
        launcher=launcher,
        nprocs=nprocs,
        budget_s=target.budget_s,
        grace_s=target.grace_s,
        required_accuracy=target.accuracy,
    )
    ws = None
    try:
        report.environment = _environment(target)
        if unsafe:
            report.unsafe = True
            report.warnings.append(UNSAFE_HEADLINE)
        else:
            jail.check()
        report.environment["sandbox"] = "none (unsafe)" if unsafe else "bubblewrap"
        if target.status != "calibrated":
            report.warnings.append(
                f"target {target.name} is {target.status!r}: its numbers are "
                "reasoned, not measured here (see `lab-grade calibrate`)"
            )
        if nprocs != target.processes:
            report.warnings.append(
                f"graded with {nprocs} processes; the target is set for {target.processes}"
            )
        split, source = load_test_split(target)
        ws = sandbox.prepare(submission, entry)
        report.workdir, report.job_id = str(ws.workdir), ws.job_id
        grader_dir = ws.root / "grader"  # never shown to the job
        grader_dir.mkdir()
        split_file = grader_dir / "test-split.pt"
        split.save(split_file)
        if not unsafe and data_dir is None:
            data_dir = jail.training_copy(target.dataset, ws.root / "data")
        conf = sandbox.Confinement(
            data_dir=None if unsafe else data_dir,
            memory_mb=target.memory_mb,
            repo=REPO,
            gpu=target.profile == "gpu",
            sandboxed=not unsafe,
            hide=[source],
        )
        guarded = _guarded_files(target, source, split_file)
        before = integrity.snapshot(guarded, [REPO / p for p in integrity.CODE_PACKAGES])
    except jail.JailError as e:
        return report.set(
            "grader_error",
            f"no sandbox can be made, so the submission was not "
            f"run: {e}. To grade anyway, knowing that the "
            "submission can then read the test split and change "
            "your files, pass --unsafe-no-sandbox.",
        )
    except (ldata.DataError, sandbox.SubmissionError, OSError, ValueError) as e:
        if ws is not None:
            ws.cleanup()
        return report.set("grader_error", f"{type(e).__name__}: {e}")
    try:
        _judge(report, ws, target, launcher, nprocs, echo, conf, split_file, guarded, before)
    except Exception as e:  # a bug or an environment problem of the grader, not the student
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        report.set("grader_error", f"{type(e).__name__}: {e}")
        report.output_tail = report.output_tail or tb
    finally:
        if keep:
            report.warnings.append(f"working directory kept at {ws.workdir}")
            shutil.rmtree(ws.root / "data", ignore_errors=True)
        else:
            ws.cleanup()
        if hasattr(os, "getloadavg"):
            report.environment["load_after"] = round(os.getloadavg()[0], 2)
    return report


def _guarded_files(target: Target, source: Path, split_file: Path) -> list[Path]:
    """What the verdict depends on: the grader's code, the target, the test data."""
    files = integrity.code_files(REPO)
    if target.path and Path(target.path).is_file():
        files.append(Path(target.path).resolve())
    files += sorted(p for p in source.iterdir() if p.is_file())
    files.append(split_file)
    return files


def _judge(
    report: Report,
    ws: sandbox.Workspace,
    target: Target,
    launcher: str,
    nprocs: int,
    echo: bool,
    conf: sandbox.Confinement,
    split_file: Path,
    guarded: list[Path],
    before: dict[str, str],
) -> None:
    """Fill in ``report``: run the job, check nothing it must not touch changed, then
    read and evaluate its checkpoint in a fresh process."""
    if ws.ignored:
        report.warnings.append(
            f"weight files in the submission were not copied: {', '.join(ws.ignored)}"
        )
    problem = sandbox.syntax_error(ws.workdir)
    if problem:
        report.set(
            "syntax_error", f"the submission does not compile, so it was not started: {problem}"
        )
        return
    if sandbox.reads_test_split(ws.workdir):
        report.warnings.append(
            "the source mentions the test split; it may be used to report "
            "accuracy but never to train (checked by hand)"
        )
    env = {
        "LABS_PROFILE": target.profile,
        # Collectives must not give up before the grader's own deadline: a deadlock
        # is reported as one, not as a crash.
        "LABS_DIST_TIMEOUT": str(int(target.deadline_s + 60)),
        "LABS_RUNS": str(ws.workdir / "runs"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if launcher == "mpirun" and target.profile != "gpu":
        # With as many ranks as cores, a rank that busy-polls in MPI (Horovod's
        # background thread) takes the core from its own compute thread.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # Ranks on one machine would exchange through shared memory, which no counter
        # of the kernel attributes to a rank; over TCP (on lo) every byte is counted.
        env["OMPI_MCA_btl"] = "self,tcp"
    args = ["--dataset", target.dataset, "--budget", f"{target.budget_s:g}"]
    job = sandbox.run_job(
        ws,
        args,
        launcher=launcher,
        nprocs=nprocs,
        deadline=target.deadline_s,
        env=env,
        threads_per_proc=target.threads_per_proc,
        echo=echo,
        confinement=conf,
        gpu=target.profile == "gpu",
    )
    report.elapsed_s = round(job.elapsed, 2)
    report.timed_out = job.timed_out
    report.returncode = job.returncode
    report.output_tail = job.tail()
    report.leftover_processes = job.leftovers
    report.environment["cpu_s"] = round(job.cpu_s, 1)
    report.environment["output_lines"] = job.line_count
    report.environment["limits"] = job.limits
    if job.peak_memory_mb is not None:
        report.environment["peak_memory_mb"] = job.peak_memory_mb
    report.ranks = rank_table(job, nprocs)
    _add_evidence(report.ranks, job, nprocs, job.gpu if target.profile == "gpu" else None)
    if job.sockets.lo_bytes is not None:
        report.environment["namespace_lo_mb"] = round(job.sockets.lo_bytes / 2**20, 2)
    idle_ranks = underused_cores(
        job.cpu_s, job.elapsed, nprocs, target.threads_per_proc, target.profile
    )
    if idle_ranks:
        report.warnings.append(idle_ranks)
    report.warnings += idle_rank_warnings(report.ranks, target.profile)
    if job.leftovers:
        report.warnings.append(
            f"{job.leftovers} process(es) of the job outlived it and were killed by the grader"
        )

    altered = integrity.changed(
        before, integrity.snapshot(guarded, [REPO / p for p in integrity.CODE_PACKAGES])
    )
    if altered:
        report.set(
            "tampered",
            f"files the grader judges with changed during the job, so "
            f"nothing was evaluated: {', '.join(altered[:5])}"
            + (f" and {len(altered) - 5} more" if len(altered) > 5 else "")
            + ". Restore them (git checkout, reinstall the data) before "
            "grading anything else.",
        )
        return
    if job.timed_out:
        report.set(
            "timeout",
            f"still running at budget + grace = {target.deadline_s:g} s, so "
            f"every process was stopped; {_why_stopped(job)}",
        )
        return
    if job.returncode != 0:
        err = job.first_error()
        msg = f"the job exited with status {job.returncode}"
        if job.memory_killed:
            msg += (
                f"; a process was killed for going over the memory limit of {target.memory_mb:g} MB"
            )
        msg += f"; first error: {err}" if err else "; no rank printed an error (see the output)"
        if (ws.workdir / "checkpoint.pt").exists():
            msg += (
                ". A checkpoint was written, so the failure came after it, e.g. at shutdown"
                " (call dist.barrier() before destroy_process_group())"
            )
        report.set("crashed", msg)
        return

    result = eval_mod.run(
        ws.workdir,
        split_file,
        list(target.archs),
        target.max_checkpoint_mb,
        REPO,
        env={**os.environ, "LABS_PROFILE": target.profile},
    )
    if result["reason"] is not None:
        report.set(result["reason"], result["message"])
        return
    report.warnings += result["notes"]
    report.checkpoint = result["checkpoint"]
    report.accuracy, report.test_samples = result["accuracy"], result["test_samples"]

    not_parallel = participation(report, job, target, nprocs)
    acc, need = report.accuracy, target.accuracy
    if job.elapsed > target.budget_s:
        report.set(
            "over_budget",
            f"finished in {job.elapsed:.1f} s, over the budget of "
            f"{target.budget_s:g} s (accuracy {acc:.2%}, needed "
            f"{need:.2%})",
        )
    elif acc < need:
        report.set(
            "low_accuracy",
            f"test accuracy {acc:.2%} is below the target {need:.2%} "
            f"(finished in {job.elapsed:.1f} s of {target.budget_s:g} s)",
        )
    elif not_parallel and target.data_parallel == "require":
        report.set(
            "not_data_parallel",
            f"test accuracy {acc:.2%} >= {need:.2%} in "
            f"{job.elapsed:.1f} s, but the work was not "
            f"data-parallel: {not_parallel}",
        )
    else:
        report.set(
            "passed",
            f"test accuracy {acc:.2%} >= {need:.2%} in {job.elapsed:.1f} s "
            f"<= {target.budget_s:g} s",
        )
    if not_parallel and report.reason != "not_data_parallel":
        report.warnings.append(f"not data-parallel: {not_parallel}")


def rank_table(job: sandbox.JobOutcome, nprocs: int) -> list[dict]:
    """Each rank's CPU time (sampled from outside) and share of the samples it logged
    (records with ``rank`` and ``samples`` in the job's metrics, when there are any)."""
    logged: dict[int, float] = {}
    for rec in job.metrics:
        if isinstance(rec.get("rank"), int) and isinstance(rec.get("samples"), (int, float)):
            logged[rec["rank"]] = logged.get(rec["rank"], 0) + rec["samples"]
    total = sum(logged.values())
    rows = []
    for rank in range(nprocs):
        row = {"rank": rank, "cpu_s": round(job.rank_cpu_s.get(rank, 0.0), 1)}
        if total > 0:
            row["samples_share"] = round(logged.get(rank, 0) / total, 3)
        rows.append(row)
    return rows


def participation(report: Report, job: sandbox.JobOutcome, target: Target, nprocs: int) -> str:
    """Judge from the kernel's counts whether every rank took part (see
    :mod:`assessment.participation`).

    Returns "" when every rank did (or the evidence is unavailable: a warning says
    so, never a verdict), else the finding: the verdict ``not_data_parallel`` where
    the target requires it and the run met it, a warning otherwise.
    """
    if nprocs < 2 or not report.checkpoint:
        return ""
    gpu = job.gpu if target.profile == "gpu" else None
    findings, unavailable = part.judge(
        nprocs, int(report.checkpoint.get("parameters", 0)), job.sockets, gpu
    )
    if unavailable:
        report.warnings.append(
            f"whether every rank took part could not be checked: {unavailable}; read the code"
        )
        return ""
    return "; ".join(findings)


def _add_evidence(
    ranks: list[dict], job: sandbox.JobOutcome, nprocs: int, gpu: part.GpuWatch | None
) -> None:
    """Each rank's bytes with the other ranks (CPU) or share of the GPU use (GPU)."""
    if gpu is not None and not gpu.unavailable:
        most = max(gpu.use.values(), default=0.0) or 1.0
        for row in ranks:
            row["gpu_share"] = round(gpu.use.get(row["rank"], 0.0) / most, 3)
    elif gpu is None and not job.sockets.unavailable:
        sent, received = job.sockets.per_rank(nprocs)
        for row in ranks:
            row["sent_mb"] = round(sent.get(row["rank"], 0) / 2**20, 3)
            row["received_mb"] = round(received.get(row["rank"], 0) / 2**20, 3)


def idle_rank_warnings(ranks: list[dict], profile: str) -> list[str]:
    """A warning for each rank that used far less CPU (or logged far fewer samples)
    than the busiest one: it did not train its share, whatever the others did."""
    if len(ranks) < 2:
        return []
    most = max(r["cpu_s"] for r in ranks)
    out = []
    for r in ranks:
        few_cpu = profile != "gpu" and most > 0 and r["cpu_s"] < IDLE_RANK * most
        few_samples = "samples_share" in r and r["samples_share"] < IDLE_RANK / len(ranks)
        if few_cpu or few_samples:
            what = (
                f"{r['cpu_s']:.1f} s of CPU against {most:.1f} s of the busiest rank"
                if few_cpu
                else f"{r['samples_share']:.0%} of the logged samples"
            )
            out.append(
                f"rank {r['rank']} did not train its share ({what}): the work is not "
                "data-parallel; check the code by hand"
            )
    return out


def underused_cores(
    cpu_s: float, elapsed_s: float, nprocs: int, threads_per_proc: int | None, profile: str
) -> str:
    """A warning when a CPU job kept far fewer cores busy than it had processes.

    On the CPU targets every process has one core; a data-parallel job keeps them
    all busy (the references about 1.8 of 2). A job that used about one core did
    its work in one process: a serial script made fast can meet a CPU target that
    way, and only reading its code tells. Empty when there is nothing to say.
    """
    if profile == "gpu" or nprocs < 2 or elapsed_s <= 0:
        return ""
    cores = nprocs * (threads_per_proc or 1)
    busy = cpu_s / elapsed_s
    if busy >= 0.6 * cores:
        return ""
    return (
        f"the job kept {busy:.1f} of its {cores} cores busy on average: were all "
        f"{nprocs} processes training? A fast serial script can meet a CPU target on "
        "one core; check by hand that the work is data-parallel"
    )


def _why_stopped(job: sandbox.JobOutcome) -> str:
    """What a job stopped at the deadline was doing: waiting forever, or computing.

    CPU use decides: a job that still kept a core busy was working. Silence alone
    does not make it stuck (a script may print once per epoch, and a loaded
    machine stretches every gap), so it only adds a hint.
    """
    busy, quiet = job.busy_cores, job.silent_for or 0.0
    if busy is not None and busy < IDLE_CORES:
        return (
            f"its processes were idle ({busy:.2f} CPU cores busy) and printed nothing in "
            f"the last {quiet:.0f} s: a hang, or a deadlock between ranks (a collective "
            "that not every rank reaches)?"
        )
    load = "" if busy is None else f" ({busy:.1f} CPU cores busy)"
    hint = (
        ""
        if quiet < 30
        else (
            f"; it printed nothing in the last {quiet:.0f} s, so if it "
            "should have, look for an endless loop or ranks spinning "
            "in a collective"
        )
    )
    return f"its processes were still computing{load}: it is too slow for this budget{hint}"


# --------------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    """Usage errors exit with the grader-error code, not 2 (which means "broken")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lab-grade",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 pass, 1 fail, 2 broken submission, 3 grader error. "
        "`lab-grade batch --help` grades a folder of submissions; "
        "`lab-grade calibrate --help` proposes targets for this machine.",
    )
    p.add_argument("submission", help="the training script (.py), or a folder with --entry")
    p.add_argument(
        "--target",
        "--profile",
        dest="target",
        default=None,
        help="target name in assessment/targets or a .toml path "
        f"(shipped: {', '.join(targets_mod.available())}; default: by hardware)",
    )
    p.add_argument(
        "--launcher",
        choices=targets_mod.LAUNCHERS,
        default=None,
        help="how to start the processes (default: the target's)",
    )
    p.add_argument(
        "--nprocs", "-n", type=int, default=None, help="number of processes (default: the target's)"
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.add_argument("--entry", default="train.py", help="entry script of a folder submission")
    p.add_argument("--quiet", "-q", action="store_true", help="do not stream the job's output")
    p.add_argument("--keep", action="store_true", help="keep the working directory (debugging)")
    p.add_argument(
        "--unsafe-no-sandbox",
        dest="unsafe",
        action="store_true",
        help="run the submission without the sandbox where none can be made "
        "(it can then read the test split and change files; the report "
        "says so first)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        from . import calibrate

        return calibrate.main(argv[1:])
    if argv[:1] == ["batch"]:
        from . import batch

        return batch.main(argv[1:])
    args = parser().parse_args(argv)
    if args.nprocs is not None and args.nprocs < 1:
        print("lab-grade: --nprocs must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    try:
        target = targets_mod.load(args.target or default_target())
    except targets_mod.TargetError as e:
        print(f"lab-grade: {e}", file=sys.stderr)
        return EXIT_ERROR
    report = grade(
        args.submission,
        target,
        launcher=args.launcher,
        nprocs=args.nprocs,
        entry=args.entry,
        echo=not args.quiet,
        keep=args.keep,
        unsafe=args.unsafe,
    )
    print("\n" + report.text(), flush=True)
    if args.json:
        try:
            report.write_json(args.json)
        except OSError as e:
            print(f"lab-grade: cannot write {args.json}: {e}", file=sys.stderr)
            return EXIT_ERROR
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
