"""Serial training script: the starting point of the assessment.

It trains correctly, on one process, and it is too slow to meet the target. Your job
is to make it data-parallel (DistributedDataParallel or Horovod) so that it reaches
the target test accuracy within the time budget on the target's number of processes.
Read assessment/README.md for the rules.

The grader runs it as ``<launcher> -np N starter.py --dataset NAME --budget SECONDS``
in a fresh working directory and afterwards reads ``checkpoint.pt`` from there.

THE CHECKPOINT CONTRACT (keep it when you change the script):
  * rank 0 alone writes ``checkpoint.pt`` in the current working directory;
  * it holds ``{"arch": str, "kwargs": dict, "state_dict": dict}`` for a model of the
    ``lab_utils.models`` registry: exactly what ``lab_utils.models.save`` writes for a
    model made by ``lab_utils.models.build``;
  * the model takes images normalised with the dataset's mean and std (as below) and
    returns logits; the grader rebuilds it and evaluates it itself, on the test split.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lab_utils import data, models
from lab_utils.loader import random_crop, random_flip

CHECKPOINT = "checkpoint.pt"
VALIDATION_SHARE = 1 / 12  # of the training split (5,000 Fashion-MNIST images), held out

# What to train on each dataset: a registry model and a plain SGD recipe.
RECIPES = {
    "fashion-mnist": {
        "arch": "fmnist_cnn",
        "kwargs": {"width": 16},
        "epochs": 3,
        "batch_size": 64,
        "lr": 0.05,
        "augment": False,
    },
    "cifar10": {
        "arch": "resnet_cifar",
        "kwargs": {"width": 64},
        "epochs": 16,
        "batch_size": 256,
        "lr": 0.2,
        "augment": True,
    },
    "synthetic-cifar10": {
        "arch": "resnet_cifar",
        "kwargs": {"width": 16},
        "epochs": 2,
        "batch_size": 64,
        "lr": 0.05,
        "augment": True,
    },
}


def parse_args(description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="cifar10", choices=sorted(RECIPES))
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="the target's time budget in seconds (given by the grader)",
    )
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def normalise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float, scaled to 0..1, then standardised per channel."""
    return (x.float() / 255 - mean) / std


@torch.no_grad()
def test_accuracy(
    model: torch.nn.Module,
    loader: DataLoader,
    mean: torch.Tensor,
    std: torch.Tensor,
    device: torch.device,
) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(normalise(x, mean, std)).argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / total


def train_epoch(
    model: torch.nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    recipe: dict,
    stats: tuple[torch.Tensor, torch.Tensor],
    epoch: int,
    start: float,
) -> None:
    """One pass over the training images, a step of the optimiser per batch."""
    mean, std = stats
    device = mean.device
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        if recipe["augment"]:
            x = random_flip(random_crop(x, pad=4))
        loss = F.cross_entropy(model(normalise(x, mean, std)), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0:
            print(
                f"epoch {epoch + 1} step {step}/{len(loader)} loss {loss.item():.4f}"
                f"  {time.perf_counter() - start:.0f}s",
                flush=True,
            )


def main() -> None:
    args = parse_args()
    recipe = RECIPES[args.dataset]
    epochs = args.epochs or recipe["epochs"]
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()

    # The test split is the grader's (its sandbox shows the training split alone):
    # accuracy is reported on a validation part of the training split.
    ds = data.load(args.dataset).holdout(VALIDATION_SHARE)
    mean = torch.tensor(ds.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(ds.std, device=device).view(1, -1, 1, 1)
    train_loader = DataLoader(
        TensorDataset(ds.x_train, ds.y_train),
        batch_size=recipe["batch_size"],
        shuffle=True,
        drop_last=True,
    )
    val_loader = DataLoader(TensorDataset(ds.x_test, ds.y_test), batch_size=1000)

    model = models.build(
        recipe["arch"],
        in_channels=ds.x_train.shape[1],
        num_classes=len(ds.classes),
        **recipe["kwargs"],
    ).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=recipe["lr"], momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    total_steps = epochs * len(train_loader)
    # The learning rate falls linearly to zero over the run (stepped once per batch).
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_steps)
    print(
        f"{ds.name}: {len(ds.x_train)} training images, {recipe['arch']}, "
        f"{epochs} epochs of batch {recipe['batch_size']}, on {device}",
        flush=True,
    )

    for epoch in range(epochs):
        train_epoch(model, train_loader, optimizer, schedule, recipe, (mean, std), epoch, start)
        acc = test_accuracy(model, val_loader, mean, std, device)
        print(
            f"epoch {epoch + 1}/{epochs}: validation accuracy {acc:.2%}  "
            f"{time.perf_counter() - start:.0f}s",
            flush=True,
        )

    models.save(CHECKPOINT, model)
    print(f"saved {CHECKPOINT} after {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
