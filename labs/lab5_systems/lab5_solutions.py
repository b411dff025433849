"""Reference solutions of the Lab 5 exercises (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

import torch


def adam_server_update(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One synchronous Adam step on the server, from the gradients the workers pushed.

    ``step`` counts from 1. Returns the new ``(param, m, v)``; the inputs are not changed.
    """
    b1, b2 = betas
    grad = torch.stack(grads).mean(0)  # the workers' average: what one large batch gives
    m = b1 * m + (1 - b1) * grad  # first moment: a running mean of the gradient
    v = b2 * v + (1 - b2) * grad * grad  # second moment: of its square
    m_hat = m / (1 - b1**step)  # bias correction: m and v start at zero
    v_hat = v / (1 - b2**step)
    return param - lr * m_hat / (v_hat.sqrt() + eps), m, v


def easgd_worker(
    x: torch.Tensor, grad: torch.Tensor, center: torch.Tensor, lr: float, rho: float
) -> torch.Tensor:
    """x_i ← x_i − η (g_i + ρ (x_i − x̃)): a gradient step plus the elastic pull."""
    return x - lr * (grad + rho * (x - center))


def easgd_center(
    center: torch.Tensor, xs: list[torch.Tensor], lr: float, rho: float
) -> torch.Tensor:
    """x̃ ← x̃ + η Σ_i ρ (x_i − x̃), with every x_i taken *before* the workers move."""
    return center + lr * rho * sum(x - center for x in xs)
