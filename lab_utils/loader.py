"""A batch loader for data that fits in memory: the whole set stays as one tensor on
the device (``uint8`` images take a quarter of the float size), batches are gathered
by index, augmented in batches and normalised on the device. No per-sample Python,
no worker processes.

Shuffling and sharding follow ``DistributedSampler``: every epoch a permutation
seeded by ``(seed, epoch)`` — the same on every rank — is split between ranks.

Randomness: the shuffle uses its own ``(seed, epoch)`` generator. The augmentations
:func:`random_crop` and :func:`random_flip` draw from torch's global RNG of the
tensor's device (unless given a ``generator``), which the Trainer's checkpoint saves,
so a resumed run continues the same augmentation stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["TensorLoader", "random_crop", "random_flip"]

Augment = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- augmentation
def _random_ints(
    high: int, size: tuple[int, ...], x: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    device = generator.device if generator is not None else x.device
    return torch.randint(0, high, size, generator=generator, device=device).to(x.device)


def random_crop(
    x: torch.Tensor,
    pad: int,
    padding_mode: str = "reflect",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random crops of the padded images: each image is shifted by its own random
    offset in ``[-pad, pad]`` along each axis, the gap filled by reflection
    (``"reflect"``, as ``F.pad``) or zeros (``"zeros"``).

    Works on any dtype (``uint8`` included) and device, with one ``gather`` for the
    whole batch ``(N, C, H, W)``.
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop expects images (N, C, H, W), got {tuple(x.shape)}")
    if padding_mode not in ("reflect", "zeros"):
        raise ValueError(f"padding_mode must be 'reflect' or 'zeros', got {padding_mode!r}")
    n, c, h, w = x.shape
    if pad < 0 or (padding_mode == "reflect" and pad >= min(h, w)):
        raise ValueError(f"pad={pad} must be >= 0 (and < the image size {h}x{w} for reflect)")
    if pad == 0 or n == 0:
        return x
    shift = _random_ints(2 * pad + 1, (2, n), x, generator) - pad
    rows = torch.arange(h, device=x.device) + shift[0, :, None]  # (N, H) source rows
    cols = torch.arange(w, device=x.device) + shift[1, :, None]  # (N, W) source columns
    if padding_mode == "reflect":
        rows, cols = _reflect(rows, h), _reflect(cols, w)
    else:
        inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    flat_index = (rows[:, :, None] * w + cols[:, None, :]).reshape(n, 1, h * w)
    out = x.reshape(n, c, h * w).gather(2, flat_index.expand(n, c, h * w)).reshape(n, c, h, w)
    if padding_mode == "zeros":
        out = out.masked_fill(~inside[:, None], 0)
    return out


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Mirror out-of-range indices at the edges without repeating the edge pixel."""
    index = index.abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


