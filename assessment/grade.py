"""The autograder: run a submission, then judge the checkpoint it leaves.

    lab-grade my_train.py                                # the target for this machine
    lab-grade my_train.py --target cpu-2proc --launcher mpirun --json report.json
    python -m assessment.grade my_train.py --launcher horovodrun --nprocs 2
    lab-grade calibrate ...                              # see assessment/calibrate.py

It trusts nothing the submission prints. Before starting the job it loads the
held-out test split and all of its own code; it then runs the submission in a fresh
working directory, measures the wall clock itself, stops the whole process tree at
budget + grace, reads ``checkpoint.pt`` with ``torch.load(weights_only=True)`` in
this process, rebuilds the model from the ``lab_utils.models`` registry and
evaluates it on the test split with ``lab_utils.train.evaluate``.

Exit codes: 0 pass; 1 fail (it ran, but missed the accuracy or the time, or had to
be stopped at budget + grace); 2 broken submission (syntax error, crash, no usable
checkpoint); 3 grader error (bad target or usage, missing data, a fault of the grader).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback
from dataclasses import dataclass

import torch

from lab_utils import data as ldata
from lab_utils import profile as lprofile
from lab_utils.loader import TensorLoader
from lab_utils.train import evaluate

from . import checkpoint as ckpt_mod
from . import sandbox
from . import targets as targets_mod
from .report import EXIT_ERROR, Report
from .targets import Target

EVAL_BATCH = 1000
TEST_SUBSET_SEED = 0
IDLE_CORES = 0.15  # a stopped job using less CPU than this was waiting, not computing


@dataclass(frozen=True)
class TestSplit:
    """The held-out images the grader evaluates on, loaded before the job starts."""

    x: torch.Tensor
    y: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]


def load_test_split(target: Target) -> TestSplit:
    """The test split of the target's dataset (a fixed subset if the target says so)."""
    ds = ldata.load(target.dataset)
    if target.test_samples is not None and target.test_samples < len(ds.x_test):
        ds = ds.subset(n_train=0, n_test=target.test_samples, seed=TEST_SUBSET_SEED)
    # Private copies: nothing the submission does to shared caches can reach them.
    return TestSplit(ds.x_test.clone(), ds.y_test.clone(), tuple(ds.mean), tuple(ds.std))


def check_fits(model: torch.nn.Module, split: TestSplit) -> None:
    """Refuse a model that cannot take the split's images or name all its classes
    (e.g. built for CIFAR-10 and submitted for Fashion-MNIST): the submission's fault."""
    classes = int(split.y.max()) + 1
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(1, *split.x.shape[1:]))
    except Exception as e:  # a shape mismatch inside the network
        raise ckpt_mod.CheckpointRejected(
            "wrong_arch", f"the model cannot take images of shape {tuple(split.x.shape[1:])}: "
                          f"{type(e).__name__}: {e}") from None
    if out.dim() != 2 or out.shape[1] < classes:
        raise ckpt_mod.CheckpointRejected(
            "wrong_arch", f"the model returns shape {tuple(out.shape)} for one image; the "
                          f"dataset needs (1, {classes}) logits")


def measure_accuracy(model: torch.nn.Module, split: TestSplit) -> tuple[float, int]:
    """Accuracy of ``model`` on ``split``, computed by the course's tested evaluation."""
    device = lprofile.device()
    loader = TensorLoader(split.x, split.y, EVAL_BATCH, shuffle=False, even_shards=False,
                          mean=split.mean, std=split.std, device=device)
    result = evaluate(model.to(device), loader, device=device)
    return float(result["acc"]), int(result["n"])


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
            "`lab-grade calibrate`")
    return name


def _environment(target: Target) -> dict:
    env = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "device": str(lprofile.device()), "target_status": target.status}
    if hasattr(os, "getloadavg"):
        env["load_before"] = round(os.getloadavg()[0], 2)
    return env


