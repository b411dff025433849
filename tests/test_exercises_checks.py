import sys

import numpy as np
import pytest

from lab_utils import checks
from lab_utils.exercises import ExerciseNotDone, downstream_hint, exercise, reference


def test_unfinished_exercise_says_what_to_do(monkeypatch):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)

    @exercise("lab1.anything")
    def todo(x):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="lab1.anything.*not done yet") as err:
        todo(1)
    assert "%env LABS_SOLUTIONS=1" in str(err.value)  # works from inside JupyterLab
    # the cells after it fail with the symptom; the hint names the cause
    hint = downstream_hint(NameError("name 'theta_ne' is not defined", name="theta_ne"))
    assert hint is not None and "lab1.anything" in hint
    assert downstream_hint(IndexError("too many indices")) is not None

    @exercise("lab1.anything")
    def done(x):
        return x

    assert done(1) == 1  # written: nothing pending, no hint for an unrelated error
    assert downstream_hint(IndexError("too many indices")) is None


def test_a_never_run_exercise_cell_is_named(monkeypatch):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)
    hint = downstream_hint(
        NameError("name 'normal_equations' is not defined", name="normal_equations")
    )
    assert hint is not None and "has not been run" in hint and "lab1.normal_equations" in hint
    assert downstream_hint(NameError("name 'xyz' is not defined", name="xyz")) is None


@pytest.mark.parametrize("key", ["lab4.training_state_bytes", "lab5.adam_server_update"])
def test_a_never_run_exercise_cell_is_named_in_every_lab(monkeypatch, key):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)
    name = key.partition(".")[2]
    hint = downstream_hint(NameError(f"name '{name}' is not defined", name=name))
    assert hint is not None and "has not been run" in hint and key in hint


def a_course_with(monkeypatch, tmp_path, lab: str, solutions: str) -> None:
    """Stand in a course checkout whose only lab is ``lab`` with these solutions (its
    folder ``labs/<lab>_probe/``, found as the real labs are: from the working directory)."""
    folder = tmp_path / "labs" / f"{lab}_probe"
    folder.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    (folder / f"{lab}_solutions.py").write_text(solutions)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lab_module adds the lab's folder
    monkeypatch.delitem(sys.modules, f"{lab}_solutions", raising=False)


def test_a_lab_added_later_is_searched_too(monkeypatch, tmp_path):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)
    a_course_with(
        monkeypatch,
        tmp_path,
        "lab99",
        "def pipeline_bubble(stages, micro_batches):\n    return 0\n",
    )
    hint = downstream_hint(
        NameError("name 'pipeline_bubble' is not defined", name="pipeline_bubble")
    )
    assert hint is not None and "lab99.pipeline_bubble" in hint


@pytest.mark.parametrize("name", ["Mapping", "torch", "_matrix"])
def test_names_a_solution_module_imports_or_hides_are_no_exercise(monkeypatch, name):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)
    assert downstream_hint(NameError(f"name '{name}' is not defined", name=name)) is None


def test_student_solution_is_used_without_the_switch(monkeypatch):
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)

    @exercise("lab1.anything")
    def mine(x):
        return x + 1

    assert mine(1) == 2


def test_reference_replaces_the_stub_with_the_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("LABS_SOLUTIONS", "1")
    a_course_with(monkeypatch, tmp_path, "labx", "def double(x):\n    return 2 * x\n")

    @exercise("labx.double")
    def double(x):
        raise NotImplementedError

    assert double(4) == 8
    with pytest.raises(KeyError, match="no reference solution"):
        reference("labx.missing")
    with pytest.raises(ValueError):
        reference("nodot")


def test_close_passes_and_fails_with_a_message(capsys):
    err = checks.close(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]), what="β", rtol=1e-6)
    assert err < 1e-6
    assert "✔ β" in capsys.readouterr().out
    with pytest.raises(checks.CheckFailed, match="relative error .* > 1e-06") as info:
        checks.close([1.0, 2.5], [1.0, 2.0], what="β", rtol=1e-6, hint="check the sign")
    assert "check the sign" in str(info.value)
    with pytest.raises(checks.CheckFailed, match="shape"):
        checks.close([1.0], [1.0, 2.0], what="β")
    with pytest.raises(checks.CheckFailed, match="NaN"):
        checks.close([np.nan], [1.0], what="β")


def test_that_and_less():
    checks.that(True, what="holds")
    checks.less(1.0, 2.0, what="smaller")
    with pytest.raises(checks.CheckFailed, match="does not hold"):
        checks.that(False, what="claim")
    with pytest.raises(checks.CheckFailed, match="3 ≥ 2"):
        checks.less(3.0, 2.0, what="smaller")
