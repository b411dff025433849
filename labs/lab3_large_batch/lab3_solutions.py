"""Reference solutions of Lab 3 (algorithms for large batches)."""

from __future__ import annotations

import torch


def warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    """Gradual warm-up (Goyal et al. 2017): the learning-rate multiplier of update
    ``step`` (0-based). It grows by the same amount every update, from
    ``start_factor`` towards 1, reaches 1 at update ``warmup_steps - 1`` and stays there."""
    if step >= warmup_steps:
        return 1.0
    return start_factor + (1.0 - start_factor) * (step + 1) / warmup_steps


def lars_trust_ratio(
    w: torch.Tensor, g: torch.Tensor, trust_coefficient: float = 0.001, weight_decay: float = 0.0
) -> torch.Tensor:
    """LARS's local learning rate of one layer (You et al. 2017):
    ``η ‖w‖ / (‖g‖ + β ‖w‖)``, and 1 when ``‖w‖`` or the denominator is zero."""
    w_norm = torch.linalg.vector_norm(w)
    denominator = torch.linalg.vector_norm(g) + weight_decay * w_norm
    if w_norm == 0 or denominator == 0:
        return torch.ones((), dtype=w.dtype, device=w.device)
    return trust_coefficient * w_norm / denominator
