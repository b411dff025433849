"""The results as a text table (terminal), as Markdown (README) and as JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import Report, describe

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"


def _conditions(machine: dict[str, Any]) -> str:
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    if not start:
        return ""
    text = f"load average (1/5/15 min) {'/'.join(map(str, start))} at the start"
    if end:
        text += f", {'/'.join(map(str, end))} at the end"
    return text


def _measured(report: Report) -> str:
    """When (and at which commit) one benchmark ran and how busy the machine was meanwhile."""
    load = report.details.get("load_average") or {}
    parts = []
    if report.details.get("date"):
        parts.append(f"measured {report.details['date']}")
    if report.details.get("commit"):  # a section re-measured alone says its own commit
        parts.append(f"commit `{report.details['commit']}`")
    if load.get("start") and load.get("end"):
        parts.append(f"load average {load['start'][0]:g} → {load['end'][0]:g}")
    parts.append(f"{report.seconds:.0f} s")
    return ", ".join(parts)


def _status(report: Report) -> str:
    if report.error:
        return f"FAILED: {report.error.splitlines()[0] if report.error else ''}"
    if report.skipped:
        return f"skipped: {report.skipped}"
    return ""


def text(machine: dict[str, Any], reports: Sequence[Report], quick: bool) -> str:
    """A plain-text table for the terminal."""
    lines = [
        f"Machine: {describe(machine)}",
        f"Date: {machine['date']}; {_conditions(machine)}"
        + ("; QUICK MODE (figures are meaningless)" if quick else ""),
    ]
    for i, r in enumerate(reports, 1):
        lines += ["", f"{i}. {r.title}  [{r.name}]"]
        if _status(r):
            lines.append(f"   {_status(r)}")
        width = max([len(row.metric) for row in r.rows] + [20])
        for row in r.rows:
            target = f"target {row.target}" if row.target else ""
            cells = [
                f"   {row.metric:<{width}}",
                f"{row.formatted_value():>16}",
                f"{target:<18}",
                f"{row.status:<6}",
                row.note,
            ]
            lines.append("  ".join(cells).rstrip())
        lines += [f"   {note}" for note in r.notes] + [f"   ({_measured(r)})"]
    return "\n".join(lines)


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|")


def markdown(machine: dict[str, Any], reports: Sequence[Report], quick: bool) -> str:
    """The results as Markdown: machine and conditions, then one table per benchmark."""
    out = [
        f"`python -m benchmarks{' --quick' if quick else ''}` at commit "
        f"`{machine.get('commit') or '?'}`, {machine['date']} (each benchmark says when it "
        "ran and how busy the machine was).",
        "",
        f"- **Machine:** {describe(machine)}",
        f"- **Conditions:** {_conditions(machine) or 'unknown'}",
    ]
    for i, r in enumerate(reports, 1):
        out += ["", *section(i, r)]
    return "\n".join(out)


def section(number: int, report: Report, machine_note: str = "") -> list[str]:
    """One benchmark's part of :func:`markdown`: heading, table, notes, when measured."""
    out = [f"### {number}. {report.title}", ""]
    if _status(report):
        out += [f"*{_md_cell(_status(report))}*", ""]
    if report.rows:
        out += ["| measurement | value | target | | note |", "| --- | ---: | --- | --- | --- |"]
        for row in report.rows:
            status = {"met": "✔", "MISSED": "✘ missed"}.get(row.status, "")
            out.append(
                f"| {_md_cell(row.metric)} | {row.formatted_value()} | "
                f"{_md_cell(row.target)} | {status} | {_md_cell(row.note)} |"
            )
    out += [""] + [f"- {note}" for note in report.notes]
    if machine_note:
        out.append(f"- {machine_note}")
    return [*out, f"- {_measured(report)}"]


def read_json(path: str | Path) -> tuple[dict[str, Any], list[Report], bool]:
    """Machine, reports and quick flag written by :func:`write_json`."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return doc["machine"], [Report.from_json(r) for r in doc["benchmarks"]], doc["quick"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a results file written by --json ({e})") from e


def write_json(
    path: str | Path, machine: dict[str, Any], reports: Sequence[Report], quick: bool
) -> Path:
    """Everything measured, raw samples included, as one JSON document."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine, "quick": quick, "benchmarks": [r.to_json() for r in reports]}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


def between(text: str, start: str, end: str) -> tuple[str, str, str]:
    """``text`` cut at the markers: what precedes ``start``, what lies between, what
    follows ``end`` (the markers themselves dropped)."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"need one {start} ... {end} section to replace")
    head, rest = text.split(start, 1)
    body, tail = rest.split(end, 1)
    return head, body, tail


def replace_block(path: str | Path, start: str, end: str, body: str) -> Path:
    """Replace what lies between the markers ``start`` and ``end`` in ``path``."""
    path = Path(path)
    try:
        head, _, tail = between(path.read_text(encoding="utf-8"), start, end)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}", encoding="utf-8")
    return path


def update_readme(
    path: str | Path,
    machine: dict[str, Any],
    reports: Sequence[Report],
    quick: bool,
    *,
    partial: bool = False,
) -> Path:
    """Replace the results section of ``path`` (between the two markers) with these.

    ``partial``: the reports are some benchmarks only (``--only``); each replaces its
    own ``### N. title`` part of the table and the rest stays as it was. A part
    measured on another machine than the table's header names says so.
    """
    if not partial:
        return replace_block(path, README_START, README_END, markdown(machine, reports, quick))
    path = Path(path)
    head, body, tail = between(path.read_text(encoding="utf-8"), README_START, README_END)
    header = re.search(r"^- \*\*Machine:\*\* (.*)$", body, re.MULTILINE)
    note = "" if header and header[1] == describe(machine) else f"Machine: {describe(machine)}"
    for report in reports:
        heading = re.compile(rf"^### (\d+)\. {re.escape(report.title)}\n", re.MULTILINE)
        found = heading.search(body)
        if found is None:
            raise ValueError(
                f"{path} has no part '### N. {report.title}' to replace: "
                "record a full run (python -m benchmarks --readme) first"
            )
        following = re.compile(r"^### ", re.MULTILINE).search(body, found.end())
        stop = following.start() if following else len(body)
        new = "\n".join(section(int(found[1]), report, note))
        gap = "\n\n" if following else "\n"  # a blank line before the next part
        body = f"{body[: found.start()]}{new}{gap}{body[stop:]}"
    path.write_text(f"{head}{README_START}{body}{README_END}{tail}", encoding="utf-8")
    return path
