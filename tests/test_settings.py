"""lab_utils.settings: a lab's sizes by profile, read by notebooks, scripts and tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

from lab_utils.settings import By, Settings, option, options

S = Settings(d_model=By(quick=64, cpu=128, gpu=512), heads=4, sizes_kb=By([4], [4, 64], [64]))


def test_each_profile_gets_its_own_value_and_constants_stay():
    assert [S.of(p).d_model for p in ("quick", "cpu", "gpu")] == [64, 128, 512]
    assert S.of("gpu").heads == 4 and S.of("gpu")["heads"] == 4


def test_the_current_profile_is_the_default(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "cpu")
    assert S.of().d_model == 128 and S.of().profile == "cpu"


def test_a_scripts_command_line_from_the_same_values():
    assert S.args("d_model", "heads", profile="quick") == ["--d-model", "64", "--heads", "4"]
    assert S.args("sizes_kb", profile="cpu") == ["--sizes-kb", "4", "64"]
    assert option("bucket_cap_mb") == "--bucket-cap-mb"


def test_a_command_line_from_named_values():
    assert options(d_model=64, sizes_kb=[4, 16]) == ["--d-model", "64", "--sizes-kb", "4", "16"]
    assert options(rates=(None, 8)) == ["--rates", "None", "8"]
    assert options() == []
    with pytest.raises(TypeError, match="flag"):
        options(augment=False)
    # .args is options over the profile's values: one code path
    assert S.args("heads", "d_model", profile="gpu") == options(heads=4, d_model=512)


def test_mistakes_are_named():
    with pytest.raises(AttributeError, match="no setting 'width'.*d_model"):
        S.of("quick").width  # noqa: B018
    with pytest.raises(KeyError, match="no setting width"):
        S.args("width")
    with pytest.raises(ValueError, match="no profile 'fast'"):
        S.of("fast")
    with pytest.raises(TypeError, match="flag"):
        Settings(augment=True).args("augment", profile="quick")


# ------------------------------------------------------------- one place per lab
# the profile API itself and its tests
ALLOWED = {
    "lab_utils/profile.py",
    "lab_utils/settings.py",
    "tests/test_profile.py",
    "tests/test_checks_of_a_run.py",  # script_parser showing a profile's default
}


def picks_outside_settings(root: Path = REPO) -> list[str]:
    """Files that choose a size by profile (``.pick(`` or ``By(``) outside the places
    that hold them: a lab's ``labN_settings.py``, ``parallel.MODEL`` (Labs 4, 6, 7's model)."""
    files = [
        *root.glob("labs/**/*.py"),
        *root.glob("labs/**/*.ipynb"),
        *root.glob("lab_utils/**/*.py"),
        *root.glob("benchmarks/**/*.py"),
        *root.glob("tests/*.py"),
        *root.glob("assessment/**/*.py"),
    ]
    found = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        if ".ipynb_checkpoints" in rel or rel in ALLOWED or rel == "tests/test_settings.py":
            continue
        if re.fullmatch(r"labs/lab\d+_\w+/lab\d+_settings\.py", rel):
            continue
        text = f.read_text(encoding="utf-8")
        if rel == "lab_utils/parallel.py":
            text = text.split("MODEL = Settings(", 1)[0] + text.split("\n)\n", 1)[-1]
        if re.search(r"\.pick\(|\bBy\(", text):
            found.append(rel)
    return sorted(found)


def test_every_size_by_profile_lives_in_its_labs_settings():
    assert picks_outside_settings() == []


def test_a_pick_outside_the_settings_is_found(tmp_path):
    (tmp_path / "labs" / "lab9_x").mkdir(parents=True)
    (tmp_path / "labs" / "lab9_x" / "lab9_settings.py").write_text("S = By(quick=1, cpu=2, gpu=3)")
    (tmp_path / "labs" / "lab9_x" / "01_a.ipynb").write_text('"N = P.pick(quick=1, cpu=2, gpu=3)"')
    assert picks_outside_settings(tmp_path) == ["labs/lab9_x/01_a.ipynb"]


# ------------------------------------------- a notebook's parameters feed its runs
NOTEBOOKS = sorted(p for p in REPO.glob("labs/*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _python(source: str) -> ast.Module:
    """A code cell's Python (IPython's ``%magic`` and ``!shell`` lines blanked)."""
    lines = source.splitlines()
    return ast.parse("\n".join("" if s.lstrip().startswith(("%", "!")) else s for s in lines))


def _assigned(tree: ast.Module) -> dict[str, ast.expr]:
    """The names a cell's top-level statements assign, each with its value."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            many = isinstance(target, ast.Tuple)
            names = target.elts if many else [target]
            values = value.elts if many and isinstance(value, ast.Tuple) else [value] * len(names)
            for name, v in zip(names, values, strict=True):
                if isinstance(name, ast.Name):
                    out.setdefault(name.id, v)
    return out


