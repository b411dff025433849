"""The autograder: run a submission, then judge the checkpoint it leaves.

    lab-grade my_train.py                                # the target for this machine
    lab-grade my_train.py --target cpu-2proc --launcher mpirun --json report.json
    python -m assessment my_train.py --launcher horovodrun --nprocs 2

The command line is :mod:`assessment.cli`; this module is the grading itself, and
:func:`assessment.sandbox.run_job` the running of the job.
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

import os
import platform
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from lab_utils import data as ldata
from lab_utils import profile as lprofile

from . import evaluate as eval_mod
from . import integrity, jail, sandbox
from . import participation as part
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


@dataclass
class _Setup:
    """What a graded job runs in and is checked against, made before it starts."""

    ws: sandbox.Workspace
    conf: sandbox.Confinement
    split_file: Path
    guarded: list[Path]
    before: dict[str, str]


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
    try:
        setup = _set_up(report, submission, target, entry, unsafe, data_dir)
    except jail.JailError as e:
        return report.set(
            "grader_error",
            f"no sandbox can be made, so the submission was not "
            f"run: {e}. To grade anyway, knowing that the "
            "submission can then read the test split and change "
            "your files, pass --unsafe-no-sandbox.",
        )
    except (ldata.DataError, sandbox.SubmissionError, OSError, ValueError) as e:
        return report.set("grader_error", f"{type(e).__name__}: {e}")
    try:
        _judge(report, setup, target, launcher, nprocs, echo)
    except Exception as e:  # a bug or an environment problem of the grader, not the student
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        report.set("grader_error", f"{type(e).__name__}: {e}")
        report.output_tail = report.output_tail or tb
    finally:
        setup.ws.cleanup(keep)
        if keep:
            report.warnings.append(f"working directory kept at {setup.ws.workdir}")
        if hasattr(os, "getloadavg"):
            report.environment["load_after"] = round(os.getloadavg()[0], 2)
    return report


def _set_up(
    report: Report,
    submission: str | os.PathLike,
    target: Target,
    entry: str,
    unsafe: bool,
    data_dir: Path | None,
) -> _Setup:
    """Check the sandbox, copy the submission, save the test split out of the job's
    reach and hash what the verdict depends on; the working directory is removed
    again if a step fails."""
    report.environment = _environment(target)
    _note_conditions(report, target, unsafe)
    split, source = load_test_split(target)
    ws = sandbox.prepare(submission, entry)
    try:
        report.workdir, report.job_id = str(ws.workdir), ws.job_id
        grader_dir = ws.root / "grader"  # never shown to the job
        grader_dir.mkdir()
        split_file = grader_dir / "test-split.pt"
        split.save(split_file)
        if not unsafe and data_dir is None:
            data_dir = jail.training_copy(target.dataset, ws.data_copy)
        conf = sandbox.Confinement(
            data_dir=None if unsafe else data_dir, repo=REPO, sandboxed=not unsafe, hide=[source]
        )
        guarded = _guarded_files(target, source, split_file)
        before = integrity.snapshot(guarded, [REPO / p for p in integrity.CODE_PACKAGES])
    except BaseException:
        ws.cleanup()
        raise
    return _Setup(ws, conf, split_file, guarded, before)


def _note_conditions(report: Report, target: Target, unsafe: bool) -> None:
    """Check the sandbox (or say first that there is none) and warn about the target."""
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
    if report.nprocs != target.processes:
        report.warnings.append(
            f"graded with {report.nprocs} processes; the target is set for {target.processes}"
        )


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
    setup: _Setup,
    target: Target,
    launcher: str,
    nprocs: int,
    echo: bool,
) -> None:
    """Fill in ``report``: run the job, check nothing it must not touch changed, then
    read and evaluate its checkpoint in a fresh process."""
    if not _may_start(report, setup.ws):
        return
    job = sandbox.run_job(
        setup.ws, target, launcher=launcher, nprocs=nprocs, confinement=setup.conf, echo=echo
    )
    _record_job(report, job, target, nprocs)
    altered = integrity.changed(
        setup.before,
        integrity.snapshot(setup.guarded, [REPO / p for p in integrity.CODE_PACKAGES]),
    )
    if _stopped_early(report, job, target, setup.ws, altered):
        return
    if not _evaluate(report, setup, target):
        return
    _verdict(report, job, target, nprocs)


def _may_start(report: Report, ws: sandbox.Workspace) -> bool:
    """Whether the copied submission compiles; warnings on what was left out or named."""
    if ws.ignored:
        report.warnings.append(
            f"weight files in the submission were not copied: {', '.join(ws.ignored)}"
        )
    problem = sandbox.syntax_error(ws.workdir)
    if problem:
        report.set(
            "syntax_error", f"the submission does not compile, so it was not started: {problem}"
        )
        return False
    if sandbox.reads_test_split(ws.workdir):
        report.warnings.append(
            "the source mentions the test split; it may be used to report "
            "accuracy but never to train (checked by hand)"
        )
    return True


def _record_job(report: Report, job: sandbox.JobOutcome, target: Target, nprocs: int) -> None:
    """The job's times, output, limits and per-rank evidence, and warnings from them."""
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


