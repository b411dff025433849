"""Self-checks of Lab 3 (algorithms for large batches) and its science claims.

The exercise checks (:func:`check_warmup_factor`, :func:`check_trust_ratio`) raise
:class:`~lab_utils.checks.CheckFailed` with a hint. The science claims are built as
:class:`Claim` objects by the ``claim_*`` functions, so that ``science.py`` can print
a PASS/FAIL table and a notebook can :func:`verify` them; their thresholds are
fixed here, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lab_utils import optim
from lab_utils.checks import (
    Claim,
    close,
    fail,
    less,  # noqa: F401  (notebooks use one `checks` name for both)
    passed,
    that,
)

# Thresholds of the claims (test-accuracy points are percentage points).
NAIVE_MIN_BATCH_RATIO = 16  # "a naive large batch" means at least 16× the base batch
NAIVE_MIN_GAP = 2.0  # ... and it loses at least this much accuracy
SCALED_MAX_GAP = 1.0  # linear scaling + warm-up is within this of the baseline
GROWTH_MAX_GAP = 1.0  # growing the batch is within this of LR decay, with fewer updates
ACCUMULATION_TOL = 1e-6  # relative error of accumulated vs one-batch gradients


# --------------------------------------------------------------------------- exercises


def check_warmup_factor(fn: Callable[[int, int, float], float]) -> None:
    """Check the student's ``warmup_factor(step, warmup_steps, start_factor)``."""
    what = "warmup_factor"
    for warm, start in ((5, 0.0), (4, 0.25), (1, 0.5), (10, 1 / 8)):
        expected = optim.warmup(warm, start)
        for step in range(warm + 3):
            got = fn(step, warm, start)
            if not isinstance(got, int | float) or not math.isfinite(got):
                fail(what, f"returned {got!r} for step={step}", "return a Python float")
            if abs(got - expected(step)) > 1e-9:
                hint = (
                    "the factor of update `step` is start + (1 - start)·(step + 1)/warmup_steps "
                    "during the warm-up, then 1"
                )
                if step >= warm:
                    hint = "after the warm-up the factor stays at 1"
                fail(
                    what,
                    f"warmup_factor({step}, {warm}, {start:g}) = {got:.4g}, expected "
                    f"{expected(step):.4g}",
                    hint,
                )
    passed(what, "rises by equal steps and reaches 1 after warmup_steps updates")


def check_trust_ratio(fn: Callable[..., torch.Tensor]) -> None:
    """Check the student's ``lars_trust_ratio(w, g, trust_coefficient, weight_decay)``."""
    what = "lars_trust_ratio"
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])
    cases = [
        (
            "‖w‖=5, ‖g‖=1, η=0.01",
            (w, g, 0.01, 0.0),
            0.05,
            "η·‖w‖/‖g‖: use torch.linalg.vector_norm over all elements of the layer",
        ),
        (
            "with weight decay β=0.1",
            (w, g, 0.01, 0.1),
            0.01 * 5 / (1 + 0.1 * 5),
            "the denominator is ‖g‖ + β·‖w‖ (the norm of the decayed gradient's two parts)",
        ),
        (
            "a layer of zeros",
            (torch.zeros(2, 3), torch.ones(2, 3), 0.01, 0.0),
            1.0,
            "when ‖w‖ = 0 (e.g. a zero-initialised layer) LARS uses a ratio of 1, "
            "otherwise that layer would never move",
        ),
        (
            "a zero gradient",
            (w, torch.zeros(2), 0.01, 0.0),
            1.0,
            "when the denominator is 0, return 1 instead of dividing by zero",
        ),
    ]
    gen = torch.Generator().manual_seed(3)
    for shape in ((16, 8), (5, 3, 3, 3)):
        wr = torch.randn(shape, generator=gen)
        gr = torch.randn(shape, generator=gen) * 1e-2
        cases.append(
            (
                f"a random layer {shape}",
                (wr, gr, 0.001, 5e-4),
                float(optim.lars_trust_ratio(wr, gr, 0.001, 5e-4)),
                "the norms are over the whole tensor, not per row",
            )
        )
    for label, args, expected, hint in cases:
        got = fn(*args)
        got = float(got.detach()) if isinstance(got, torch.Tensor) else float(got)
        if not math.isfinite(got) or abs(got - expected) > 1e-5 * max(1.0, abs(expected)):
            fail(what, f"{label}: got {got:.6g}, expected {expected:.6g}", hint)
    passed(what, f"{len(cases)} cases, including zero-norm layers")


