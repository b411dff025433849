"""Self-checks for exercises and science claims.

Each check prints ``✔ what`` when it holds and raises :class:`CheckFailed` with a
message that says what was expected, what was found and where to look when it does
not. Because they raise, a failing claim also fails the notebook under nbval.
Lab-specific checks live in ``lab_utils.checks.<lab>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class CheckFailed(AssertionError):
    """A self-check did not hold; the message explains why."""


@dataclass(frozen=True)
class Claim:
    """One science claim: what was measured, against which threshold, whether it held,
    and by how much (``margin`` in ``unit``: positive when it holds, the distance to
    the threshold; negative when it fails)."""

    name: str
    measured: str
    threshold: str
    ok: bool
    margin: float = float("nan")
    unit: str = ""
    exact: bool = False  # an identity (e.g. accumulation = one batch): asserted in every profile

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else "FAIL"

    def line(self) -> str:
        """``PASS name: measured (needs threshold; margin +x unit)``."""
        return (
            f"{self.verdict}  {self.name}: {self.measured} (needs {self.threshold}; "
            f"margin {self.margin:+.3g} {self.unit})".rstrip()
        )

    def asserted(self, profile_name: str) -> bool:
        """Whether a run of this profile can show the claim: exact claims always; the
        others not at ``quick``, whose tiny runs only show the code path."""
        return self.exact or profile_name != "quick"

    def result(self, profile_name: str) -> str:
        """``PASS``/``FAIL``, or "not asserted (quick)" where the run cannot show it."""
        return self.verdict if self.asserted(profile_name) else "not asserted (quick)"

    def shown(self, profile_name: str) -> str:
        """The claim's line, or (not asserted) its numbers with "not asserted (quick)"."""
        if self.asserted(profile_name):
            return self.line()
        return f"not asserted (quick)  {self.name}: {self.measured} (needs {self.threshold})"


def _as_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def passed(what: str, detail: str = "") -> None:
    """Print the green line of a check that held."""
    print(f"✔ {what}" + (f" ({detail})" if detail else ""))


def fail(what: str, detail: str, hint: str = "") -> None:
    """Raise :class:`CheckFailed` with a readable message."""
    msg = f"✘ {what}: {detail}"
    if hint:
        msg += f"\n  Hint: {hint}"
    raise CheckFailed(msg)


def relative_error(actual: Any, expected: Any) -> float:
    """‖actual − expected‖ / max(‖expected‖, tiny), over all elements."""
    a, e = _as_array(actual), _as_array(expected)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-300))


def close(
    actual: Any, expected: Any, *, what: str, rtol: float = 1e-5, atol: float = 0.0, hint: str = ""
) -> float:
    """Check that ``actual`` equals ``expected`` up to ``rtol`` (relative, as a whole)
    or ``atol`` (absolute, element-wise). Returns the relative error."""
    a, e = _as_array(actual), _as_array(expected)
    if a.shape != e.shape:
        fail(what, f"shape {a.shape} but expected {e.shape}", hint)
    if not np.all(np.isfinite(a)):
        fail(what, "contains NaN or inf", hint or "a step size that is too large diverges")
    err = relative_error(a, e)
    max_abs = float(np.max(np.abs(a - e))) if a.size else 0.0
    if err <= rtol or (atol > 0 and max_abs <= atol):
        passed(what, f"relative error {err:.1e}")
        return err
    fail(what, f"relative error {err:.2e} > {rtol:.0e} (largest difference {max_abs:.3g})", hint)
    return err


def that(condition: bool, *, what: str, detail: str = "", hint: str = "") -> None:
    """Check a boolean claim; ``detail`` shows the measured numbers either way."""
    if condition:
        passed(what, detail)
    else:
        fail(what, detail or "does not hold", hint)


def less(a: float, b: float, *, what: str, hint: str = "") -> None:
    """Check ``a < b`` and show both numbers."""
    that(
        bool(a < b),
        what=what,
        detail=f"{a:.4g} < {b:.4g}" if a < b else f"{a:.4g} ≥ {b:.4g}",
        hint=hint,
    )


# --------------------------------------------------------------------------- claims of a run
# What a student's run may assert (DESIGN.md §13, docs/ARCHITECTURE.md "Checks a run
# asserts"): a count, exact on any machine; a comparison inside one run, with the margin
# taken from that run's own spread; anything else about time is shown, never raised.


def count(actual: int, expected: int, *, what: str, hint: str = "") -> None:
    """An exact count (steps redone, collectives per block, bytes on the wire)."""
    that(
        int(actual) == int(expected),
        what=what,
        detail=f"{int(actual)}"
        if int(actual) == int(expected)
        else f"counted {int(actual)}, expected {int(expected)}",
        hint=hint,
    )


def spread(samples: Any) -> float:
    """The run's own noise: the median absolute deviation of repeated measurements,
    scaled to match a standard deviation (1.4826 × MAD), robust to one slow outlier."""
    a = _as_array(samples).ravel()
    if a.size < 2:
        return 0.0
    return float(1.4826 * np.median(np.abs(a - np.median(a))))


def within_run(
    measured: float,
    predicted: float,
    *,
    noise: float,
    what: str,
    k: float = 4.0,
    floor: float = 0.0,
    unit: str = "",
    hint: str = "",
) -> float:
    """A measurement agrees with what a model predicts from the same run's own per-operation
    times: ``|measured − predicted| ≤ k·noise + floor``, where ``noise`` comes from that
    run's spread (:func:`spread`). Returns the margin (positive when it holds)."""
    allowed = k * noise + floor
    margin = allowed - abs(measured - predicted)
    that(
        margin >= 0,
        what=what,
        detail=(
            f"measured {measured:.4g}{unit}, predicted {predicted:.4g}{unit} from this run's "
            f"own timings, allowed ±{allowed:.3g}{unit} (this run's spread)"
        ),
        hint=hint,
    )
    return margin


def shown(what: str, detail: str, why: str) -> None:
    """A timing that is too noisy to assert here: printed with the reason, never raised,
    so that a busy laptop cannot stop Run All."""
    print(f"ⓘ {what}: {detail} — shown, not asserted ({why})")
