"""The second wall: hashes of what the grader judges with, before and after a job.

Before the job the grader records a SHA-256 of every source file of the course
library and of the grader, of the target file, and of the test data (the dataset's
files and the grader's own copy of the test split). After the job it hashes them
again; any difference means the job reached something it must not, and the
submission is judged ``tampered`` without evaluating anything with altered code.
The evaluation then runs in a fresh interpreter that imports only these files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

CODE_PACKAGES = ("lab_utils", "assessment")


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            h.update(data)
    return h.hexdigest()


def code_files(repo: Path) -> list[Path]:
    """The files the grader's judgement depends on: every source and target file of
    ``lab_utils`` and ``assessment`` in ``repo``."""
    out: list[Path] = []
    for pkg in CODE_PACKAGES:
        for pattern in ("*.py", "*.toml"):
            out += (repo / pkg).rglob(pattern)
    return sorted(p for p in out if "__pycache__" not in p.parts)


def snapshot(files: Iterable[Path], folders: Iterable[Path] = ()) -> dict[str, str]:
    """``{path: sha256}`` of ``files``, plus which files each folder holds (a file
    added to a code folder, say a ``sitecustomize.py``, is a change too)."""
    digests: dict[str, str] = {}
    for path in files:
        try:
            digests[str(path)] = sha256(path)
        except OSError as e:
            digests[str(path)] = f"unreadable: {e.strerror}"
    for folder in folders:
        names = sorted(
            str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts
        )
        digests[f"{folder}/ (listing)"] = hashlib.sha256("\n".join(names).encode()).hexdigest()
    return digests


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The paths whose hash (or presence) differs."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
