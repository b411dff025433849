"""1. The Trainer's step time against a bare hand-written PyTorch loop.

Both train the same model with the same optimiser on the same batches from the same
loader, one epoch each, alternating; the overhead is the median of the per-round
ratios ``trainer / bare - 1``. What the Trainer adds per step: the accuracy sums,
the per-step history, the callbacks and a stop/NaN check every ``sync_every`` steps.
A second, tiny model (the linear classifier) shows that cost in microseconds, where
the model's own compute cannot hide it.
"""

from __future__ import annotations

import contextlib
import io

import torch
import torch.nn.functional as F

from lab_utils import models, profile
from lab_utils.loader import TensorLoader
from lab_utils.train import Trainer

from .common import Report, Settings, alternate, median, paired_ratios, spread, synchronize
from .data import fashion_mnist

NAME = "trainer"
TITLE = "Trainer step time vs a bare PyTorch loop"
TARGET_OVERHEAD = 0.03


def bare_epoch(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: TensorLoader, epoch: int
) -> None:
    """The loop a student writes by hand: forward, loss, backward, step."""
    loader.set_epoch(epoch)
    model.train()
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def compare(arch: str, kwargs: dict, loader: TensorLoader, rounds: int) -> dict[str, list[float]]:
    """Epoch times of the bare loop and of ``Trainer.fit`` on one shared model."""
    torch.manual_seed(0)
    model = models.build(arch, **kwargs).to(loader.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(model, optimizer, progress=False)
    epochs = {"n": 0}

    def bare() -> None:
        bare_epoch(model, optimizer, loader, epochs["n"])
        synchronize(loader.device)
        epochs["n"] += 1

    def with_trainer() -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # its one line per epoch
            trainer.fit(loader, trainer.epoch + 1)
        synchronize(loader.device)

    return alternate({"bare": bare, "trainer": with_trainer}, rounds=rounds, warmup=1)


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    ds = fashion_mnist()
    n, batch, cnn_kwargs = (256, 64, {"width": 8}) if settings.quick else (7680, 128, {})
    rounds = settings.rounds(full=11)
    train = ds.subset(n_train=n, n_test=0)
    device = profile.device()
    loader = TensorLoader.from_dataset(train, "train", batch, drop_last=True, device=device)
    steps = len(loader)

    cnn = compare("fmnist_cnn", cnn_kwargs, loader, rounds)
    ratios = paired_ratios(cnn["trainer"], cnn["bare"])
    overhead = median(ratios) - 1
    lo, hi = spread(ratios)
    report.add("bare loop, fmnist_cnn", median(cnn["bare"]) / steps * 1e3, "ms/step")
    report.add("Trainer, fmnist_cnn", median(cnn["trainer"]) / steps * 1e3, "ms/step")
    report.add(
        "Trainer overhead, fmnist_cnn",
        100 * overhead,
        "%",
        target=f"<= {100 * TARGET_OVERHEAD:g} %",
        met=overhead <= TARGET_OVERHEAD,
        note=f"rounds {100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f} %",
    )

    lin = compare("linear", {}, loader, rounds)
    extra = [(t - b) / steps for t, b in zip(lin["trainer"], lin["bare"], strict=True)]
    report.add(
        "Trainer cost per step, linear model",
        median(extra) * 1e6,
        "us/step",
        note=f"bare step {median(lin['bare']) / steps * 1e6:.0f} us",
    )

    report.details = {
        "steps_per_epoch": steps,
        "batch_size": batch,
        "rounds": rounds,
        "fmnist_cnn_seconds": cnn,
        "linear_seconds": lin,
    }
    report.notes.append(
        f"{steps} steps of batch {batch} per round, real Fashion-MNIST, {device}, "
        f"{torch.get_num_threads()} threads; median of {rounds} alternating rounds."
    )
    return report
