"""One name for one thing in the scripts a student reads and the library they call,
checked on their syntax trees: ``dist`` is always ``torch.distributed`` and the library's
helpers (``lab_utils.dist``) are always ``labdist``, and no conditional expression stands as
a statement (``f() if c else g()`` hides an ``if``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

SCRIPTS = sorted(
    [
        *REPO.glob("labs/*/scripts/*.py"),
        *REPO.glob("benchmarks/jobs/*.py"),
        *REPO.glob("assessment/solutions/*.py"),
    ]
)
CODE = sorted([*SCRIPTS, *REPO.glob("lab_utils/**/*.py"), *REPO.glob("assessment/*.py")])


def dist_names(tree: ast.Module) -> list[str]:
    """The imports that bind torch.distributed to a name other than ``dist``, or the
    library's ``dist`` module to a name other than ``labdist`` (``from . import dist``
    inside the library too: only ``lab_utils`` has a ``dist`` module)."""
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname not in (None, "dist"):
                    wrong.append(f"import torch.distributed as {a.asname}")
                if a.name == "lab_utils.dist" and a.asname != "labdist":
                    wrong.append(f"import lab_utils.dist as {a.asname}")
        elif isinstance(node, ast.ImportFrom) and (
            node.module == "lab_utils" or (node.level > 0 and node.module is None)
        ):
            for a in node.names:
                if a.name == "dist" and a.asname != "labdist":
                    source = "." * node.level + (node.module or "")
                    wrong.append(
                        f"from {source} import dist" + (f" as {a.asname}" if a.asname else "")
                    )
    return wrong


def statement_conditionals(tree: ast.Module) -> list[int]:
    """Lines where a conditional expression is used as a statement."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.IfExp)
    ]


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_dist_is_torch_distributed(path: Path):
    wrong = dist_names(ast.parse(path.read_text()))
    assert not wrong, f"{path.name}: {wrong}: `dist` is torch.distributed, the library's is labdist"


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_no_conditional_expression_as_a_statement(path: Path):
    lines = statement_conditionals(ast.parse(path.read_text()))
    assert not lines, f"{path.name}: lines {lines} use `a if c else b` as a statement"


def test_the_checks_catch_what_they_name():
    old = "from lab_utils import dist\nimport torch.distributed as tdist\nx() if c else None\n"
    tree = ast.parse(old)
    assert dist_names(tree) == ["from lab_utils import dist", "import torch.distributed as tdist"]
    assert statement_conditionals(tree) == [3]
    good = "import torch.distributed as dist\nfrom lab_utils import dist as labdist\ny = a if c else b\n"
    assert dist_names(ast.parse(good)) == [] and statement_conditionals(ast.parse(good)) == []
    # the library's own modules, as lab_utils/parallel.py, cli.py and train.py had them
    library = "from . import dist, models\nfrom . import dist as ldist\nfrom .. import dist\n"
    assert dist_names(ast.parse(library)) == [
        "from . import dist",
        "from . import dist as ldist",
        "from .. import dist",
    ]
    assert dist_names(ast.parse("from . import dist as labdist\nimport torch.distributed\n")) == []
