"""What the three Lab 2 training scripts share: their options and their model.

train_serial.py, train_ddp.py and train_horovod.py parse the same options here, so
their diffs show only what data parallelism changes. Defaults follow the run
profile (``LABS_PROFILE=quick|cpu|gpu``): ``TRAIN`` in ``lab2_settings.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from lab_utils import data, metrics, models, paths, profile

# The rule every data-parallel script follows (Lab 3): N processes take N × the peak rate
# of one (linear scaling), reached by a linear warm-up from the one-process rate over
# WARMUP_EPOCHS, then a cosine to 0. The sizes of the ``cpu`` profile are chosen so that it
# holds up to 8 processes: small batches per process (16) keep the steps of an 8-process
# epoch at 156, and no BatchNorm keeps N × b identical to 1 × N·b (notebook 2's proof).
# tests/test_lab2_scaling.py asserts that accuracy does not fall with N.
WARMUP_EPOCHS = 0.5


def defaults() -> dict[str, Any]:
    """The run's dataset, sizes and peak learning rate of one process in the current
    profile, from the lab's settings (``lab2_settings.TRAIN``; also the defaults of
    train_horovod_spark.py, which takes its own options)."""
    return dict(paths.lab_module("lab2", "settings").TRAIN.of())


def parser(description: str) -> argparse.ArgumentParser:
    """The options every Lab 2 training script takes (a script may add its own)."""
    D = defaults()
    p = profile.script_parser(description)
    p.add_argument("--dataset", choices=data.NAMES, default=D["dataset"])
    p.add_argument("--epochs", type=int, default=D["epochs"])
    p.add_argument(
        "--batch-size", type=int, default=D["batch_size"], help="samples per step and process"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=D["lr"],
        help="peak learning rate of one process (its batch); annealed to 0 by the end",
    )
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument(
        "--n-train", type=int, default=D["n_train"], help="training images to use (0: all)"
    )
    p.add_argument("--n-test", type=int, default=D["n_test"], help="test images to use (0: all)")
    p.add_argument("--width", type=int, default=D["width"], help="channels of the first layer")
    p.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random crops and flips (default: on for CIFAR-10 only)",
    )
    p.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also measure test accuracy every this many steps (0: at epoch ends only)",
    )
    p.add_argument("--checkpoint", default=None, help="save the final model here")
    p.add_argument("--seed", type=int, default=0)
    return p


def total_steps(args: argparse.Namespace, steps_per_epoch: int) -> int:
    """Optimiser steps of the whole run: the schedule anneals the rate to 0 at the last."""
    steps = args.epochs * steps_per_epoch
    return min(steps, args.max_steps) if args.max_steps else steps


def look(
    evaluate: Callable[[torch.nn.Module, Any], torch.Tensor],
    model: torch.nn.Module,
    loader: Any,
    step: int,
    seconds: float,
    reports: bool,
) -> float:
    """Test accuracy after ``step`` steps and ``seconds`` of training, as a metrics event
    (notebook 4 plots it against time); returns the seconds the evaluation took, which the
    caller leaves out of its training time. ``evaluate`` is the script's own (summed over
    ranks in the data-parallel scripts)."""
    evaluated = time.perf_counter()
    _, correct, n = evaluate(model, loader).tolist()
    if reports:
        metrics.emit({"event": "eval", "step": step, "seconds": seconds, "val_acc": correct / n})
    return time.perf_counter() - evaluated


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, and fill in the defaults that depend on other options."""
    args = p.parse_args(argv)
    if args.augment is None:
        args.augment = args.dataset != "fashion-mnist"
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small CNN for Fashion-MNIST, a ResNet-style network for CIFAR-10."""
    if args.dataset == "fashion-mnist":  # no BatchNorm: see the equivalence test in notebook 2
        return models.build("fmnist_cnn", width=args.width, batch_norm=False)
    return models.build("resnet_cifar", width=args.width)
