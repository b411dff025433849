"""The results of a class: one row per student, written as JSON, CSV and a summary.

Shared by the one-machine batch (:mod:`assessment.batch`) and the Slurm one
(:mod:`assessment.slurm`), so both write the same files.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

COLUMNS = (
    "student",
    "status",
    "verdict",
    "exit_code",
    "accuracy",
    "seconds",
    "warnings",
    "message",
    "submission",
    "sha256",
    "graded_at",
)


def students(folder: Path, entry: str = "train.py") -> list[tuple[str, Path]]:
    """``(name, path)`` of every submission in ``folder``, sorted by name."""
    out = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith((".", "_")):
            continue
        if p.is_file() and p.suffix == ".py":
            out.append((p.stem, p))
        elif p.is_dir():
            out.append((p.name, p))
    return out


def fingerprint(path: Path) -> str:
    """SHA-256 of a submission file, or of every file of a submission folder."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "warnings": " | ".join(r.get("warnings") or [])})
    return buf.getvalue()


def summary(rows: list[dict[str, Any]], target: str) -> str:
    """Counts of statuses and verdicts, in words."""
    by_status = Counter(r["status"] for r in rows)
    by_reason = Counter(r["verdict"] for r in rows)
    accs = [r["accuracy"] for r in rows if r["accuracy"] is not None]
    lines = [
        f"{len(rows)} submissions graded against {target}: "
        + ", ".join(f"{by_status[s]} {s}" for s in ("pass", "fail", "broken", "error")),
        "verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())),
    ]
    if accs:
        lines.append(
            f"measured accuracy: median {sorted(accs)[len(accs) // 2]:.2%}, best {max(accs):.2%}"
        )
    flagged = [
        r["student"] for r in rows if any(not w.startswith("target ") for w in r["warnings"] or [])
    ]
    if flagged:
        lines.append(f"with warnings (read their code): {', '.join(flagged)}")
    unsafe = [r["student"] for r in rows if r.get("unsafe")]
    if unsafe:
        lines.insert(0, "UNSAFE: graded without a sandbox; do not trust these verdicts")
    return "\n".join(lines) + "\n"


def row_of(name: str, path: Path, digest: str, target: str, report: Any) -> dict[str, Any]:
    """One student's row of the results table, from their grading report."""
    return {
        "student": name,
        "status": report.status,
        "verdict": report.reason,
        "exit_code": report.exit_code,
        "accuracy": report.accuracy,
        "seconds": report.elapsed_s,
        "warnings": report.warnings,
        "message": report.message,
        "submission": str(path),
        "sha256": digest,
        "target": target,
        "unsafe": report.unsafe,
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def save(out: Path, rows: dict[str, dict[str, Any]], target: str) -> None:
    """Rewrite results.json, results.csv and summary.txt from every row so far."""
    ordered = [rows[k] for k in sorted(rows)]
    atomic_write(
        out / "results.json", json.dumps({"target": target, "rows": ordered}, indent=2) + "\n"
    )
    atomic_write(out / "results.csv", _csv(ordered))
    atomic_write(out / "summary.txt", summary(ordered, target))
