"""Self-checks for Lab 1: the exercises, and the science claims the notebooks make.

``check_<exercise>(fn)`` runs the student's function on hidden cases and compares it
with :mod:`lab_utils.regression`; when it is wrong it tries to say *how* (a sign error,
a forgotten bias, a missing factor of 2, ...). The science checks take numbers the
notebook measured and raise :class:`~lab_utils.checks.CheckFailed` when the claim
does not hold, so a broken experiment fails the notebook under nbval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from lab_utils import regression
from lab_utils.checks import (
    close,
    fail,
    less,  # noqa: F401  (notebooks use one `checks` name for both)
    relative_error,
    that,
)


def _case(n: int = 40, d: int = 3, noise: float = 0.1, seed: int = 1):
    """A small hidden regression problem with an offset, so the bias matters."""
    rng = np.random.default_rng(seed)
    X = rng.normal(1.0, 1.0, size=(n, d))
    w, b = rng.normal(size=d), 2.5
    y = X @ w + b + noise * rng.normal(size=n)
    return X, y


def _array(value, what: str) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if value is None:
        fail(what, "the function returned None", "did you forget the `return`?")
    return np.asarray(value, dtype=np.float64)


def _near(a: np.ndarray, b: np.ndarray, rtol: float = 1e-6) -> bool:
    return a.shape == b.shape and relative_error(a, b) <= rtol


# --------------------------------------------------------------------- exercises
def check_normal_equations(fn: Callable) -> None:
    """``fn(X, y) -> θ = (w, b)`` solves the normal equations."""
    what = "normal_equations"
    X, y = _case()
    expected = regression.lstsq(X, y)
    got = _array(fn(X.copy(), y.copy()), what)
    if got.shape == (X.shape[1],):
        no_bias = np.linalg.lstsq(X, y, rcond=None)[0]
        hint = (
            "you fitted a line through the origin: append a column of ones to X "
            "(np.hstack or np.c_) so the last entry of θ is the bias b"
        )
        fail(
            what,
            f"returned {got.size} numbers but θ = (w₁..w_d, b) has {X.shape[1] + 1}",
            hint if _near(got, no_bias, 1e-4) else "return the weights *and* the bias",
        )
    if got.shape == (X.shape[1] + 1, 1):
        fail(what, f"shape {got.shape}", "return a flat vector: use y of shape (n,), or .ravel()")
    if _near(got, np.roll(expected, 1), 1e-6):
        fail(what, "the bias is the first entry", "put the column of ones *last*: [X, 1]")
    close(
        got,
        expected,
        rtol=1e-6,
        what=what + " on a 3-feature problem",
        hint="solve (AᵀA) θ = Aᵀy with A = [X, 1]; np.linalg.solve(A.T @ A, A.T @ y)",
    )
    x1 = X[:, 0]
    close(
        _array(fn(x1.copy(), y.copy()), what),
        regression.lstsq(x1, y),
        rtol=1e-6,
        what=what + " with a 1-D x",
        hint="a 1-D x is one feature: reshape it to (n, 1) first (x.reshape(-1, 1))",
    )


def check_mse_gradient(fn: Callable) -> None:
    """``fn(X, y, θ) -> ∇L(θ)`` for the mean squared error."""
    what = "mse_gradient"
    X, y = _case(seed=2)
    theta = np.array([0.3, -0.2, 0.5, 0.1])
    expected = regression.mse_gradient(X, y, theta)
    got = _array(fn(X.copy(), y.copy(), theta.copy()), what)
    n = len(y)
    if got.shape == (X.shape[1],):
        fail(
            what,
            f"returned {got.size} numbers, expected {theta.size}",
            "the bias has a gradient too: ∂L/∂b = (2/n) Σ rᵢ, appended last",
        )
    diagnoses = [
        (-expected, "the sign is flipped: with r = Xw + b − y the gradient is +(2/n) Aᵀr"),
        (expected / 2, "a factor of 2 is missing: d(r²)/dr = 2r"),
        (expected * n, "you summed over samples: the loss is a *mean*, divide by n"),
        (-expected / 2, "both the sign and the factor 2 are off"),
    ]
    for wrong, hint in diagnoses:
        if _near(got, wrong):
            fail(what, "the gradient is off by a constant factor", hint)
    if (
        got.shape == expected.shape
        and _near(got[:-1], expected[:-1])
        and not _near(got[-1:], expected[-1:])
    ):
        fail(
            what,
            "the weight gradient is right but the bias entry is wrong",
            "∂L/∂b = (2/n) Σ (ŷᵢ − yᵢ): the same residuals, multiplied by 1",
        )
    close(got, expected, rtol=1e-6, what=what, hint="∇L = (2/n) [Xᵀr, Σr] with r = X w + b − y")


def check_gradient_descent(fn: Callable) -> None:
    """``fn(X, y, θ₀, lr, steps) -> path`` of shape ``(steps + 1, d + 1)``."""
    what = "gradient_descent"
    X, y = _case(seed=3)
    theta0 = np.zeros(X.shape[1] + 1)
    lr, steps = 0.02, 6
    expected = regression.gd_path(X, y, theta0, lr, steps)
    got = _array(fn(X.copy(), y.copy(), theta0.copy(), lr, steps), what)
    if got.shape == (steps, theta0.size):
        fail(what, f"shape {got.shape}: {steps} rows", "include the starting point θ₀ as row 0")
    if got.shape != expected.shape:
        fail(
            what,
            f"shape {got.shape} but expected {expected.shape}",
            "return np.array(path) where path holds θ₀ and the θ after every step",
        )
    if np.allclose(got, got[-1]):
        fail(
            what,
            "every row is the same θ",
            "you appended the same array that you then changed in place: append theta.copy() "
            "or write theta = theta - lr * grad",
        )
    if not np.allclose(got[0], theta0):
        fail(what, "row 0 is not θ₀", "the path starts at the starting point")
    losses = regression.path_losses(X, y, got)
    if np.all(np.isfinite(losses)) and losses[-1] > losses[0]:
        fail(
            what,
            f"the loss went up from {losses[0]:.3g} to {losses[-1]:.3g}",
            "step *against* the gradient: θ ← θ − lr ∇L(θ) (or check mse_gradient's sign)",
        )
    close(
        got,
        expected,
        rtol=1e-6,
        what=what,
        hint="θ ← θ − lr · mse_gradient(X, y, θ), `steps` times; is mse_gradient right?",
    )


def check_neuron_gradient(fn: Callable) -> None:
    """``fn(x, y, w, b) -> (∂L/∂w, ∂L/∂b)`` for L = mean((tanh(w x + b) − y)²)."""
    import torch

    what = "neuron_gradient"
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=30), rng.uniform(-0.9, 0.9, size=30)
    w, b = 0.8, -0.3
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    loss = ((torch.tanh(wt * torch.from_numpy(x) + bt) - torch.from_numpy(y)) ** 2).mean()
    loss.backward()
    expected = np.array([wt.grad.item(), bt.grad.item()])
    result = fn(x.copy(), y.copy(), w, b)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        fail(what, f"returned {type(result).__name__}", "return a pair (dL_dw, dL_db)")
    got = np.array([float(_array(r, what)) for r in result])
    a = np.tanh(w * x + b)
    no_tanh_prime = np.array([np.mean(2 * (a - y) * x), np.mean(2 * (a - y))])
    if _near(got, no_tanh_prime):
        fail(
            what,
            "the tanh derivative is missing",
            "chain rule: multiply by tanh'(z) = 1 − tanh(z)²",
        )
    for wrong, hint in (
        (-expected, "the sign is flipped: ∂L/∂a = 2(a − y)/n, not 2(y − a)/n"),
        (expected / 2, "a factor of 2 is missing: d(r²)/dr = 2r"),
        (expected * len(x), "the loss is a mean: divide by n"),
    ):
        if _near(got, wrong):
            fail(what, "off by a constant factor", hint)
    close(
        got,
        expected,
        rtol=1e-6,
        what=what + " matches autograd",
        hint="∂L/∂w = Σ 2(a − y)/n · (1 − a²) · x and ∂L/∂b the same without the x",
    )


def check_minibatch_sgd(fn: Callable) -> None:
    """``fn(X, y, θ₀, lr, batch_size, epochs, seed) -> path`` (one row per update + start)."""
    _minibatch_full_batch_is_gd(fn)
    _minibatch_keeps_the_last_batch(fn)
    _minibatch_converges_without_noise(fn)
    _minibatch_takes_a_schedule(fn)


_MINIBATCH = "minibatch_sgd"
# Noise-free data: every per-sample gradient vanishes at the optimum, so SGD with a
# constant step converges to it exactly.
_NOISE_FREE_THETA = np.array([1.5, -2.0, 0.7])


def _noise_free_case() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(6)
    X = rng.normal(size=(64, 2))
    return X, X @ _NOISE_FREE_THETA[:2] + _NOISE_FREE_THETA[2]


def _minibatch_full_batch_is_gd(fn: Callable) -> None:
    what = _MINIBATCH
    X, y = _case(n=10, d=2, seed=5)
    theta0 = np.zeros(3)
    got = _array(fn(X.copy(), y.copy(), theta0.copy(), 0.02, len(y), 3, seed=0), what)
    expected = regression.gd_path(X, y, theta0, 0.02, 3)
    if got.shape != expected.shape:
        fail(
            what,
            f"with batch_size = n and 3 epochs: shape {got.shape}, expected {expected.shape}",
            "one update per batch per epoch, and row 0 is θ₀",
        )
    close(
        got,
        expected,
        rtol=1e-6,
        what=what + " with batch_size = n is gradient descent",
        hint="each update is θ ← θ − lr · mse_gradient(X[idx], y[idx], θ) on the batch's rows",
    )


def _minibatch_keeps_the_last_batch(fn: Callable) -> None:
    """ceil(n/B) updates per epoch, and the same path for the same seed."""
    what = _MINIBATCH
    X, y = _case(n=10, d=2, seed=5)
    n, B, epochs = len(y), 3, 2
    got = _array(fn(X.copy(), y.copy(), np.zeros(3), 0.02, B, epochs, seed=0), what)
    want_rows = epochs * regression.updates_per_epoch(n, B) + 1
    if got.shape[0] == epochs * (n // B) + 1:
        fail(
            what,
            f"{got.shape[0]} rows for n={n}, B={B}, {epochs} epochs; expected {want_rows}",
            "the last, smaller batch was dropped: range(0, n, batch_size) keeps it",
        )
    that(
        got.shape == (want_rows, 3),
        what=what + " makes ceil(n/B) updates per epoch",
        detail=f"shape {got.shape}, expected {(want_rows, 3)}",
        hint="return θ₀ plus one row per update, as np.array(path)",
    )
    again = _array(fn(X.copy(), y.copy(), np.zeros(3), 0.02, B, epochs, seed=0), what)
    same = bool(np.array_equal(got, again))
    that(
        same,
        what=what + " is reproducible for a given seed",
        detail="" if same else "two runs with seed=0 differ",
        hint="draw the shuffle from np.random.default_rng(seed), not the global RNG",
    )


def _minibatch_converges_without_noise(fn: Callable) -> None:
    X, y = _noise_free_case()
    path = _array(fn(X, y, np.zeros(3), 0.05, 4, 40, seed=1), _MINIBATCH)
    close(
        path[-1],
        _NOISE_FREE_THETA,
        rtol=1e-3,
        what=_MINIBATCH + " converges on noise-free data",
        hint="shuffle once per epoch with rng.permutation(n) and visit every sample",
    )


def _minibatch_takes_a_schedule(fn: Callable) -> None:
    def first_step_only(step: int) -> float:
        return 0.05 if step == 0 else 0.0

    X, y = _noise_free_case()
    path = _array(fn(X, y, np.zeros(3), first_step_only, 8, 1, seed=0), _MINIBATCH)
    moved_once = bool(np.allclose(path[1:], path[1]) and not np.allclose(path[1], 0.0))
    that(
        moved_once,
        what=_MINIBATCH + " accepts a schedule lr(step)",
        detail=""
        if moved_once
        else "with lr(0)=0.05 and lr(t)=0 afterwards θ should move once, then stay",
        hint="if callable(lr): use lr(step) with a step counter that runs across epochs",
    )


def check_decayed_lr(fn: Callable) -> None:
    """``fn(step, lr0, decay_steps)`` is inverse-time decay lr0 / (1 + step/decay_steps)."""
    what = "decayed_lr"
    steps = np.array([0, 50, 100, 300, 10_000])
    got = np.array([float(fn(int(s), 0.2, 100)) for s in steps])
    expected = 0.2 / (1 + steps / 100)
    if np.isclose(got[2], 0.1) and got[3] < 0.9 * expected[3]:
        fail(
            what,
            "it halves every decay_steps (exponential decay)",
            "inverse-time decay falls like 1/step: lr0 / (1 + step / decay_steps)",
        )
    that(np.isclose(got[0], 0.2), what=what + " starts at lr0", detail=f"lr(0) = {got[0]:.4g}")
    close(
        got,
        expected,
        rtol=1e-9,
        what=what,
        hint="lr0 / (1 + step / decay_steps): half of lr0 after decay_steps steps",
    )


def check_loglog_slope(fn: Callable) -> None:
    """``fn(x, y)`` returns the least-squares slope of log y against log x."""
    what = "loglog_slope"
    x = np.array([8, 16, 32, 64, 128, 256], dtype=float)
    exact = 50 * x**-1.0
    got = float(fn(x, exact))
    if np.isclose(got, np.polyfit(x, exact, 1)[0]):
        fail(what, "this is the slope of y against x", "take np.log of both x and y first")
    close(got, -1.0, rtol=1e-6, what=what + " of y = 50/x is −1")
    rng = np.random.default_rng(7)
    noisy = 3 * x**-0.5 * np.exp(0.1 * rng.normal(size=x.size))
    close(
        float(fn(x, noisy)),
        regression.loglog_slope(x, noisy),
        rtol=1e-6,
        what=what + " on noisy data is the least-squares slope",
        hint="fit log y = a · log x + c by least squares (your normal_equations does it)",
    )


# --------------------------------------------------------------------- science claims
def solutions_agree(solutions: Mapping[str, Sequence[float]], rtol: float = 1e-4) -> None:
    """Every solution in ``solutions`` agrees with the first within ``rtol`` (relative)."""
    names = list(solutions)
    if len(names) < 2:
        raise ValueError("solutions_agree needs two or more named solutions")
    reference = np.asarray(solutions[names[0]], dtype=np.float64)
    for name in names[1:]:
        close(
            solutions[name],
            reference,
            rtol=rtol,
            what=f"{name} agrees with {names[0]}",
            hint="gradient descent may need more steps, or a learning rate nearer 1/λ_max",
        )


def gradients_match(hand: Sequence[float], autograd: Sequence[float], what: str) -> None:
    """The hand-derived gradient equals autograd's (relative error ≤ 1e-6)."""
    close(
        hand,
        autograd,
        rtol=1e-6,
        what=what,
        hint="re-derive with the chain rule, one node of the graph at a time",
    )