def _stopped_early(
    report: Report,
    job: sandbox.JobOutcome,
    target: Target,
    ws: sandbox.Workspace,
    altered: list[str],
) -> bool:
    """The verdict where nothing is evaluated: guarded files changed, the job was
    stopped at the deadline, or it failed. False where the checkpoint is to be read."""
    if altered:
        report.set(
            "tampered",
            f"files the grader judges with changed during the job, so "
            f"nothing was evaluated: {', '.join(altered[:5])}"
            + (f" and {len(altered) - 5} more" if len(altered) > 5 else "")
            + ". Restore them (git checkout, reinstall the data) before "
            "grading anything else.",
        )
    elif job.timed_out:
        report.set(
            "timeout",
            f"still running at budget + grace = {target.deadline_s:g} s, so "
            f"every process was stopped; {_why_stopped(job)}",
        )
    elif job.returncode != 0:
        report.set("crashed", _crash_message(job, target, ws))
    else:
        return False
    return True


def _crash_message(job: sandbox.JobOutcome, target: Target, ws: sandbox.Workspace) -> str:
    """Why a job that exited with an error status failed, as far as the grader can tell."""
    err = job.first_error()
    msg = f"the job exited with status {job.returncode}"
    if job.memory_killed:
        msg += f"; a process was killed for going over the memory limit of {target.memory_mb:g} MB"
    msg += f"; first error: {err}" if err else "; no rank printed an error (see the output)"
    if (ws.workdir / "checkpoint.pt").exists():
        msg += (
            ". A checkpoint was written, so the failure came after it, e.g. at shutdown"
            " (call dist.barrier() before destroy_process_group())"
        )
    return msg


def _evaluate(report: Report, setup: _Setup, target: Target) -> bool:
    """Read and evaluate the checkpoint in a fresh process; False where it was refused."""
    result = eval_mod.run(
        setup.ws.workdir,
        setup.split_file,
        list(target.archs),
        target.max_checkpoint_mb,
        REPO,
        env={**os.environ, "LABS_PROFILE": target.profile},
    )
    report.environment["evaluation_memory_mb"] = result.get("memory_mb")
    if result["reason"] is not None:
        report.set(result["reason"], result["message"])
        return False
    report.warnings += result["notes"]
    report.checkpoint = result["checkpoint"]
    report.accuracy, report.test_samples = result["accuracy"], result["test_samples"]
    return True


def _verdict(report: Report, job: sandbox.JobOutcome, target: Target, nprocs: int) -> None:
    """Judge an evaluated run: time first, then accuracy, then data parallelism."""
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


if __name__ == "__main__":  # the command line is cli.py's, which imports this module
    import sys

    print("the grader's command line is `lab-grade` (or `python -m assessment`)", file=sys.stderr)
    sys.exit(EXIT_ERROR)
