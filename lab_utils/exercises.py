"""Exercises: the student writes the function, CI swaps in the reference solution.

In a notebook::

    @exercise("lab1.normal_equations")
    def normal_equations(X, y):
        # YOUR CODE HERE
        raise NotImplementedError

With ``LABS_SOLUTIONS=1`` (set by ``make test``) the decorator returns the reference
from ``lab_utils/solutions/lab1.py``; otherwise it returns the student's function,
and calling it before it is written raises :class:`ExerciseNotDone`.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class ExerciseNotDone(NotImplementedError):
    """Raised when an exercise stub is called before the student filled it in."""


def solutions_enabled() -> bool:
    """True when ``LABS_SOLUTIONS`` asks for the reference solutions."""
    return os.environ.get("LABS_SOLUTIONS", "").strip().lower() in {"1", "true", "yes"}


def reference(key: str) -> Callable:
    """The reference solution for ``key`` (``"<lab>.<name>"``)."""
    lab, _, name = key.partition(".")
    if not name:
        raise ValueError(f"exercise key {key!r} must look like 'lab1.name'")
    module = importlib.import_module(f"lab_utils.solutions.{lab}")
    try:
        return getattr(module, name)
    except AttributeError:
        raise KeyError(f"no reference solution {name!r} in lab_utils/solutions/{lab}.py") from None


def exercise(key: str) -> Callable[[F], F]:
    """Mark a notebook function as the exercise ``key``; see the module docstring."""

    def wrap(student: F) -> F:
        if solutions_enabled():
            return reference(key)  # type: ignore[return-value]

        @functools.wraps(student)
        def checked(*args, **kwargs):
            try:
                return student(*args, **kwargs)
            except ExerciseNotDone:
                raise
            except NotImplementedError:
                raise ExerciseNotDone(
                    f"Exercise '{key}' is not done yet: write `{student.__name__}` in its cell, "
                    "run that cell again, then this one. (Stuck? Set LABS_SOLUTIONS=1 and "
                    "restart the kernel to use the reference solution.)"
                ) from None

        checked.exercise_key = key  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return wrap
