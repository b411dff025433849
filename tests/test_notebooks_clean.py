"""Every committed notebook is stored clean and follows the course's conventions.

nbval itself runs the notebooks (``pytest --nbval-lax labs``); these checks are
about what is committed.
"""

from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(
    p for p in (REPO / "labs").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
)


def test_there_are_notebooks():
    assert NOTEBOOKS, "labs/ holds no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO)))
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} have outputs; clear them with "
        f"`jupyter nbconvert --clear-output --inplace {path}`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO)))
def test_notebook_conventions(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: open with what the student will learn"
    text = first.source.lower()
    assert "quick" in text and "cpu" in text, f"{path.name}: say how long each profile takes"
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    shell = [
        c.source
        for c in nb.cells
        if c.cell_type == "code"
        and any(line.lstrip().startswith("!") for line in c.source.splitlines())
    ]
    assert not shell, f"{path.name}: `!cmd` never fails its cell; use lab_utils.launch"