def random_flip(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each image of ``(N, C, H, W)`` left–right with probability 1/2."""
    if x.dim() != 4:
        raise ValueError(f"random_flip expects images (N, C, H, W), got {tuple(x.shape)}")
    flip = _random_ints(2, (x.shape[0],), x, generator).bool()
    return torch.where(flip[:, None, None, None], x.flip(3), x)


# --------------------------------------------------------------------------- loader
def _epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 64-bit seed from ``(seed, epoch)``, equal on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


class TensorLoader:
    """Iterate over ``(images, labels)`` batches of tensors kept on one device.

    ``x``: ``uint8`` images ``(N, C, H, W)`` (scaled by 1/255, then normalised with
    ``mean``/``std`` given on the 0–1 scale) or any other tensor (cast to float32 and
    normalised with ``mean``/``std`` as given). ``y``: labels, passed through.

    Each epoch (``set_epoch``) shuffles with a permutation seeded by ``(seed, epoch)``.
    Rank ``r`` of ``world_size`` then takes the samples ``r::world_size``; with
    ``even_shards=True`` (training) the permutation is first padded by wrapping round
    so that every rank has the same number of batches, with ``even_shards=False``
    (exact evaluation) nothing is repeated and shard sizes may differ by one.
    ``len(loader)`` is the number of batches of this rank.

    ``augment=True`` applies ``random_crop(x, crop_pad)`` then ``random_flip`` to each
    batch (before normalisation); a callable is applied instead. ``channels_last``
    returns batches in that memory format (faster convolutions on GPUs).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        even_shards: bool = True,
        drop_last: bool = False,
        augment: bool | Augment = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        device: torch.device | str | None = None,
        channels_last: bool = False,
        crop_pad: int = 2,
    ) -> None:
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError("x and y must be tensors")
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(
                f"x and y must hold the same, non-zero number of samples; got {len(x)} and {len(y)}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if (augment or channels_last) and x.dim() != 4:
            raise ValueError(
                f"augment and channels_last need images (N, C, H, W), got {tuple(x.shape)}"
            )
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.device = torch.device(device) if device is not None else x.device
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.even_shards, self.drop_last = even_shards, drop_last
        self.channels_last, self.epoch = channels_last, 0
        self.augment: Augment | None = (
            augment
            if callable(augment)
            else (lambda b: random_flip(random_crop(b, crop_pad)))
            if augment
            else None
        )
        self._scale, self._shift = self._normaliser(mean, std)
        if len(self) == 0 and self.num_samples > 0:  # (an empty evaluation shard is fine)
            raise ValueError(
                f"no batches: rank {rank} holds {self.num_samples} samples, fewer "
                f"than batch_size={batch_size} with drop_last=True"
            )

    @classmethod
    def from_dataset(cls, ds: Any, split: str, batch_size: int, **kw: Any) -> TensorLoader:
        """A loader over ``ds`` (a :class:`lab_utils.data.Dataset`) split ``"train"`` or
        ``"test"``, normalised with the dataset's mean/std. The test split defaults to
        ``shuffle=False, even_shards=False`` (exact evaluation); ``kw`` overrides."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        x, y = (ds.x_train, ds.y_train) if split == "train" else (ds.x_test, ds.y_test)
        defaults: dict[str, Any] = {"mean": ds.mean, "std": ds.std}
        if split == "test":
            defaults.update(shuffle=False, even_shards=False)
        return cls(x, y, batch_size, **{**defaults, **kw})

    def _normaliser(
        self, mean: Sequence[float] | None, std: Sequence[float] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``x * scale - shift`` equals ``(x / 255 - mean) / std`` for uint8 input."""
        to_unit = 1 / 255 if self.x.dtype == torch.uint8 else 1.0
        if mean is None or std is None:
            return (torch.tensor(to_unit, device=self.device) if to_unit != 1.0 else None), None
        channels = self.x.shape[1] if self.x.dim() >= 2 else 1
        if len(mean) != channels or len(std) != channels or min(std) <= 0:
            raise ValueError(
                f"mean and std need {channels} entries (one per channel, std > 0), "
                f"got mean={tuple(mean)}, std={tuple(std)}"
            )
        shape = (1, channels) + (1,) * max(self.x.dim() - 2, 0)
        m = torch.tensor(mean, dtype=torch.float32, device=self.device).reshape(shape)
        s = torch.tensor(std, dtype=torch.float32, device=self.device).reshape(shape)
        return to_unit / s, m / s

    # ------------------------------------------------------------------ epochs and shards
    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it at the start of every epoch)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch

    def indices(self) -> torch.Tensor:
        """The sample indices of this rank for the current epoch, in batch order (CPU)."""
        n = len(self.x)
        if self.shuffle:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        if self.even_shards:
            padded = math.ceil(n / self.world_size) * self.world_size
            order = order[torch.arange(padded) % n]  # wrap round, as DistributedSampler
        return order[self.rank :: self.world_size]

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch (padding included)."""
        n = len(self.x)
        if self.even_shards:
            return math.ceil(n / self.world_size)
        return len(range(self.rank, n, self.world_size))

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    # ------------------------------------------------------------------ batches
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.indices().to(self.device)
        for b in range(len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self._prepare(self.x[idx]), self.y[idx]

    def _prepare(self, xb: torch.Tensor) -> torch.Tensor:
        if self.augment is not None:
            xb = self.augment(xb)
        xb = xb.float()
        if self._scale is not None:
            xb = xb.mul_(self._scale)
        if self._shift is not None:
            xb = xb.sub_(self._shift)
        if self.channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        return xb

    def __repr__(self) -> str:
        return (
            f"TensorLoader(n={len(self.x)}, batch_size={self.batch_size}, "
            f"batches={len(self)}, rank={self.rank}/{self.world_size}, "
            f"shuffle={self.shuffle}, even_shards={self.even_shards}, "
            f"augment={self.augment is not None}, device={self.device})"
        )
