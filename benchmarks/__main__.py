"""Command line: ``python -m benchmarks [--quick] [--only NAME ...] [--json PATH] [--readme]``.

Exit status: 0 when every selected benchmark ran or was skipped (a missed target is a
finding, not a failure), 1 when one of them crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from . import BENCHMARKS, module
from .common import Report, Settings, Skip, load_average, machine, utc_now
from .table import read_json, replace_block, text, update_readme, write_json

README = Path(__file__).resolve().parent / "README.md"
# What --readme recorded: one results file per benchmark (as --json writes them), the
# source of its part of README's table and of the figures other READMEs quote.
RECORDED = Path(__file__).resolve().parent / "recorded"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure the labs, the library and the distributed paths; print a table.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, one round: checks the harness works (figures meaningless)",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds per figure (default: each benchmark's own)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every result and sample as JSON")
    p.add_argument(
        "--readme",
        action="store_true",
        help=f"write the table into {README.relative_to(README.parent.parent)}, the "
        "results into benchmarks/recorded/NAME.json and the figures other READMEs quote "
        "(every benchmark; with --only, or --from-json of some, only their parts)",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        metavar="PATH",
        help="run nothing: show (and with --readme record) the results saved "
        "by earlier --json runs on this machine; later files win",
    )
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.readme and args.quick:
        p.error("--readme records full runs: drop --quick")
    if args.from_json and (args.quick or args.only or args.repeats or args.json):
        p.error("--from-json runs nothing: it takes no --quick, --only, --repeats or --json")
    return args


def run_one(name: str, settings: Settings) -> Report:
    """Run one benchmark; a skip or a crash becomes part of its report."""
    mod = module(name)
    start = time.perf_counter()
    load_before = load_average()
    try:
        report = mod.run(settings)
    except Skip as e:
        report = Report(name, mod.TITLE, skipped=str(e))
    except Exception as e:  # reported, and the other benchmarks still run
        report = Report(name, mod.TITLE, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
    report.seconds = time.perf_counter() - start
    report.details["date"] = utc_now()
    report.details["load_average"] = {"start": load_before, "end": load_average()}
    return report


def saved_results(paths: Sequence[str]) -> tuple[dict, list[Report], bool]:
    """Machine, reports (in the usual order) and quick flag from earlier JSON files."""
    info: dict = {}
    by_name: dict[str, Report] = {}
    quick = False
    for path in paths:
        doc_info, reports, doc_quick = read_json(path)
        if info and any(info.get(k) != doc_info.get(k) for k in ("cpu", "logical_cpus", "torch")):
            raise SystemExit(
                f"{path} was measured on another machine or torch; "
                "combine only results from one set-up"
            )
        info, quick = doc_info, quick or doc_quick
        by_name.update((r.name, r) for r in reports)
    return info, [by_name[n] for n in BENCHMARKS if n in by_name], quick


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name in BENCHMARKS:
            print(f"{name:<10} {module(name).TITLE}")
        return 0
    if args.from_json:
        info, reports, quick = saved_results(args.from_json)
        if args.readme and quick:
            raise SystemExit("--readme needs full (not --quick) results")
    else:
        quick = args.quick
        settings = Settings(quick=quick, repeats=args.repeats)
        torch.set_num_threads(settings.threads)
        names = list(dict.fromkeys(args.only)) if args.only else list(BENCHMARKS)
        info = machine()
        reports = []
        for name in names:
            print(f"-- {name}: {module(name).TITLE} ...", file=sys.stderr, flush=True)
            reports.append(run_one(name, settings))
            reports[-1].details["commit"] = info["commit"]
        info["load_average_end"] = load_average()
    print(text(info, reports, quick), flush=True)
    if args.json:
        print(f"wrote {write_json(args.json, info, reports, quick)}")
    if args.readme:
        for path in record(info, reports):
            print(f"updated {path}")
    return 1 if any(r.error for r in reports) else 0


def record(info: dict, reports: Sequence[Report]) -> list[Path]:
    """``--readme``: the table (whole, or the parts of these benchmarks), one results file
    per benchmark, and the figures a benchmark writes elsewhere (``figures``, a block
    between ``FIGURES_START`` and ``FIGURES_END`` in ``FIGURES_IN``) from a run that worked."""
    partial = {r.name for r in reports} != set(BENCHMARKS)
    paths = [update_readme(README, info, reports, False, partial=partial)]
    for r in reports:
        paths.append(write_json(RECORDED / f"{r.name}.json", info, [r], False))
        mod = module(r.name)
        if hasattr(mod, "figures") and not (r.error or r.skipped):
            body = mod.figures(info, r)
            paths.append(replace_block(mod.FIGURES_IN, mod.FIGURES_START, mod.FIGURES_END, body))
    return paths


if __name__ == "__main__":
    sys.exit(main())
