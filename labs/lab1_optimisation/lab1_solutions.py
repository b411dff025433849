"""Reference solutions of the Lab 1 exercises (used when ``LABS_SOLUTIONS=1``).

Parameters are ``θ = (w₁, …, w_d, b)``, bias last, as in :mod:`lab_utils.regression`.
Each function is written the way the notebook asks for it, in plain NumPy/PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _matrix(X):
    X = np.asarray(X, dtype=np.float64)
    return X[:, None] if X.ndim == 1 else X


def normal_equations(X, y):
    """θ = (AᵀA)⁻¹ Aᵀ y with the design matrix A = [X, 1]."""
    X = _matrix(X)
    A = np.hstack([X, np.ones((len(X), 1))])
    return np.linalg.solve(A.T @ A, A.T @ np.asarray(y, dtype=np.float64))


def mse_gradient(X, y, theta):
    """∇ mean((Xw + b − y)²) = (2/n) (Xᵀr, Σr) with r = Xw + b − y."""
    X = _matrix(X)
    theta = np.asarray(theta, dtype=np.float64)
    r = X @ theta[:-1] + theta[-1] - np.asarray(y, dtype=np.float64)
    n = len(r)
    return np.concatenate([2.0 / n * (X.T @ r), [2.0 / n * r.sum()]])


def gradient_descent(X, y, theta0, lr, steps):
    """Iterates θ_{t+1} = θ_t − lr ∇L(θ_t); returns all steps + 1 of them."""
    theta = np.array(theta0, dtype=np.float64)
    path = [theta.copy()]
    for _ in range(steps):
        theta = theta - lr * mse_gradient(X, y, theta)
        path.append(theta.copy())
    return np.array(path)


def neuron_gradient(x, y, w, b):
    """Gradient of L = mean((tanh(w x + b) − y)²) with respect to (w, b), by the chain rule.

    Works on NumPy arrays or torch tensors (only elementwise operations and sums).
    """
    a = np.tanh(w * x + b) if isinstance(x, np.ndarray) else (w * x + b).tanh()
    dL_da = 2.0 * (a - y) / len(x)  # ∂L/∂a for each sample
    dL_dz = dL_da * (1.0 - a * a)  # tanh'(z) = 1 − tanh(z)²
    return (dL_dz * x).sum(), dL_dz.sum()


def minibatch_sgd(X, y, theta0, lr, batch_size, epochs, seed=0):
    """Mini-batch SGD with a fresh shuffle every epoch; ``lr`` is a number or a function
    ``step -> lr``. Returns every iterate (one per update, plus the start)."""
    X = _matrix(X)
    y = np.asarray(y, dtype=np.float64)
    lr_at: Callable[[int], float] = lr if callable(lr) else (lambda step: lr)
    rng = np.random.default_rng(seed)
    theta = np.array(theta0, dtype=np.float64)
    path = [theta.copy()]
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            theta = theta - lr_at(step) * mse_gradient(X[idx], y[idx], theta)
            path.append(theta.copy())
            step += 1
    return np.array(path)


def decayed_lr(step, lr0, decay_steps):
    """Inverse-time decay: lr0 at step 0, lr0 / 2 after ``decay_steps``, → 0 like 1/step."""
    return lr0 / (1.0 + step / decay_steps)


def loglog_slope(x, y):
    """Slope of the least-squares line through (log x, log y), by the normal equations."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    return float(normal_equations(lx, ly)[0])
