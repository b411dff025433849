"""Linear regression as an optimisation problem: the numerics behind Lab 1.

The model is ``ŷ = X w + b`` and the loss the mean squared error
``L(θ) = mean((X w + b − y)²)`` with parameters ``θ = (w₁, …, w_d, b)``: the bias is
always the *last* entry of ``θ``. The notebooks write the key pieces (the normal
equations, the gradient, the descent loop) themselves; this module is the tested
version the tests and later labs reuse, plus the helpers that are plumbing rather
than the lesson (loss grids for contour plots, losses along a path, log-log slopes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Schedule = Callable[[int], float]


def as_matrix(X: np.ndarray) -> np.ndarray:
    """``X`` as a float64 ``(n, d)`` matrix; a 1-D array is one feature."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim == 1:
        return X[:, None]
    if X.ndim != 2:
        raise ValueError(f"X must be 1-D or 2-D (n samples × d features), got shape {X.shape}")
    return X


def _check_xy(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    X = as_matrix(X)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if len(y) != len(X):
        raise ValueError(f"X has {len(X)} rows but y has {len(y)} entries")
    return X, y


def _check_theta(theta: np.ndarray, d: int) -> np.ndarray:
    theta = np.asarray(theta, dtype=np.float64).reshape(-1)
    if theta.shape != (d + 1,):
        raise ValueError(f"θ must hold {d} weights and a bias ({d + 1} numbers), got {theta.shape}")
    return theta


def line_data(
    n: int,
    w: float = 1.5,
    b: float = -2.0,
    noise: float = 0.5,
    x_range: tuple[float, float] = (0.0, 4.0),
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """One-feature data ``y = w·x + b + noise·ε`` with ``x`` uniform on ``x_range``.

    ``x`` is deliberately not centred on 0: then ``w`` and ``b`` trade off against each
    other and the loss surface is a long diagonal valley, which is what makes plain
    gradient descent interesting to watch.
    """
    if n < 2:
        raise ValueError(f"need at least 2 samples, got n={n}")
    rng = np.random.default_rng(seed)
    x = rng.uniform(*x_range, size=n)
    return x, w * x + b + noise * rng.normal(size=n)


def add_bias(X: np.ndarray) -> np.ndarray:
    """The design matrix ``[X, 1]``: a column of ones carries the bias."""
    X = as_matrix(X)
    return np.hstack([X, np.ones((len(X), 1))])


def predict(X: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``X w + b`` for ``θ = (w, b)``."""
    X = as_matrix(X)
    theta = _check_theta(theta, X.shape[1])
    return X @ theta[:-1] + theta[-1]


def mse(X: np.ndarray, y: np.ndarray, theta: np.ndarray) -> float:
    """Mean squared error of ``θ`` on ``(X, y)``."""
    X, y = _check_xy(X, y)
    return float(np.mean((predict(X, theta) - y) ** 2))


def mse_gradient(X: np.ndarray, y: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """∇L(θ) = (2/n) [X, 1]ᵀ (X w + b − y)."""
    X, y = _check_xy(X, y)
    residual = predict(X, theta) - y
    return 2.0 / len(y) * (add_bias(X).T @ residual)


def normal_equations(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """θ solving (AᵀA) θ = Aᵀy with A = [X, 1]. Squares the condition number."""
    X, y = _check_xy(X, y)
    A = add_bias(X)
    return np.linalg.solve(A.T @ A, A.T @ y)


def lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """θ minimising ‖Aθ − y‖ by an orthogonal factorisation (numpy's SVD-based lstsq)."""
    X, y = _check_xy(X, y)
    return np.linalg.lstsq(add_bias(X), y, rcond=None)[0]


def hessian(X: np.ndarray) -> np.ndarray:
    """The (constant) Hessian of the MSE: (2/n) AᵀA with A = [X, 1]."""
    A = add_bias(X)
    return 2.0 / len(A) * (A.T @ A)


def lambda_max(X: np.ndarray) -> float:
    """Largest Hessian eigenvalue; gradient descent converges iff lr < 2 / λ_max."""
    return float(np.linalg.eigvalsh(hessian(X))[-1])


def _schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        return lr
    lr = float(lr)
    if not lr > 0:
        raise ValueError(f"the learning rate must be positive, got {lr}")
    return lambda step: lr


def gd_path(
    X: np.ndarray, y: np.ndarray, theta0: Sequence[float], lr: float | Schedule, steps: int
) -> np.ndarray:
    """Full-batch gradient descent; returns every iterate, shape ``(steps + 1, d + 1)``.

    Diverging runs are not stopped: their iterates grow to inf, which is the point
    of showing them. Overflow warnings are silenced for that reason.
    """
    X, y = _check_xy(X, y)
    theta = _check_theta(theta0, X.shape[1]).copy()
    lr_at = _schedule(lr)
    path = np.empty((steps + 1, len(theta)))
    path[0] = theta
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(steps):
            theta = theta - lr_at(step) * mse_gradient(X, y, theta)
            path[step + 1] = theta
    return path


def updates_per_epoch(n: int, batch_size: int) -> int:
    """Number of parameter updates in one pass over ``n`` samples."""
    return -(-n // batch_size)


def path_losses(X: np.ndarray, y: np.ndarray, path: np.ndarray) -> np.ndarray:
    """Full-data loss at every iterate of ``path`` (``(k, d + 1)``), vectorised."""
    X, y = _check_xy(X, y)
    path = np.asarray(path, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        residuals = X @ path[:, :-1].T + path[:, -1] - y[:, None]
        return np.mean(residuals**2, axis=0)


def loss_grid(
    x: np.ndarray, y: np.ndarray, w_values: np.ndarray, b_values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loss of the 1-feature model ``w·x + b`` on a grid, for contour and surface plots.

    Returns ``(W, B, L)`` as from ``np.meshgrid(w_values, b_values)``. Uses the
    sufficient statistics of ``x`` and ``y``, so the cost does not grow with ``n``.
    """
    X, y = _check_xy(x, y)
    if X.shape[1] != 1:
        raise ValueError("loss_grid draws the (w, b) plane of a single-feature problem")
    x = X[:, 0]
    W, B = np.meshgrid(np.asarray(w_values, float), np.asarray(b_values, float))
    sxx, sx, sy, sxy, syy = (np.mean(x * x), np.mean(x), np.mean(y), np.mean(x * y), np.mean(y * y))
    L = W**2 * sxx + B**2 + syy + 2 * W * B * sx - 2 * W * sxy - 2 * B * sy
    return W, B, L


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (the exponent of a power law)."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if lx.shape != ly.shape or lx.size < 2:
        raise ValueError("loglog_slope needs two or more (x, y) pairs of the same length")
    return float(np.polyfit(lx, ly, 1)[0])


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
