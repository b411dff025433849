"""The results as a text table (terminal), as Markdown (README) and as JSON."""

from __future__ import annotations

import json
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
    """When one benchmark ran and how busy the machine was meanwhile."""
    load = report.details.get("load_average") or {}
    parts = []
    if report.details.get("date"):
        parts.append(f"measured {report.details['date']}")
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
        out += ["", f"### {i}. {r.title}", ""]
        if _status(r):
            out += [f"*{_md_cell(_status(r))}*", ""]
        if r.rows:
            out += ["| measurement | value | target | | note |", "| --- | ---: | --- | --- | --- |"]
            for row in r.rows:
                status = {"met": "✔", "MISSED": "✘ missed"}.get(row.status, "")
                out.append(
                    f"| {_md_cell(row.metric)} | {row.formatted_value()} | "
                    f"{_md_cell(row.target)} | {status} | {_md_cell(row.note)} |"
                )
        out += [""] + [f"- {note}" for note in r.notes] + [f"- {_measured(r)}"]
    return "\n".join(out)


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


def update_readme(
    path: str | Path, machine: dict[str, Any], reports: Sequence[Report], quick: bool
) -> Path:
    """Replace the results section of ``path`` (between the two markers) with these."""
    path = Path(path)
    current = path.read_text(encoding="utf-8")
    if README_START not in current or README_END not in current:
        raise ValueError(f"{path} has no {README_START} ... {README_END} section to replace")
    head, rest = current.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    body = markdown(machine, reports, quick)
    path.write_text(f"{head}{README_START}\n{body}\n{README_END}{tail}", encoding="utf-8")
    return path
