"""``lab-grade``: the grader's one command line, handing off to its subcommands.

    lab-grade my_train.py                                # the target for this machine
    lab-grade my_train.py --target cpu-2proc --launcher mpirun --json report.json
    python -m assessment my_train.py --launcher horovodrun --nprocs 2   # the same, uninstalled
    lab-grade batch submissions/ --target cpu-2proc      # a class: assessment/batch.py
    lab-grade calibrate --target cpu-2proc --starter     # a target: assessment/calibrate.py

Grading one submission is the default: its options are below and the grading itself
is :func:`assessment.grade.grade`. ``batch`` and ``calibrate`` parse their own
options (:func:`assessment.batch.main`, :func:`assessment.calibrate.main`); the
options they share are in :mod:`assessment.options`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import batch, calibrate, grade, options
from .report import EXIT_ERROR

SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "batch": batch.main,
    "calibrate": calibrate.main,
}


def parser() -> argparse.ArgumentParser:
    """The options of ``lab-grade SUBMISSION``."""
    p = options.GraderParser(
        prog="lab-grade",
        description="The autograder: run a submission, then judge the checkpoint it leaves.",
        epilog="Exit codes: 0 pass, 1 fail, 2 broken submission, 3 grader error. "
        "`lab-grade batch --help` grades a folder of submissions; "
        "`lab-grade calibrate --help` proposes targets for this machine.",
    )
    p.add_argument("submission", help="the training script (.py), or a folder with --entry")
    options.add_target(p)
    options.add_launch(p)
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="do not stream the job's output")
    p.add_argument("--keep", action="store_true", help="keep the working directory (debugging)")
    options.add_submission(p)
    return p


def grade_one(argv: list[str]) -> int:
    """``lab-grade SUBMISSION``: grade it, print the report; the verdict's exit code."""
    args = parser().parse_args(argv)
    if args.nprocs is not None and args.nprocs < 1:
        print("lab-grade: --nprocs must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    target = options.load_target(args.target, "lab-grade")
    if target is None:
        return EXIT_ERROR
    report = grade.grade(
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


def main(argv: list[str] | None = None) -> int:
    """The console script: a subcommand by its first word, else one submission."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = SUBCOMMANDS.get(argv[0]) if argv else None
    if command is not None:
        return command(argv[1:])
    return grade_one(argv)


if __name__ == "__main__":
    sys.exit(main())
