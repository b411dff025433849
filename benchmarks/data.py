"""The data the benchmarks train on: the real Fashion-MNIST, or a clear skip."""

from __future__ import annotations

import functools

from lab_utils import data

from .common import Skip


@functools.cache
def fashion_mnist() -> data.Dataset:
    """Fashion-MNIST as tensors; :class:`Skip` (with the loader's advice) if it is absent."""
    try:
        return data.load("fashion-mnist")
    except data.DataError as e:
        raise Skip(f"Fashion-MNIST is not available: {e}") from e
