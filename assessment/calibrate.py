"""Propose an accuracy-in-time target for the machine at hand.

    lab-grade calibrate --target cpu-2proc --runs 3 --starter
    python -m assessment.calibrate --target gpu-4 --launcher torchrun --write my-gpu-4.toml

Runs a reference solution several times through the grader itself (same launcher,
same working-directory set-up, same evaluation), and with ``--starter`` the serial
starter once, then proposes:

* ``accuracy``: the worst reference run's test accuracy minus ``--acc-margin``,
  rounded down to a tenth of a point;
* ``budget_s``: with ``--starter``, the geometric mean of the slowest reference run
  and the starter's time (the same factor of room on both sides: the references
  pass, the starter fails on time); without it, the slowest reference run times
  ``--time-margin``. Rounded to 5 seconds.

Instructors' hardware differs: calibrate on the machines the students will be
graded on, while nothing else runs there. Also check by hand that the accuracy is
out of reach of a serial run that fits in the budget (fewer epochs of the starter).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from . import grade as grade_mod
from . import options
from .report import EXIT_ERROR, EXIT_FAIL, EXIT_PASS, Report
from .targets import Target

HERE = Path(__file__).resolve().parent
SOLUTIONS = {
    "torchrun": HERE / "solutions" / "reference_ddp.py",
    "mpirun": HERE / "solutions" / "reference_ddp.py",
    "horovodrun": HERE / "solutions" / "reference_horovod.py",
}
STARTER = HERE / "starter.py"


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A proposed target and the measurements behind it."""

    accuracy: float
    budget_s: float
    runs: list[dict[str, float]]
    starter_s: float | None = None

    @property
    def worst_accuracy(self) -> float:
        return min(r["accuracy"] for r in self.runs)

    @property
    def slowest_s(self) -> float:
        return max(r["elapsed_s"] for r in self.runs)

    @property
    def reference_room(self) -> float:
        """How many times the slowest reference run fits in the budget."""
        return self.budget_s / self.slowest_s

    @property
    def starter_room(self) -> float | None:
        """How many times over the budget the starter is (None: not measured)."""
        return None if self.starter_s is None else self.starter_s / self.budget_s


def propose(
    runs: list[dict[str, float]],
    acc_margin: float = 0.005,
    time_margin: float = 1.25,
    starter_s: float | None = None,
) -> Proposal:
    """Accuracy just below the worst reference run; a budget between the slowest
    reference run and the starter (or ``time_margin`` above the slowest run)."""
    if not runs:
        raise ValueError("no successful reference runs to calibrate from")
    if not 0 <= acc_margin < 1 or time_margin < 1:
        raise ValueError("need 0 <= acc_margin < 1 and time_margin >= 1")
    worst = min(r["accuracy"] for r in runs)
    slowest = max(r["elapsed_s"] for r in runs)
    accuracy = math.floor(round((worst - acc_margin) * 1000, 6)) / 1000
    if accuracy <= 0:
        raise ValueError(f"the reference reaches only {worst:.2%}: nothing to calibrate against")
    if starter_s is not None:
        if starter_s <= slowest:
            raise ValueError(
                f"the starter ({starter_s:.1f} s) is not slower than the slowest "
                f"reference run ({slowest:.1f} s): no budget separates them"
            )
        budget = max(5, round(math.sqrt(slowest * starter_s) / 5) * 5)
    else:
        budget = math.ceil(slowest * time_margin / 5) * 5
    return Proposal(
        accuracy=round(accuracy, 3), budget_s=float(budget), runs=runs, starter_s=starter_s
    )


