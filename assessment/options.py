"""Command-line options shared by ``lab-grade``, ``lab-grade batch`` and
``lab-grade calibrate``: the parser's error handling, the options of a run, and the
options of a batch (:class:`BatchOptions`, one type for ``batch`` and ``slurm``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from . import targets as targets_mod
from .report import EXIT_ERROR


class GraderParser(argparse.ArgumentParser):
    """Usage errors exit with the grader-error code, not 2 (which means "broken")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def add_target(p: argparse.ArgumentParser, what: str = "target") -> None:
    """``--target`` (alias ``--profile``): a shipped name or a .toml path."""
    p.add_argument(
        "--target",
        "--profile",
        dest="target",
        default=None,
        help=f"{what}: name in assessment/targets or a .toml path "
        f"(shipped: {', '.join(targets_mod.available())}; default: by hardware)",
    )


def add_launch(p: argparse.ArgumentParser) -> None:
    """``--launcher`` and ``--nprocs``: how the job is started (default: the target's)."""
    p.add_argument(
        "--launcher",
        choices=targets_mod.LAUNCHERS,
        default=None,
        help="how to start the processes (default: the target's)",
    )
    p.add_argument(
        "--nprocs", "-n", type=int, default=None, help="number of processes (default: the target's)"
    )


def add_submission(p: argparse.ArgumentParser) -> None:
    """``--entry`` and ``--unsafe-no-sandbox``: how a submission is copied and confined."""
    p.add_argument("--entry", default="train.py", help="entry script of a folder submission")
    p.add_argument(
        "--unsafe-no-sandbox",
        dest="unsafe",
        action="store_true",
        help="run the submission without the sandbox where none can be made "
        "(it can then read the test split and change files; the report says so first)",
    )


def load_target(name: str | None, prog: str) -> targets_mod.Target | None:
    """The target named on the command line (or this machine's); None after saying why not."""
    try:
        return targets_mod.load(name or targets_mod.default_target())
    except targets_mod.TargetError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


@dataclass(frozen=True)
class BatchOptions:
    """How a class is graded: by :func:`assessment.batch.run_batch` on this machine or
    :func:`assessment.slurm.run_slurm_batch` on Slurm (the fields after ``echo``)."""

    launcher: str | None = None  # None: the target's
    nprocs: int | None = None  # None: the target's
    entry: str = "train.py"  # the entry script of a folder submission
    unsafe: bool = False  # grade without the sandbox (the reports say so)
    regrade: bool = False  # grade again students already graded
    echo: bool = True  # print progress
    partition: str | None = None  # sbatch --partition
    gres: str | None = None  # sbatch --gres, e.g. gpu:4
    time_limit: str | None = None  # each job's --time (None: slurm.default_time)
    sbatch_args: Sequence[str] = ()  # more sbatch options, e.g. --account=X
    poll_s: float = 5.0  # seconds between polls of the queue

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchOptions:
        """The options ``lab-grade batch`` parsed (:func:`assessment.batch.parser`)."""
        return cls(
            launcher=args.launcher,
            nprocs=args.nprocs,
            entry=args.entry,
            unsafe=args.unsafe,
            regrade=args.regrade,
            partition=args.partition,
            gres=args.gres,
            time_limit=args.time_limit,
            sbatch_args=tuple(args.sbatch_args),
            poll_s=args.poll,
        )
