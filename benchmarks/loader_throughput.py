"""2. The tensor-resident loader with batched augmentation vs a per-sample DataLoader.

Both produce the same thing: shuffled batches of Fashion-MNIST images, randomly
cropped (2-pixel reflect padding), randomly flipped, scaled and normalised.

* ``TensorLoader(augment=True)``: one gather for the batch, one crop ``gather``, one
  flip ``where``, one multiply-subtract.
* ``torch.utils.data.DataLoader`` over a ``Dataset`` whose ``__getitem__`` applies the
  usual per-sample pipeline (what torchvision's ``RandomCrop(28, padding=2,
  padding_mode="reflect")``, ``RandomHorizontalFlip()``, ``ToTensor()``,
  ``Normalize()`` do, written in plain torch), with 0 worker processes and with one
  worker per core; the faster of the two is the reference for the target.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from lab_utils import profile
from lab_utils.loader import TensorLoader

from .common import Report, Settings, alternate, median, paired_ratios, spread, synchronize
from .data import fashion_mnist

NAME = "loader"
TITLE = "TensorLoader (batched augmentation) vs DataLoader (per-sample transforms)"
TARGET_SPEEDUP = 5.0


class PerSampleImages(TorchDataset):
    """uint8 images with the classic per-sample augmentation, one image per call."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, mean: float, std: float, pad: int = 2
    ) -> None:
        self.x, self.y, self.mean, self.std, self.pad = x, y, mean, std, pad

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.x[i].float().div_(255)  # ToTensor
        c, h, w = img.shape
        padded = F.pad(img[None], (self.pad,) * 4, mode="reflect")[0]  # RandomCrop
        top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        img = padded[:, top : top + h, left : left + w]
        if torch.rand(()) < 0.5:  # RandomHorizontalFlip
            img = img.flip(2)
        return (img - self.mean) / self.std, self.y[i]  # Normalize


def epoch_seconds(loader: Iterable, n_images: int, device: torch.device) -> float:
    """Seconds to draw every batch of one epoch onto ``device`` (checking that all
    images came)."""
    start = time.perf_counter()
    seen = 0
    for xb, yb in loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        seen += len(xb)
    synchronize(device)
    seconds = time.perf_counter() - start
    if seen != n_images:
        raise RuntimeError(f"loader produced {seen} images, expected {n_images}")
    return seconds


def data_loaders(
    per_sample: PerSampleImages, batch: int, workers: int, pin: bool
) -> dict[str, DataLoader]:
    """The two DataLoader set-ups compared: in the main process, and with workers."""
    return {
        "DataLoader, 0 workers": DataLoader(
            per_sample, batch_size=batch, shuffle=True, pin_memory=pin
        ),
        f"DataLoader, {workers} workers": DataLoader(
            per_sample,
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=True,
            pin_memory=pin,
        ),
    }


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    ds = fashion_mnist()
    n = 1024 if settings.quick else 15000
    batch = 256
    rounds = settings.rounds(full=5)
    sub = ds.subset(n_train=n, n_test=0)
    workers = max(1, min(os.cpu_count() or 1, 4))

    device = profile.device()
    tensor_loader = TensorLoader.from_dataset(sub, "train", batch, augment=True, device=device)
    per_sample = PerSampleImages(sub.x_train, sub.y_train, ds.mean[0], ds.std[0])
    loaders = data_loaders(per_sample, batch, workers, pin=device.type == "cuda")
    epoch = {"n": 0}

    def tensor() -> float:
        tensor_loader.set_epoch(epoch["n"])
        epoch["n"] += 1
        return epoch_seconds(tensor_loader, n, device)

    contenders = {"TensorLoader": tensor}
    for name, dl in loaders.items():
        contenders[name] = lambda dl=dl: epoch_seconds(dl, n, device)
    times = alternate(contenders, rounds=rounds, warmup=1)
    contenders.clear()  # the last references to the DataLoaders: their workers end
    loaders.clear()

    for name, secs in times.items():
        report.add(name, n / median(secs), "img/s")
    dl_names = [k for k in times if k.startswith("DataLoader")]
    # Per round, against the faster DataLoader set-up of that round.
    best_dl = [min(vals) for vals in zip(*(times[k] for k in dl_names), strict=True)]
    ratios = paired_ratios(best_dl, times["TensorLoader"])
    speedup = median(ratios)
    lo, hi = spread(ratios)
    report.add(
        "speed-up vs the faster DataLoader",
        speedup,
        "x",
        target=f">= {TARGET_SPEEDUP:g}x",
        met=speedup >= TARGET_SPEEDUP,
        note=f"rounds {lo:.1f}..{hi:.1f}x",
    )
    report.details = {"images": n, "batch_size": batch, "rounds": rounds, "seconds": times}
    report.notes.append(
        f"{n} images per round in batches of {batch}, crop+flip+normalise, "
        f"onto {device}; median of {rounds} alternating rounds."
    )
    return report