def same_update(actual: torch.nn.Module, expected: torch.nn.Module, *, what: str) -> float:
    """Check that two models hold the same weights (e.g. after one step of two
    optimisers that should agree)."""
    a = torch.cat([p.detach().flatten() for p in actual.parameters()])
    e = torch.cat([p.detach().flatten() for p in expected.parameters()])
    return close(
        a,
        e,
        what=what,
        rtol=1e-6,
        hint="the two optimisers should compute the same step; compare the trust ratios",
    )


# --------------------------------------------------------------------------- science claims


def _pts(acc: float) -> float:
    return 100.0 * acc


def _signed(points: float) -> str:
    """``+0.08`` or ``−0.69`` (a real minus sign, like the other numbers)."""
    return f"{points:+.2f}".replace("-", "−")


def claim_naive_gap(base_acc: float, naive_acc: float, batch_ratio: float) -> Claim:
    """A naive large batch (≥ 16× the base batch, same epochs, base LR) loses ≥ 2 points."""
    gap = _pts(base_acc) - _pts(naive_acc)
    return Claim(
        f"naive batch ×{batch_ratio:g} loses accuracy",
        f"{_pts(base_acc):.2f}% → {_pts(naive_acc):.2f}% ({_signed(-gap)} pts)",
        f"×≥{NAIVE_MIN_BATCH_RATIO}, loss ≥ {NAIVE_MIN_GAP:g} pts",
        batch_ratio >= NAIVE_MIN_BATCH_RATIO and gap >= NAIVE_MIN_GAP,
        gap - NAIVE_MIN_GAP,
        "pts",
    )


def claim_scaling_recovers(base_acc: float, scaled_acc: float, batch_ratio: float) -> Claim:
    """Linear scaling + warm-up comes within 1 point of the baseline."""
    gap = _pts(base_acc) - _pts(scaled_acc)
    return Claim(
        f"linear scaling + warm-up at ×{batch_ratio:g} recovers",
        f"{_pts(scaled_acc):.2f}% vs {_pts(base_acc):.2f}% ({_signed(-gap)} pts)",
        f"within {SCALED_MAX_GAP:g} pt",
        gap <= SCALED_MAX_GAP,
        SCALED_MAX_GAP - gap,
        "pts",
    )


def claim_adaptive_beats_sgd(
    sgd_acc: float, lars_acc: float, lamb_acc: float, batch_ratio: float
) -> Claim:
    """At the largest batch, LARS or LAMB beats SGD with the same epochs and schedule."""
    best_name, best = max((("LARS", lars_acc), ("LAMB", lamb_acc)), key=lambda t: t[1])
    return Claim(
        f"LARS/LAMB beat SGD at ×{batch_ratio:g}",
        f"SGD {_pts(sgd_acc):.2f}%, LARS {_pts(lars_acc):.2f}%, LAMB {_pts(lamb_acc):.2f}%",
        f"{best_name} > SGD",
        best > sgd_acc,
        _pts(best) - _pts(sgd_acc),
        "pts",
    )


def claim_growth_matches_decay(
    decay_acc: float, decay_updates: int, growth_acc: float, growth_updates: int
) -> Claim:
    """Growing the batch reaches LR decay's accuracy (within 1 point) in fewer updates."""
    gap = _pts(decay_acc) - _pts(growth_acc)
    return Claim(
        "growing the batch matches LR decay",
        f"{_pts(growth_acc):.2f}% in {growth_updates} updates vs "
        f"{_pts(decay_acc):.2f}% in {decay_updates} ({_signed(-gap)} pts)",
        f"within {GROWTH_MAX_GAP:g} pt, fewer updates",
        gap <= GROWTH_MAX_GAP and growth_updates < decay_updates,
        GROWTH_MAX_GAP - gap if growth_updates < decay_updates else -math.inf,
        "pts",
    )


def claim_accumulation_exact(relative_error: float, micro_batches: int) -> Claim:
    """Accumulating k micro-batches gives the gradient of one batch of k·b (no BatchNorm)."""
    return Claim(
        f"gradient accumulation = one large batch (k={micro_batches})",
        f"relative error {relative_error:.1e}",
        f"≤ {ACCUMULATION_TOL:.0e}",
        relative_error <= ACCUMULATION_TOL,
        math.log10(ACCUMULATION_TOL / max(relative_error, 1e-300)),
        "decades",
        exact=True,
    )


def verify(claim: Claim, hint: str = "", profile_name: str = "cpu") -> None:
    """Raise :class:`~lab_utils.checks.CheckFailed` unless ``claim`` held; print it. At
    ``quick`` a claim the tiny run cannot show is printed as "not asserted (quick)"."""
    if not claim.asserted(profile_name):
        print(claim.shown(profile_name))
        return
    that(
        claim.ok,
        what=claim.name,
        detail=f"{claim.measured}; needs {claim.threshold}; "
        f"margin {claim.margin:+.3g} {claim.unit}",
        hint=hint,
    )