def measure(
    solution: Path,
    base: Target,
    *,
    runs: int,
    launcher: str,
    nprocs: int,
    timeout_s: float,
    echo: bool,
    serial: bool = False,
) -> list[Report]:
    """Grade ``solution`` ``runs`` times with only a generous time limit (and, for a
    ``serial`` script such as the starter, no verdict on data parallelism)."""
    loose = dataclasses.replace(
        base,
        budget_s=timeout_s,
        grace_s=0.0,
        accuracy=1e-6,
        data_parallel="warn" if serial else base.data_parallel,
    )
    reports = []
    for i in range(runs):
        print(
            f"calibrate: run {i + 1}/{runs} of {solution.name} under {launcher} "
            f"with {nprocs} processes ...",
            flush=True,
        )
        r = grade_mod.grade(solution, loose, launcher=launcher, nprocs=nprocs, echo=echo)
        status = (
            f"{r.elapsed_s:.1f} s, accuracy {r.accuracy:.2%}"
            if r.passed
            else f"{r.status}: {r.reason}: {r.message}"
        )
        print(
            f"calibrate:   {status} (CPU {r.environment.get('cpu_s', '?')} s, load "
            f"{r.environment.get('load_before', '?')})",
            flush=True,
        )
        reports.append(r)
    return reports


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def target_toml(base: Target, p: Proposal, launcher: str, nprocs: int) -> str:
    """The proposed target as the text of a TOML file."""
    today = dt.date.today().isoformat()
    fields = {
        "name": base.name,
        "description": base.description,
        "status": "calibrated",
        "dataset": base.dataset,
        "accuracy": p.accuracy,
        "budget_s": p.budget_s,
        "grace_s": base.grace_s,
        "processes": nprocs,
        "threads_per_proc": base.threads_per_proc or 0,
        "launcher": launcher,
        "profile": base.profile,
        "archs": list(base.archs),
        "max_checkpoint_mb": base.max_checkpoint_mb,
        "data_parallel": base.data_parallel,
    }
    if base.test_samples is not None:
        fields["test_samples"] = base.test_samples
    lines = [
        f"# Calibrated {today} on {platform.node()} ({os.cpu_count()} CPUs, torch "
        f"{torch.__version__}) by `lab-grade calibrate`."
    ]
    lines += [f"{k} = {_toml(v)}" for k, v in fields.items()]
    lines += [
        "",
        "[calibration]",
        f"date = {_toml(today)}",
        f"reference_runs = {_toml([{k: round(v, 4) for k, v in r.items()} for r in p.runs])}",
        f"worst_accuracy = {p.worst_accuracy:.4f}",
        f"slowest_s = {p.slowest_s:.1f}",
    ]
    if p.starter_s is not None:
        lines.append(f"starter_s = {p.starter_s:.1f}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The options of ``lab-grade calibrate``."""
    p = options.GraderParser(prog="lab-grade calibrate", description=__doc__.split("\n\n")[0])
    options.add_target(p, "target to start from")
    p.add_argument(
        "--solution",
        default=None,
        help="reference solution (default: reference_horovod.py for horovodrun, "
        "reference_ddp.py otherwise)",
    )
    options.add_launch(p)
    p.add_argument("--runs", type=int, default=3, help="reference runs (default 3)")
    p.add_argument(
        "--acc-margin",
        type=float,
        default=0.005,
        help="accuracy below the worst reference run (default 0.005)",
    )
    p.add_argument(
        "--time-margin",
        type=float,
        default=1.25,
        help="without --starter: budget as a multiple of the slowest run (default 1.25)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds before a reference run is stopped (default 900)",
    )
    p.add_argument(
        "--starter",
        action="store_true",
        help="also time the serial starter and put the budget between the two",
    )
    p.add_argument("--write", metavar="PATH", default=None, help="write the proposed target here")
    p.add_argument("--quiet", "-q", action="store_true", help="do not stream the jobs' output")
    return p


def main(argv: list[str] | None = None) -> int:
    """``lab-grade calibrate``: time the references (and the starter), propose a target."""
    args = parser().parse_args(argv)
    base = options.load_target(args.target, "calibrate")
    if base is None:
        return EXIT_ERROR
    if args.runs < 1:
        print("calibrate: --runs must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    launcher = args.launcher or base.launcher
    nprocs = args.nprocs or base.processes
    solution = Path(args.solution) if args.solution else SOLUTIONS[launcher]
    common = dict(launcher=launcher, nprocs=nprocs, timeout_s=args.timeout, echo=not args.quiet)
    good = _reference_runs(solution, base, args.runs, common)
    if good is None:
        return EXIT_FAIL
    starter_s = None
    if args.starter:
        starter_s = _starter_time(base, common)
        if starter_s is None:
            return EXIT_FAIL
    try:
        proposal = propose(_measurements(good), args.acc_margin, args.time_margin, starter_s)
    except ValueError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return EXIT_ERROR
    code = _show(proposal, base, good, nprocs)
    text = target_toml(base, proposal, launcher, nprocs)
    print("\n" + text)
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
        print(f"calibrate: wrote {args.write}")
    return code


def _reference_runs(
    solution: Path, base: Target, runs: int, common: dict[str, Any]
) -> list[Report] | None:
    """The reference's reports, or None (after showing the failures) if any run failed."""
    reports = measure(solution, base, runs=runs, **common)
    good = [r for r in reports if r.passed]
    for r in reports:
        if not r.passed:
            print(r.text(), file=sys.stderr)
    if len(good) < len(reports):
        print(
            f"calibrate: {len(reports) - len(good)} of {len(reports)} reference runs failed; "
            "fix them before trusting a target",
            file=sys.stderr,
        )
        return None
    return good


def _starter_time(base: Target, common: dict[str, Any]) -> float | None:
    """The serial starter's time, or None (after showing why) if it did not finish."""
    print("calibrate: timing the serial starter ...", flush=True)
    starter = measure(STARTER, base, runs=1, serial=True, **common)[0]
    if not starter.passed:
        print(starter.text(), file=sys.stderr)
        return None
    return float(starter.elapsed_s or 0)


def _measurements(good: list[Report]) -> list[dict[str, float]]:
    return [
        {
            "elapsed_s": float(r.elapsed_s or 0),
            "accuracy": float(r.accuracy or 0),
            "cpu_s": float(r.environment.get("cpu_s", 0)),
        }
        for r in good
    ]


def _show(proposal: Proposal, base: Target, good: list[Report], nprocs: int) -> int:
    """Print the measurements and the proposal; EXIT_FAIL where either side has too
    little room for the verdicts not to depend on noise."""
    runs = proposal.runs
    print(
        f"\nreference: accuracy {min(r['accuracy'] for r in runs):.2%} .. "
        f"{max(r['accuracy'] for r in runs):.2%}, time {min(r['elapsed_s'] for r in runs):.1f}"
        f" .. {proposal.slowest_s:.1f} s over {len(runs)} runs"
    )
    if proposal.starter_s is not None:
        print(f"starter:   {proposal.starter_s:.1f} s")
    print(
        f"proposed:  accuracy >= {proposal.accuracy:.2%} within {proposal.budget_s:g} s "
        f"(+ {base.grace_s:g} s grace) on {nprocs} processes; the slowest reference run "
        f"has {proposal.reference_room:.2f}x room"
        + (
            ""
            if proposal.starter_room is None
            else f", the starter is {proposal.starter_room:.2f}x over"
        )
    )
    code = EXIT_PASS
    if min(proposal.reference_room, proposal.starter_room or 2.0) < 1.1:
        print(
            "warning: less than 10 % of room on one side: the verdicts will depend on "
            "noise; give the references more work (epochs) or the machine less"
        )
        code = EXIT_FAIL
    loads = [r.environment.get("load_before", 0) for r in good]
    if max(loads, default=0) > (os.cpu_count() or 1):
        print(
            f"warning: the load average reached {max(loads):.1f} on {os.cpu_count()} CPUs "
            "during calibration: other work was running, the times are pessimistic"
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