def _a_settings_read(value: ast.expr) -> bool:
    """``X.of()`` / ``profile.current()``: the settings themselves, which the cell reads
    into named values (a later cell reading them would bypass those names)."""
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr in ("of", "current")
    )


def _parameters_cell(path: Path) -> tuple[list, int]:
    """A notebook's cells and the index of the one tagged ``parameters``."""
    cells = nbformat.read(path, as_version=4).cells
    return cells, next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))


def parameters_not_fed(path: Path) -> list[str]:
    """Why editing a name in the notebook's ``parameters`` cell would not change what it
    runs. papermill injects its values right after that cell, so (1) the cell builds no
    script options (``.args(``: they would keep the profile's values), (2) every name it
    sets is read by a later cell (else editing it changes nothing), (3) no later cell reads
    the settings again (``labN_settings.X``, ``parallel.MODEL``, or the ``S = X.of()`` the
    cell read) instead of the names."""
    cells, at = _parameters_cell(path)
    found = []
    if ".args(" in cells[at].source:
        found.append("the parameters cell builds options with .args(: build them after it")
    names = _assigned(_python(cells[at].source))
    settings_reads = {n for n, v in names.items() if _a_settings_read(v)}
    read_later: set[str] = set()
    for i, cell in enumerate(cells[at + 1 :], start=at + 1):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(_python(cell.source)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                read_later.add(node.id)
                if node.id in settings_reads - {"P"} or re.fullmatch(r"lab\d+_settings", node.id):
                    found.append(f"cell {i} reads {node.id} instead of the named values")
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "MODEL"
                and isinstance(node.value, ast.Name)
                and node.value.id == "parallel"
            ):
                found.append(f"cell {i} reads parallel.MODEL instead of the named values")
    unread = [n for n in names if n not in read_later and n not in settings_reads]
    if unread:
        found.append(f"no later cell reads {', '.join(unread)}")
    return list(dict.fromkeys(found))


def parameters_without_comment(path: Path) -> list[str]:
    """The parameters cell's assignments that say nothing of what they are: a student
    edits them there, so each has a comment on its line or the line above."""
    cells, at = _parameters_cell(path)
    lines = cells[at].source.splitlines()
    bare = []
    for node in _python(cells[at].source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            above = lines[node.lineno - 2].lstrip() if node.lineno > 1 else ""
            own = lines[node.lineno - 1 : node.end_lineno]
            if not above.startswith("#") and not any("#" in line for line in own):
                bare.append(lines[node.lineno - 1].strip())
    return bare


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_notebooks_parameters_feed_what_it_runs(path):
    assert parameters_not_fed(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_parameter_says_what_it_is(path):
    assert parameters_without_comment(path) == []


def test_parameters_that_do_not_feed_the_run_are_found(tmp_path):
    def notebook(*sources: str) -> Path:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
        nb.cells[0].metadata["tags"] = ["parameters"]
        path = tmp_path / "n.ipynb"
        nbformat.write(nb, path)
        return path

    good = "S = lab9_settings.X.of()\nD_MODEL, LAYERS = S.d_model, S.layers  # sizes"
    run = "launch.run(script, settings.options(d_model=D_MODEL, layers=LAYERS))"
    assert parameters_not_fed(notebook(good, run)) == []
    # 6.6 before its fix: options from the settings in the parameters cell, a name unread
    built = good + "\nMODEL = parallel.MODEL.args('d_model', 'layers')"
    assert parameters_not_fed(notebook(built, "print(D_MODEL)\nlaunch.run(s, MODEL)")) == [
        "the parameters cell builds options with .args(: build them after it",
        "no later cell reads LAYERS",
    ]
    # 2.1 before its fix: the launch reads the settings again
    again = "launch.run(s, lab9_settings.X.args('d_model', 'layers'))"
    assert parameters_not_fed(notebook(good, again)) == [
        "cell 1 reads lab9_settings instead of the named values",
        "no later cell reads D_MODEL, LAYERS",
    ]
    assert parameters_not_fed(
        notebook(good, run + "\nprint(S.steps, S.heads, parallel.MODEL)")
    ) == [
        "cell 1 reads parallel.MODEL instead of the named values",
        "cell 1 reads S instead of the named values",
    ]
    assert parameters_without_comment(notebook(good + "\nSEED = 0\n# the width\nW = 2", run)) == [
        "S = lab9_settings.X.of()",
        "SEED = 0",
    ]
