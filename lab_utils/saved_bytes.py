"""Bytes autograd keeps for the backward pass, measured exactly on any device.

    meter = SavedBytes(exclude=model.parameters())
    with meter:
        loss = loss_of(model)          # the forward pass
    meter.bytes                        # bytes of every storage saved for backward
    loss.backward()

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an operation saves for
its backward, including those that ``torch.utils.checkpoint`` keeps. Several saved
tensors often share one storage (``q``, ``k`` and ``v`` as views, the input of three
linear layers): the meter counts each storage once, with its full size, which is the
memory that stays allocated. Storages of ``exclude`` (the weights) are not activations.

:func:`recompute` applies ``torch.utils.checkpoint`` to a ``char_transformer`` by policy
(every block, attention only, MLP only), the trade of compute for these bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Saved:
    """One storage kept for backward: its size, dtype, and the first shape seen saved."""

    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SavedBytes:
    """A context manager that records the storages saved for backward inside it."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {_storage_key(t) for t in exclude}
        self.storages: dict[tuple, Saved] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        # Held while measuring, so no counted storage is freed and its address reused.
        self._alive: list[torch.UntypedStorage] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._skip and key not in self.storages:
            self.storages[key] = Saved(t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
            self._alive.append(t.untyped_storage())
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._alive.clear()

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved."""
        return sum(s.nbytes for s in self.storages.values())

    def by_dtype(self) -> dict[str, int]:
        """Bytes saved per dtype (``"torch.float32"``: ...)."""
        out: dict[str, int] = {}
        for s in self.storages.values():
            out[str(s.dtype)] = out.get(str(s.dtype), 0) + s.nbytes
        return out


def _storage_key(t: torch.Tensor) -> tuple:
    """What identifies a storage: its device and address (views share both)."""
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def saved_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages saved for backward while ``forward`` runs."""
    with SavedBytes(exclude) as meter:
        forward()
    return meter.bytes


# --------------------------------------------------------------------- recomputation
POLICIES = ("none", "attention", "mlp", "full")


class Recomputed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint``: the forward keeps only the
    inputs, and the backward runs ``inner`` again to rebuild what it needs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def recompute(model: nn.Module, policy: str) -> nn.Module:
    """``model`` (a ``char_transformer``) with recomputation in place: ``"full"`` wraps
    every block, ``"attention"`` each block's attention, ``"mlp"`` each block's MLP,
    ``"none"`` nothing. The weights are shared, so results are unchanged."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "none":
        return model
    layers = model.layers
    for i in range(1, len(layers) - 1):
        block = layers[i]
        if policy == "full":
            layers[i] = Recomputed(block)
        elif policy == "attention":
            block.attn = Recomputed(block.attn)
        else:
            block.mlp = Recomputed(block.mlp)
    return model
