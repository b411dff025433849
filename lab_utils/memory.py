"""Memory accounting of training state: bytes measured from the tensors themselves
(sharded tensors count only their local shard) and the ZeRO paper's formulas.

    state_bytes(model, optimizer)   -> {"params": ..., "grads": ..., "optimizer": ...}
    activation_bytes(lambda: model(x).sum())  -> bytes autograd saved for backward
                                                 (lab_utils.saved_bytes: each storage once)
    zero_bytes_per_rank(psi, n, stage, k=8)   -> the formula for one rank
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from lab_utils.saved_bytes import SavedBytes, saved_bytes

# Bytes of optimizer state per parameter in fp32 training.
OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank stores for ``tensors`` (``None`` counts zero)."""
    total = 0
    for t in tensors:
        if t is not None:
            loc = _local(t)
            total += loc.numel() * loc.element_size()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (momentum, Adam moments, ...).
    Scalar step counters are left out: they are not per parameter."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's
    return tensor_bytes(
        v
        for s in inner.state.values()
        for v in s.values()
        if torch.is_tensor(v) and _local(v).dim() > 0
    )


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": optimizer_bytes(optimizer) if optimizer is not None else 0,
    }


class SavedTensorCounter(SavedBytes):
    """Bytes autograd saves for backward inside ``with counter.hooks():`` — the one
    meter, :class:`lab_utils.saved_bytes.SavedBytes`: each storage counted once with its
    full size (views of one storage, such as the attention output and the projection's
    input, share it), and the storages of the ``exclude`` parameters (a matmul saves its
    weight) not at all: those are not activations."""


def activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the activations autograd saves for backward while ``fn`` runs
    (pass ``model.parameters()`` as ``exclude`` so saved weights do not count):
    :func:`lab_utils.saved_bytes.saved_bytes`, each storage once."""
    return saved_bytes(fn, exclude)


def zero_bytes_per_rank(
    psi: int, n: int, stage: int, k: int = 8, param_bytes: int = 4, grad_bytes: int = 4
) -> dict[str, float]:
    """Per-rank bytes of the ZeRO paper (Rajbhandari et al. 2020, Fig. 1) for
    ``psi`` parameters on ``n`` ranks, ``k`` optimizer bytes per parameter.

    stage 0 = DDP (everything replicated), 1 = optimizer state sharded (ZeRO-1),
    2 = + gradients sharded, 3 = + parameters sharded (FSDP's full sharding).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return {
        "params": param_bytes * psi / (n if stage >= 3 else 1),
        "grads": grad_bytes * psi / (n if stage >= 2 else 1),
        "optimizer": k * psi / (n if stage >= 1 else 1),
    }


def peak_cuda_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` on a GPU, ``None`` on a CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
