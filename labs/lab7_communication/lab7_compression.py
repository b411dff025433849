"""What a DDP communication hook puts on the wire: each step's all-reduce bytes predicted
from the gradients' shapes (Lab 7, notebook 2; the script ``scripts/compressed_ddp.py``
counts them).

A bucket's all-reduce carries its gradients in full (DDP's own, 4 bytes per float32
element), at half the width (``fp16_compress_hook``, ``bf16_compress_hook``), or, with
``powerSGD_hook``, three all-reduces: the gradients PowerSGD leaves alone, then P and Q
of every matrix it compresses. It views a gradient as a matrix of ``shape[0]`` rows
(``tensor.view(tensor.shape[0], -1)``) and compresses it when (rows + cols) · r ·
``min_compression_rate`` < rows · cols, with r = min(rows, cols, rank)
(torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, ``_should_compress``
lines 78–104 and the split at 448–463 in torch 2.13). Before ``start_powerSGD_iter``
it all-reduces the bucket uncompressed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int]


def matrix_of(shape: Shape) -> tuple[int, int]:
    """The matrix PowerSGD sees: ``shape[0]`` rows, everything else as columns."""
    rows = shape[0] if shape else 1
    return rows, math.prod(shape) // rows if rows else 0


def powersgd_split(shape: Shape, rank: int, min_compression_rate: float = 2.0) -> int | None:
    """The rank PowerSGD compresses a gradient of ``shape`` with, or ``None`` when it
    leaves it uncompressed."""
    n, m = matrix_of(shape)
    r = min(n, m, rank)
    return r if (n + m) * r * min_compression_rate < n * m else None


def bucket_bytes(
    shapes: Sequence[Shape],
    hook: str,
    *,
    rank: int = 1,
    compressing: bool = True,
    element_bytes: int = 4,
) -> int:
    """All-reduce bytes of one bucket of gradients of these ``shapes`` under ``hook``
    (``none``, ``fp16``, ``bf16``, ``powersgd``; ``compressing=False``: PowerSGD before
    its start iteration, which all-reduces the bucket as it is)."""
    numel = sum(math.prod(s) for s in shapes)
    if hook == "none" or (hook == "powersgd" and not compressing):
        return element_bytes * numel
    if hook in ("fp16", "bf16"):
        return 2 * numel
    if hook != "powersgd":
        raise ValueError(f"no hook {hook!r}: none, fp16, bf16 or powersgd")
    total = 0
    for s in shapes:
        r = powersgd_split(s, rank)
        n, m = matrix_of(s)
        total += element_bytes * (math.prod(s) if r is None else r * (n + m))
    return total