def grade(submission: str | os.PathLike, target: Target, *, launcher: str | None = None,
          nprocs: int | None = None, entry: str = "train.py", echo: bool = False,
          keep: bool = False) -> Report:
    """Run and judge ``submission`` against ``target``; never raises for its faults."""
    launcher = launcher or target.launcher
    nprocs = nprocs or target.processes
    report = Report(submission=str(submission), target=target.name, dataset=target.dataset,
                    launcher=launcher, nprocs=nprocs, budget_s=target.budget_s,
                    grace_s=target.grace_s, required_accuracy=target.accuracy)
    try:
        report.environment = _environment(target)
        if target.status != "calibrated":
            report.warnings.append(f"target {target.name} is {target.status!r}: its numbers are "
                                   "reasoned, not measured here (see `lab-grade calibrate`)")
        if nprocs != target.processes:
            report.warnings.append(f"graded with {nprocs} processes; the target is set for "
                                   f"{target.processes}")
        split = load_test_split(target)
        ws = sandbox.prepare(submission, entry)
        report.workdir, report.job_id = str(ws.workdir), ws.job_id
    except (ldata.DataError, sandbox.SubmissionError, OSError, ValueError) as e:
        return report.set("grader_error", f"{type(e).__name__}: {e}")
    try:
        _judge(report, ws, target, split, launcher, nprocs, echo)
    except Exception as e:  # a bug or an environment problem of the grader, not the student
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        report.set("grader_error", f"{type(e).__name__}: {e}")
        report.output_tail = report.output_tail or tb
    finally:
        if keep:
            report.warnings.append(f"working directory kept at {ws.workdir}")
        else:
            ws.cleanup()
        if hasattr(os, "getloadavg"):
            report.environment["load_after"] = round(os.getloadavg()[0], 2)
    return report


def _judge(report: Report, ws: sandbox.Workspace, target: Target, split: TestSplit,
           launcher: str, nprocs: int, echo: bool) -> None:
    """Fill in ``report``: run the job, then read and evaluate its checkpoint."""
    if ws.ignored:
        report.warnings.append(f"weight files in the submission were not copied: "
                               f"{', '.join(ws.ignored)}")
    problem = sandbox.syntax_error(ws.workdir)
    if problem:
        report.set("syntax_error", f"the submission does not compile, so it was not started: "
                                   f"{problem}")
        return
    if sandbox.reads_test_split(ws.workdir):
        report.warnings.append("the source mentions the test split; it may be used to report "
                               "accuracy but never to train (checked by hand)")
    env = {"LABS_PROFILE": target.profile,
           # Collectives must not give up before the grader's own deadline: a deadlock
           # is reported as one, not as a crash.
           "LABS_DIST_TIMEOUT": str(int(target.deadline_s + 60)),
           "LABS_RUNS": str(ws.workdir / "runs"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    if launcher == "mpirun" and target.profile != "gpu":
        # With as many ranks as cores, a rank that busy-polls in MPI (Horovod's
        # background thread) takes the core from its own compute thread.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    args = ["--dataset", target.dataset, "--budget", f"{target.budget_s:g}"]
    job = sandbox.run_job(ws, args, launcher=launcher, nprocs=nprocs, deadline=target.deadline_s,
                          env=env, threads_per_proc=target.threads_per_proc, echo=echo)
    report.elapsed_s = round(job.elapsed, 2)
    report.timed_out = job.timed_out
    report.returncode = job.returncode
    report.output_tail = job.tail()
    report.leftover_processes = job.leftovers
    report.environment["cpu_s"] = round(job.cpu_s, 1)
    idle_ranks = underused_cores(job.cpu_s, job.elapsed, nprocs, target.threads_per_proc,
                                 target.profile)
    if idle_ranks:
        report.warnings.append(idle_ranks)
    if job.leftovers:
        report.warnings.append(f"{job.leftovers} process(es) of the job outlived it and were "
                               "killed by the grader")

    if job.timed_out:
        report.set("timeout", f"still running at budget + grace = {target.deadline_s:g} s, so "
                              f"every process was stopped; {_why_stopped(job)}")
        return
    if job.returncode != 0:
        err = job.first_error()
        msg = f"the job exited with status {job.returncode}"
        msg += f"; first error: {err}" if err else "; no rank printed an error (see the output)"
        if (ws.workdir / ckpt_mod.CHECKPOINT_NAME).exists():
            msg += (". A checkpoint was written, so the failure came after it, e.g. at shutdown"
                    " (call dist.barrier() before destroy_process_group())")
        report.set("crashed", msg)
        return

    try:
        path = ckpt_mod.locate(ws.workdir)
        ckpt = ckpt_mod.read(path, target.max_checkpoint_mb)
        model, notes = ckpt_mod.rebuild(ckpt, target.archs)
        check_fits(model, split)
    except ckpt_mod.CheckpointRejected as e:
        report.set(e.reason, str(e))
        return
    report.warnings += notes
    report.checkpoint = ckpt_mod.describe(ckpt, model, path)
    report.accuracy, report.test_samples = measure_accuracy(model, split)
    report.accuracy = round(report.accuracy, 5)

    acc, need = report.accuracy, target.accuracy
    if job.elapsed > target.budget_s:
        report.set("over_budget", f"finished in {job.elapsed:.1f} s, over the budget of "
                                  f"{target.budget_s:g} s (accuracy {acc:.2%}, needed "
                                  f"{need:.2%})")
    elif acc < need:
        report.set("low_accuracy", f"test accuracy {acc:.2%} is below the target {need:.2%} "
                                   f"(finished in {job.elapsed:.1f} s of {target.budget_s:g} s)")
    else:
        report.set("passed", f"test accuracy {acc:.2%} >= {need:.2%} in {job.elapsed:.1f} s "
                             f"<= {target.budget_s:g} s")


def underused_cores(cpu_s: float, elapsed_s: float, nprocs: int,
                    threads_per_proc: int | None, profile: str) -> str:
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
    return (f"the job kept {busy:.1f} of its {cores} cores busy on average: were all "
            f"{nprocs} processes training? A fast serial script can meet a CPU target on "
            "one core; check by hand that the work is data-parallel")


def _why_stopped(job: sandbox.JobOutcome) -> str:
    """What a job stopped at the deadline was doing: waiting forever, or computing.

    CPU use decides: a job that still kept a core busy was working. Silence alone
    does not make it stuck (a script may print once per epoch, and a loaded
    machine stretches every gap), so it only adds a hint.
    """
    busy, quiet = job.busy_cores, job.silent_for or 0.0
    if busy is not None and busy < IDLE_CORES:
        return (f"its processes were idle ({busy:.2f} CPU cores busy) and printed nothing in "
                f"the last {quiet:.0f} s: a hang, or a deadlock between ranks (a collective "
                "that not every rank reaches)?")
    load = "" if busy is None else f" ({busy:.1f} CPU cores busy)"
    hint = "" if quiet < 30 else (f"; it printed nothing in the last {quiet:.0f} s, so if it "
                                  "should have, look for an endless loop or ranks spinning "
                                  "in a collective")
    return f"its processes were still computing{load}: it is too slow for this budget{hint}"


# --------------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    """Usage errors exit with the grader-error code, not 2 (which means "broken")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lab-grade", description=__doc__.split("\n\n")[0],
                epilog="Exit codes: 0 pass, 1 fail, 2 broken submission, 3 grader error. "
                       "`lab-grade calibrate --help` proposes targets for this machine.")
    p.add_argument("submission", help="the training script (.py), or a folder with --entry")
    p.add_argument("--target", "--profile", dest="target", default=None,
                   help="target name in assessment/targets or a .toml path "
                        f"(shipped: {', '.join(targets_mod.available())}; default: by hardware)")
    p.add_argument("--launcher", choices=targets_mod.LAUNCHERS, default=None,
                   help="how to start the processes (default: the target's)")
    p.add_argument("--nprocs", "-n", type=int, default=None,
                   help="number of processes (default: the target's)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.add_argument("--entry", default="train.py", help="entry script of a folder submission")
    p.add_argument("--quiet", "-q", action="store_true", help="do not stream the job's output")
    p.add_argument("--keep", action="store_true", help="keep the working directory (debugging)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        from . import calibrate

        return calibrate.main(argv[1:])
    args = parser().parse_args(argv)
    if args.nprocs is not None and args.nprocs < 1:
        print("lab-grade: --nprocs must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    try:
        target = targets_mod.load(args.target or default_target())
    except targets_mod.TargetError as e:
        print(f"lab-grade: {e}", file=sys.stderr)
        return EXIT_ERROR
    report = grade(args.submission, target, launcher=args.launcher, nprocs=args.nprocs,
                   entry=args.entry, echo=not args.quiet, keep=args.keep)
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
