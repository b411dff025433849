"""The check's table, as JSON (for tools) and markdown (for people), from one list of results.

Both are written from the same :class:`~benchmarks.gpu_check.harness.Result` objects;
``tests/test_gpu_check.py`` reads both back and checks they agree.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .harness import FAILED, PASSED, SKIPPED, Result

JSON_NAME, MARKDOWN_NAME = "gpu_check.json", "gpu_check.md"
MARK = {PASSED: "✔ passed", FAILED: "✘ failed", SKIPPED: "– skipped"}


def counts(results: Sequence[Result]) -> dict[str, int]:
    c = Counter(r.status for r in results)
    return {s: c.get(s, 0) for s in (PASSED, FAILED, SKIPPED)}


def summary_line(results: Sequence[Result]) -> str:
    c = counts(results)
    return f"{c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped ({len(results)} paths)"


def _number(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def numbers_text(numbers: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_number(v)}" for k, v in numbers.items())


def _cell(text: str) -> str:
    """Text that stays inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def to_json(info: dict[str, Any], results: Sequence[Result]) -> dict[str, Any]:
    return {"info": info, "counts": counts(results), "results": [asdict(r) for r in results]}


def markdown(info: dict[str, Any], results: Sequence[Result]) -> str:
    lines = ["# GPU check", ""]
    lines += [f"- **{k}:** {_cell(v)}" for k, v in info.items()]
    lines += ["", f"**{summary_line(results)}**", ""]
    lines += [
        "| path | status | s | backend | numbers | why / error |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for r in results:
        why = (
            r.reason
            if r.status != FAILED or not r.error
            else (r.reason or r.error.splitlines()[-1])
        )
        lines.append(
            f"| `{r.name}` | {MARK[r.status]} | {r.seconds:.1f} | {_cell(r.backend)} | "
            f"{_cell(numbers_text(r.numbers))} | {_cell(why)} |"
        )
    failed = [r for r in results if r.status == FAILED and r.error]
    if failed:
        lines += ["", "## Errors (last lines)", ""]
        for r in failed:
            lines += [f"### `{r.name}`", "", f"`{r.command}`", "", "```", r.error, "```", ""]
    lines += ["", "## What each path runs", ""]
    lines += [f"- `{r.name}` ({r.group}): {r.what}" for r in results]
    return "\n".join(lines).rstrip() + "\n"


def write(out: Path, info: dict[str, Any], results: Sequence[Result]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / JSON_NAME, out / MARKDOWN_NAME
    j.write_text(json.dumps(to_json(info, results), indent=1, default=str) + "\n")
    m.write_text(markdown(info, results))
    return j, m


def read_json(path: Path) -> tuple[dict[str, Any], list[Result]]:
    doc = json.loads(Path(path).read_text())
    return doc["info"], [Result(**r) for r in doc["results"]]


def read_markdown_rows(text: str) -> list[tuple[str, str]]:
    """``(path, status)`` of every row of the table in ``markdown``'s text."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows.append((cells[0].strip("`"), cells[1].split()[-1]))
    return rows
