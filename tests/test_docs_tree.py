"""docs/ARCHITECTURE.md names every program of the labs and every module of the grader.

A script added under ``labs/*/scripts/`` (or any other ``.py`` under ``labs/``) must get
its line in the page's table of the labs' scripts, as ``lab/path.py``; a module of
``assessment/`` its line in the grader's table.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def lab_programs(labs: Path = ROOT / "labs") -> list[str]:
    """Every .py under labs/, as a path relative to labs/ (notebook checkpoints left out)."""
    return sorted(
        p.relative_to(labs).as_posix()
        for p in labs.rglob("*.py")
        if ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts
    )


def grader_modules(package: Path = ROOT / "assessment") -> list[str]:
    return sorted(
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def table_rows(text: str, heading: str) -> str:
    """The text of the section of ``text`` under the ``## heading``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/ARCHITECTURE.md has no section '## {heading}'"
    return match.group(1)


def unnamed(paths: list[str], section: str) -> list[str]:
    """The paths that no `code span` of ``section`` names (a span may hold several)."""
    spans = " ".join(re.findall(r"`([^`]+)`", section))
    return [p for p in paths if not re.search(rf"(?<![\w/]){re.escape(p)}(?![\w/])", spans)]


def test_every_lab_script_has_a_line() -> None:
    section = table_rows(DOC.read_text(encoding="utf-8"), "The labs' scripts")
    programs = lab_programs()
    assert any(p.startswith("lab2_data_parallel/scripts/") for p in programs)
    missing = unnamed(programs, section)
    assert not missing, f"docs/ARCHITECTURE.md, 'The labs' scripts', does not name {missing}"


def test_every_grader_module_has_a_line() -> None:
    section = table_rows(DOC.read_text(encoding="utf-8"), "The grader (`assessment/`)")
    missing = unnamed(grader_modules(), section)
    assert not missing, f"docs/ARCHITECTURE.md, 'The grader', does not name {missing}"


def test_a_script_the_page_does_not_name_is_caught(tmp_path: Path) -> None:
    section = table_rows(DOC.read_text(encoding="utf-8"), "The labs' scripts")
    (tmp_path / "lab9_new" / "scripts").mkdir(parents=True)
    (tmp_path / "lab9_new" / "scripts" / "new_script.py").write_text("")
    (tmp_path / "lab2_data_parallel" / "scripts").mkdir(parents=True)
    (tmp_path / "lab2_data_parallel" / "scripts" / "train_ddp.py").write_text("")
    assert unnamed(lab_programs(tmp_path), section) == ["lab9_new/scripts/new_script.py"]
    # a name inside a longer one does not count: ddp.py is not named by train_ddp.py
    assert unnamed(["lab2_data_parallel/scripts/ddp.py"], section)
