"""Count the bytes that collectives carry, by kind, while a block of code runs.

``with traffic.count() as c:`` wraps the ``torch.distributed`` functions that DDP's
optimizers and FSDP2 call from Python (all-reduce, broadcast, all-gather into a
tensor, reduce-scatter of a tensor) and adds up the size of each collective's full
tensor. DDP all-reduces its buckets from C++; :func:`ddp_hook` is a communication
hook that sends them through ``torch.distributed.all_reduce`` instead, so they count. A ring moves per rank (N−1)/N of
an all-gather's or reduce-scatter's size and 2(N−1)/N of an all-reduce's.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# function name -> (counted as, which argument holds the full-size tensor)
# (FSDP2 calls the *_single names in recent torch, the *_tensor ones before.)
_WRAPPED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
}


class Counter(defaultdict):
    """``{kind: bytes}`` of the collectives seen."""

    def __init__(self) -> None:
        super().__init__(int)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self[kind] += t.numel() * t.element_size()


@contextlib.contextmanager
def count() -> Iterator[Counter]:
    """Wrap the collectives of ``torch.distributed`` and count their bytes."""
    counter = Counter()
    originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}

    def wrap(name: str) -> Any:
        kind, pos, key = _WRAPPED[name]
        original = originals[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[pos] if len(args) > pos else kwargs.get(key)
            if isinstance(t, torch.Tensor):
                counter.add(kind, t)
            return original(*args, **kwargs)

        return counted

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ddp_hook() -> Any:
    """DDP's default bucket all-reduce (averaging), made from Python so :func:`count` sees it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook
