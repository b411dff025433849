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


LAB_MODULE = re.compile(r"lab\d+_\w+\.py")  # a lab's own module: labN_checks.py, ...


def lab_programs(labs: Path = ROOT / "labs") -> list[str]:
    """Every program under labs/, as a path relative to labs/ (notebook checkpoints left
    out): every .py but a lab's own modules beside its notebooks (``labN_*.py``, which
    the layout names)."""
    return sorted(
        p.relative_to(labs).as_posix()
        for p in labs.rglob("*.py")
        if ".ipynb_checkpoints" not in p.parts
        and "__pycache__" not in p.parts
        and not (p.parent.parent == labs and LAB_MODULE.fullmatch(p.name))
    )


def lab_modules(labs: Path = ROOT / "labs") -> list[str]:
    """A lab's own modules beside its notebooks (``labN_checks.py``, ``lab2_script_diff.py``)."""
    return sorted(p.name for p in labs.glob("lab*_*/*.py") if LAB_MODULE.fullmatch(p.name))


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


def test_every_module_of_a_lab_is_in_the_layout() -> None:
    """A lab's own modules are named in the layout: by the pattern every lab follows
    (``labN_checks.py``, ``labN_plots.py``, ``labN_solutions.py``,
    ``labN_settings.py``), else by name."""
    layout = DOC.read_text(encoding="utf-8").split("## Layout", 1)[1].split("\n## ", 1)[0]
    generic = {f"labN_{kind}.py" for kind in ("checks", "plots", "solutions", "settings")}
    assert generic <= set(re.findall(r"labN_\w+\.py", layout)), "the pattern is in the layout"
    missing = [
        m
        for m in lab_modules()
        if re.sub(r"^lab\d+_", "labN_", m) not in generic and m not in layout
    ]
    assert not missing, f"docs/ARCHITECTURE.md's layout does not name {missing}"


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
