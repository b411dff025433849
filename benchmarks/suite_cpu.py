"""What the test suite costs, in CPU-seconds, by test module.

Wall-clock time on two shared cores says little about which tests to make
cheaper: a test that waits on a launched job costs wall time but no CPU, and
two workers slow each other down. This plugin adds up, for every test, the
CPU time of the pytest process and of the child processes it waited for
(``os.times``: user + system of self and of reaped children), which is where
launched ranks and notebook kernels spend theirs.

Record (from the repository root, any pytest arguments)::

    LABS_SUITE_CPU=/tmp/cpu make test PYTEST_ARGS="-p benchmarks.suite_cpu"

Report the ten largest modules::

    python -m benchmarks.suite_cpu /tmp/cpu [--top 10]

Write the wall-clock seconds of every module to ``tests/suite_costs.json``, which sets the
order modules start in (tests/conftest.py: longest first)::

    python -m benchmarks.suite_cpu /tmp/cpu --write-costs tests/suite_costs.json

A kernel or a daemon that is reaped after its module's last test is charged to
that test, so the table is exact by module, not by test.

Each record also lists the commands the test launched (the ``$ ...`` lines
``launch.run`` prints, from the test's captured output), so jobs that several tests
start alike can be found::

    python -m benchmarks.suite_cpu /tmp/cpu --repeated
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

_DIR_VAR = "LABS_SUITE_CPU"
_launched: dict[str, list[str]] = defaultdict(list)  # node id -> commands it launched
# What differs between two launches of the same job: temporary folders, ports, seeds of names.
_VOLATILE = re.compile(r"/tmp/\S*|MASTER_PORT=\d+|--master-port[= ]\d+|labs-metrics-\w+")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Each phase's report repeats the sections of the phases before it: read its own.
    own = f"Captured stdout {report.when}"
    for name, text in report.sections:
        if name == own:
            for line in text.splitlines():
                if line.startswith("$ "):  # launch.run shows every command it starts so
                    _launched[report.nodeid].append(line[2:])


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    out = os.environ.get(_DIR_VAR)
    before, started = _cpu_seconds(), time.monotonic()
    yield
    if not out:
        return
    spent, wall = _cpu_seconds() - before, time.monotonic() - started
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / f"{worker}.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "test": item.nodeid,
                    "cpu_s": round(spent, 3),
                    "wall_s": round(wall, 3),
                    "launched": _launched.pop(item.nodeid, []),
                }
            )
            + "\n"
        )


def _rows(folder: Path) -> Iterator[tuple[Path, dict]]:
    """Every record of a recording, with the file it is in."""
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SystemExit(
            f"suite_cpu: no recording in {folder} (set {_DIR_VAR} and load -p benchmarks.suite_cpu)"
        )
    for path in files:
        for line in path.read_text().splitlines():
            yield path, json.loads(line)


def by_module(folder: Path, key: str = "cpu_s") -> dict[str, float]:
    """CPU-seconds (or ``key="wall_s"``, wall-clock seconds) per test module (the node id's
    file part) from a recording."""
    totals: dict[str, float] = defaultdict(float)
    for path, row in _rows(folder):
        if key not in row:
            raise SystemExit(f"suite_cpu: {path} was recorded without {key}: record again")
        totals[row["test"].split("::")[0]] += row[key]
    return dict(totals)


def repeated(folder: Path) -> list[tuple[str, list[str]]]:
    """Commands launched by more than one test (temporary paths and ports blanked), with
    the tests that launched each, most repeated first."""
    by_command: dict[str, list[str]] = defaultdict(list)
    for _, row in _rows(folder):
        jobs = dict.fromkeys(_VOLATILE.sub("…", c) for c in row.get("launched", []))
        for job in jobs:  # a test's own repeats count once
            by_command[job].append(row["test"])
    shared = [(c, tests) for c, tests in by_command.items() if len(tests) > 1]
    return sorted(shared, key=lambda ct: -len(ct[1]))


def table(totals: dict[str, float], top: int) -> str:
    """A markdown table of the ``top`` largest modules and the whole suite."""
    whole = sum(totals.values())
    rows = ["| test module | CPU s | share |", "|---|---:|---:|"]
    for name, cpu in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"| {name} | {cpu:,.0f} | {cpu / whole:.0%} |")
    rows.append(f"| whole suite ({len(totals)} modules) | {whole:,.0f} | 100% |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help=f"the folder {_DIR_VAR} named when recording")
    parser.add_argument("--top", type=int, default=10, help="how many modules to list (default 10)")
    parser.add_argument(
        "--write-costs",
        type=Path,
        metavar="JSON",
        help="also write each module's wall-clock seconds there (tests/suite_costs.json)",
    )
    parser.add_argument(
        "--repeated", action="store_true", help="list the commands more than one test launched"
    )
    args = parser.parse_args(argv)
    if args.repeated:
        for command, tests in repeated(args.folder):
            print(f"{len(tests)} x {command}")
            print("".join(f"    {t}\n" for t in tests), end="")
        return
    print(table(by_module(args.folder), args.top))
    if args.write_costs:
        wall = by_module(args.folder, "wall_s")
        costs = {m: round(s, 1) for m, s in sorted(wall.items(), key=lambda kv: -kv[1])}
        args.write_costs.write_text(json.dumps(costs, indent=1) + "\n")


if __name__ == "__main__":
    main()
