"""Reference solutions of Lab 7's exercises (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """α (seconds) and β (seconds per byte) of the line t = α + β·bytes through the
    points (``nbytes[i]``, ``seconds[i]``), by ordinary least squares: the α and β that
    make the sum of (α + β·bytes − t)² smallest."""
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)  # columns: 1 (for α), bytes (for β)
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    return float(alpha), float(beta)


def bf16_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """A DDP communication hook: the bucket's gradients, divided by the number of ranks,
    all-reduced in bfloat16 (2 bytes an element instead of 4), then written back into the
    bucket's float32 buffer — the average DDP expects."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


def pseudo_gradient(
    before: list[torch.Tensor], after: list[torch.Tensor], world_size: int
) -> list[torch.Tensor]:
    """DiLoCo's outer gradient: θ_before − θ_after of every tensor (the global weights
    minus this rank's after its H inner steps), summed over the ranks with
    ``dist.all_reduce`` and divided by ``world_size``: the mean over ranks. New tensors;
    ``before`` and ``after`` are left as they were."""
    deltas = [b - a for b, a in zip(before, after, strict=True)]
    for d in deltas:
        dist.all_reduce(d)
        d /= world_size
    return deltas
