"""Fashion-MNIST as normalised float tensors in memory, with seeded batch draws.

Lab 5's jobs (parameter server, Hogwild, EASGD, elastic training) run several
processes that each need the same small training set, a batch chosen by
``(seed, worker, step)`` alone (so a run can be replayed or resumed exactly), and a
test accuracy. This module does those three things and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import data


@dataclass(frozen=True)
class Tensors:
    """Train and test images ``(N, 1, 28, 28)`` as normalised ``float32``, labels ``int64``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str) -> Tensors:
        return Tensors(
            *(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test))
        )


def load(n_train: int, n_test: int, seed: int = 0, name: str = "fashion-mnist") -> Tensors:
    """A reproducible random subset of ``name`` (default the real Fashion-MNIST)."""
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train and n_test must be >= 1, got {n_train} and {n_test}")
    ds = data.load(name).subset(n_train, n_test, seed=seed)
    mean = torch.tensor(ds.mean).view(1, -1, 1, 1)
    std = torch.tensor(ds.std).view(1, -1, 1, 1)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() / 255 - mean) / std).contiguous()

    return Tensors(norm(ds.x_train), ds.y_train.clone(), norm(ds.x_test), ds.y_test.clone())


def batch_indices(n: int, batch_size: int, *, seed: int, worker: int, step: int) -> torch.Tensor:
    """The sample indices worker ``worker`` uses at step ``step``: a function of the three
    numbers only, so any process (or a replay) draws the same batch."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + worker) * 1_000_003 + step) % 2**63)
    return torch.randint(0, n, (batch_size,), generator=g)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048) -> float:
    """Fraction of ``x`` that ``model`` classifies right (in eval mode, then restored)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    right = 0
    for i in range(0, len(x), batch_size):
        right += int(
            (model(x[i : i + batch_size].to(dev)).argmax(1).cpu() == y[i : i + batch_size]).sum()
        )
    model.train(was)
    return right / len(x)