def variance_falls_like_inverse_batch(
    batch_sizes: Sequence[int],
    variances: Sequence[float],
    slope_range: tuple[float, float] = (-1.25, -0.75),
) -> float:
    """Mini-batch gradient variance decreases with B, with a log-log slope near −1.

    Returns the fitted slope."""
    b = np.asarray(batch_sizes, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    if b.shape != v.shape or b.size < 3:
        raise ValueError("need three or more batch sizes and one variance for each")
    order = np.argsort(b)
    b, v = b[order], v[order]
    that(
        bool(np.all(np.diff(v) < 0)),
        what="gradient variance decreases with batch size",
        detail=" > ".join(f"{x:.3g}" for x in v),
        hint="estimate each variance from more draws of mini-batches",
    )
    slope = regression.loglog_slope(b, v)
    lo, hi = slope_range
    that(
        lo <= slope <= hi,
        what="variance falls like 1/B",
        detail=f"log-log slope {slope:.2f}, expected within [{lo}, {hi}]",
        hint="keep B well below n: sampling without replacement adds a factor (n − B)/(n − 1)",
    )
    return slope


def learning_rate_threshold(
    lam_max: float,
    lr_below: float,
    losses_below: Sequence[float],
    lr_above: float,
    losses_above: Sequence[float],
) -> None:
    """GD with lr < 2/λ_max converges (loss falls and settles) and lr > 2/λ_max diverges."""
    limit = 2.0 / lam_max
    that(
        lr_below < limit < lr_above,
        what="the two learning rates straddle 2/λ_max",
        detail=f"{lr_below:.4g} < {limit:.4g} < {lr_above:.4g}",
        hint="pick one learning rate below and one above 2/λ_max",
    )
    below = np.asarray(losses_below, dtype=np.float64)
    above = np.asarray(losses_above, dtype=np.float64)
    settled = (
        np.isfinite(below[-1])
        and below[-1] < below[0]
        and abs(below[-1] - below[-2]) <= 1e-3 * max(abs(below[-1]), 1e-12)
    )
    that(
        bool(settled),
        what=f"lr = {lr_below:.4g} < 2/λ_max converges",
        detail=f"loss {below[0]:.4g} → {below[-1]:.4g}",
        hint="run more steps, or check the gradient",
    )
    diverged = (not np.isfinite(above[-1])) or above[-1] > 10 * above[0]
    that(
        bool(diverged),
        what=f"lr = {lr_above:.4g} > 2/λ_max diverges",
        detail=f"loss {above[0]:.4g} → {above[-1]:.4g}",
        hint="run more steps: just above the limit the oscillation grows slowly",
    )


def check_explorer_ran(explorer) -> None:
    """An ipywidgets ``interactive`` explorer ran its callback without an error.

    ``interactive`` prints a callback's exception below the widget instead of raising,
    so a headless run would not notice it; its ``result`` is set only on success.
    """
    result = getattr(explorer, "result", None)
    that(
        result is not None,
        what="the explorer drew its figure",
        detail="" if result is not None else "its callback did not return",
        hint="the callback raised: read the error printed below the widget",
    )
