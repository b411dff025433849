"""Bytes autograd keeps for the backward pass, measured exactly on any device.

    meter = SavedBytes(exclude=model.parameters())
    with meter:
        loss = loss_of(model)          # the forward pass
    meter.bytes                        # bytes of every storage saved for backward
    loss.backward()

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an operation saves for
its backward, including those that ``torch.utils.checkpoint`` keeps. Several saved
tensors often share one storage (``q``, ``k`` and ``v`` as views, the input of three
linear layers; the projection's input, a view of the fused attention kernel's output):
the meter counts each storage once, with its full size, which is the memory that stays
allocated. Storages of ``exclude`` (the weights) are not activations. This is the one
meter of saved activations in the course (``memory.activation_bytes`` and
``memory.SavedTensorCounter`` are this class).

``meter.peak`` is the most bytes held for backward at once: a storage counts from the
first time it is saved until autograd releases the last reference to it (its node's
backward ran and freed the graph). Run the backward inside the ``with`` as well to see
what a pipeline stage holds while it drains, and what a recomputed block saves during
the backward — ``checkpoint(..., use_reentrant=True)`` recomputes through these hooks;
the non-reentrant form keeps its recomputed tensors in hooks of its own
(``_recomputation_hook``, torch/utils/checkpoint.py:1088 in torch 2.13), which this meter does not see.

:func:`recompute` applies ``torch.utils.checkpoint`` to a ``char_transformer`` by policy
(every block; the attention core only, Korthikanti et al.'s selective recomputation; the
whole attention or MLP sub-layer), the trade of compute for these bytes.
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
        self._refs: dict[tuple, int] = {}  # storage -> saved references autograd still holds
        self.live = 0  # bytes of the storages autograd holds now
        self.peak = 0  # the most it held at once

    def pack(self, t: torch.Tensor) -> object:
        """The pack hook: record ``t``'s storage (a DTensor's local shard: what this rank
        holds); what autograd keeps is a handle that says when autograd lets go of it."""
        local = _local(t)
        key = _storage_key(local)
        if key in self._skip:
            return t
        if key not in self.storages:
            storage = local.untyped_storage()
            self.storages[key] = Saved(storage.nbytes(), local.dtype, tuple(local.shape))
            self._alive.append(storage)
        if not self._refs.get(key):
            self.live += self.storages[key].nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Held(t, self, key)

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            self.live -= self.storages[key].nbytes

    def hooks(self) -> SavedBytes:
        """The meter itself (``with meter.hooks():`` reads as ``with meter:``)."""
        return self

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
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


class _Held:
    """What autograd keeps for one saved tensor: the tensor, and a note to the meter
    when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedBytes, key: tuple) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(held: object) -> torch.Tensor:
    # A subclass's pack may hand back the tensor itself (it then keeps no handle).
    return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_key(t: torch.Tensor) -> tuple:
    """What identifies a storage: its device and address (views share both)."""
    t = _local(t)
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def saved_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages saved for backward while ``forward`` runs."""
    with SavedBytes(exclude) as meter:
        forward()
    return meter.bytes


# --------------------------------------------------------------------- recomputation
# "selective" is selective activation recomputation as Korthikanti et al. define it
# ("Reducing Activation Recomputation in Large Transformer Models", 2022, §5): recompute
# only the attention core (QKᵀ, softmax, softmax dropout, attention over V), whose s×s
# tensors are most of the memory and few of the FLOPs; the q, k, v and projection
# products are kept. The two sub-layer policies wrap a whole sub-layer instead.
POLICIES = ("none", "selective", "attention_sublayer", "mlp_sublayer", "full")


class Recomputed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint``: the forward keeps only the
    inputs, and the backward runs ``inner`` again to rebuild what it needs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """QKᵀ, causal softmax and the product with V (no dropout in this model)."""
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class CoreRecomputed(nn.Module):
    """A ``char_transformer`` attention (``models.SelfAttention``, its weights shared)
    whose core runs under ``torch.utils.checkpoint``: the q, k, v products and the
    projection keep what they save; the core keeps only its inputs q, k, v, and the
    backward runs it again (selective recomputation, Korthikanti et al. §5)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn
        n, t, _ = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(n, t, -1, a.head_dim).transpose(1, 2)

        y = checkpoint(
            _attention_core, heads(a.q(x)), heads(a.k(x)), heads(a.v(x)), use_reentrant=False
        )
        return a.proj(y.transpose(1, 2).reshape(n, t, -1))


def recompute(model: nn.Module, policy: str) -> nn.Module:
    """``model`` (a ``char_transformer``) with recomputation in place: ``"full"`` wraps
    every block; ``"selective"`` each block's attention core (QKᵀ, softmax, ·V);
    ``"attention_sublayer"`` each block's whole attention (q, k, v, core and
    projection); ``"mlp_sublayer"`` each block's MLP; ``"none"`` nothing. The weights
    are shared, so results are unchanged."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "none":
        return model
    layers = model.layers
    for i in range(1, len(layers) - 1):
        block = layers[i]
        if policy == "full":
            layers[i] = Recomputed(block)
        elif policy == "selective":
            block.attn = CoreRecomputed(block.attn)
        elif policy == "attention_sublayer":
            block.attn = Recomputed(block.attn)
        else:
            block.mlp = Recomputed(block.mlp)
    return model
