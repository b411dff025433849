"""lab_utils.source: what a notebook shows of a script is the script's own code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lab2_script_diff as lab2
from lab_utils import source

SCRIPT = '''"""A small script."""

import functools


def helper(x):
    return x + 1


@functools.lru_cache
def cached(x):
    """Decorated."""
    return helper(x)


class Stage:
    def forward(self, x):
        return x

    def backward(self, g):
        doc = "```python"
        return g


if __name__ == "__main__":
    print(cached(1))
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "demo.py"
    path.write_text(SCRIPT)
    return path


def test_whole_file_is_shown(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert source.show_source(script) == SCRIPT
    out = capsys.readouterr().out
    assert out.startswith(f"# {script} (lines 1–{len(SCRIPT.splitlines())})\n")
    assert SCRIPT in out


def test_function_is_found_by_name_not_by_text(script: Path) -> None:
    shown = source.show_source(script, "helper")
    assert shown == "def helper(x):\n    return x + 1\n"
    ast.parse(shown)


def test_decorators_come_with_the_function(script: Path) -> None:
    shown = source.show_source(script, "cached")
    assert shown.startswith("@functools.lru_cache\ndef cached(x):")
    assert shown.rstrip().endswith("return helper(x)")


def test_class_and_method(script: Path) -> None:
    assert source.show_source(script, "Stage").count("def ") == 2
    method = source.show_source(script, "Stage.backward")
    assert method.lstrip().startswith("def backward") and "forward" not in method
    _, first, last = source.source_of(script, "Stage.backward")
    assert SCRIPT.splitlines()[first - 1 : last] == method.rstrip("\n").splitlines()


def test_missing_name_lists_the_ones_that_exist(script: Path) -> None:
    with pytest.raises(LookupError, match=r"no 'train'.*helper, cached, Stage"):
        source.show_source(script, "train")
    with pytest.raises(LookupError, match=r"no 'step' in Stage.*forward, backward"):
        source.show_source(script, "Stage.step")


def test_fence_outlasts_backticks_in_the_code() -> None:
    text = source.code_markdown('s = "```"\n', "t")
    assert text.splitlines()[2] == "````python" and text.splitlines()[-1] == "````"


def test_notebook_gets_markdown(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[object] = []
    monkeypatch.setattr(source, "_in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", shown.append)
    source.show_source(script, "helper")
    (markdown,) = shown
    assert "```python\ndef helper(x):" in markdown.data


def test_show_diff_renders_through_the_same_helper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = tmp_path / "a.py", tmp_path / "b.py"
    old.write_text("x = 1\n")
    new.write_text("x = 1\ny = 2  # [1]\n")
    steps = lab2.show_diff(old, new, {1: "add y"})
    out = capsys.readouterr().out
    assert sum(s.added for s in steps) >= 1 and "+ y = 2  # [1]" in out and "add y" in out


def test_load_script_calls_a_function(script: Path) -> None:
    module = source.load_script(script)
    assert module.helper(1) == 2


def test_a_module_is_shown_from_its_file(capsys: pytest.CaptureFixture[str]) -> None:
    shown = source.show_source(source, "load_script")
    assert shown.startswith("def load_script(") and "spec_from_file_location" in shown
    assert capsys.readouterr().out.startswith("# lab_utils.source · load_script (lines ")
