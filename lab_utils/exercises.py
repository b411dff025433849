"""Exercises: the student writes the function, CI swaps in the reference solution.

In a notebook::

    @exercise("lab1.normal_equations")
    def normal_equations(X, y):
        # YOUR CODE HERE
        raise NotImplementedError

With ``LABS_SOLUTIONS=1`` (set by ``make test``) the decorator returns the reference
from ``labs/lab1_optimisation/lab1_solutions.py``; otherwise it returns the student's function,
and calling it before it is written raises :class:`ExerciseNotDone`.

A skipped exercise also breaks the cells after it (a result never computed is a
``NameError``; a stub's ``None`` an ``IndexError`` or ``TypeError``). In IPython those
errors get the same "not done" message under their traceback while an exercise is
pending, so the student sees the cause, not only the symptom.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import TypeVar

from lab_utils import paths

F = TypeVar("F", bound=Callable)

# Exercises whose stub raised and has not run since: key -> function name.
_pending: dict[str, str] = {}
# Errors a skipped exercise causes in the cells that use its result.
DOWNSTREAM_ERRORS = (NameError, IndexError, TypeError, AttributeError, ValueError, KeyError)


class ExerciseNotDone(NotImplementedError):
    """Raised when an exercise stub is called before the student filled it in."""


def how_to_continue(key: str, name: str) -> str:
    """What to do about the exercise ``key`` (function ``name``) that is not done."""
    return (
        f"Exercise '{key}' is not done yet: write `{name}` in its cell, run that cell "
        "again, then the cells after it. Stuck? Run `%env LABS_SOLUTIONS=1` in a cell, "
        "then re-run the exercise's cell: the reference solution replaces yours "
        "(restarting the kernel does not change the server's environment; "
        "`%env LABS_SOLUTIONS=0` and re-running switches back)."
    )


def downstream_hint(error: BaseException) -> str | None:
    """The "not done" message for an error a skipped exercise may have caused, or None:
    while an exercise is pending, or when a ``NameError`` names an exercise function
    whose cell was never run."""
    if not isinstance(error, DOWNSTREAM_ERRORS) or isinstance(error, ExerciseNotDone):
        return None
    if _pending:
        return "\n".join(how_to_continue(k, n) for k, n in _pending.items())
    name = getattr(error, "name", None)
    key = exercise_key_of(name) if isinstance(error, NameError) and name else None
    if key is None:
        return None
    return (
        f"`{name}` is an exercise whose cell has not been run yet: run it "
        "(after writing it), then this cell. " + how_to_continue(key, name)
    )


def solution_modules() -> list[str]:
    """The labs with reference solutions: every ``labs/labN_*/labN_solutions.py``
    (``lab1`` ... and any lab added later), so no list of labs goes stale."""
    return paths.labs_with("solutions")


def exercise_key_of(name: str) -> str | None:
    """``"<lab>.<name>"`` when ``name`` is a reference solution in some lab, else None.

    Only public functions defined in the lab's module, or re-exported by it from
    ``lab_utils`` under their own name (a reference a script runs is library code), count:
    a name it merely imports (``torch``, ``Mapping``) or a private helper is no exercise."""
    for lab in solution_modules():
        try:
            module = paths.lab_module(lab, "solutions")
        except ImportError:
            continue
        candidate = getattr(module, name, None)
        if (
            not name.startswith("_")
            and inspect.isfunction(candidate)
            and (
                candidate.__module__ == module.__name__
                or (candidate.__module__.startswith("lab_utils.") and candidate.__name__ == name)
            )
        ):
            return f"{lab}.{name}"
    return None


def _show_with_hint(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: the usual traceback, then the hint."""
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    hint = downstream_hint(value)
    if hint:
        print(f"\n⚠ This error may come from a skipped exercise. {hint}")


def _install_notebook_hint() -> None:
    """In IPython, show :func:`downstream_hint` under the errors a skipped exercise causes."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and not getattr(shell, "_labs_exercise_hint", False):
        shell.set_custom_exc(DOWNSTREAM_ERRORS, _show_with_hint)
        shell._labs_exercise_hint = True


def solutions_enabled() -> bool:
    """True when ``LABS_SOLUTIONS`` asks for the reference solutions."""
    return os.environ.get("LABS_SOLUTIONS", "").strip().lower() in {"1", "true", "yes"}


def reference(key: str) -> Callable:
    """The reference solution for ``key`` (``"<lab>.<name>"``)."""
    lab, _, name = key.partition(".")
    if not name:
        raise ValueError(f"exercise key {key!r} must look like 'lab1.name'")
    module = paths.lab_module(lab, "solutions")
    try:
        return getattr(module, name)
    except AttributeError:
        raise KeyError(f"no reference solution {name!r} in {module.__file__}") from None


def exercise(key: str) -> Callable[[F], F]:
    """Mark a notebook function as the exercise ``key``; see the module docstring."""

    def wrap(student: F) -> F:
        _install_notebook_hint()
        _pending.pop(key, None)  # a new definition: pending again only if it raises
        if solutions_enabled():
            return reference(key)  # type: ignore[return-value]

        @functools.wraps(student)
        def checked(*args, **kwargs):
            try:
                result = student(*args, **kwargs)
            except ExerciseNotDone:
                raise
            except NotImplementedError:
                _pending[key] = student.__name__
                raise ExerciseNotDone(how_to_continue(key, student.__name__)) from None
            _pending.pop(key, None)
            return result

        checked.exercise_key = key  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return wrap
