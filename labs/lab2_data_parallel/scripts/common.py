"""What the three Lab 2 training scripts share: their options and their model.

train_serial.py, train_ddp.py and train_horovod.py parse the same options here, so
their diffs show only what data parallelism changes. Defaults follow the run
profile (``LABS_PROFILE=quick|cpu|gpu``).
"""

from __future__ import annotations

import argparse

import torch

from lab_utils import data, models, profile


def parser(description: str) -> argparse.ArgumentParser:
    """The options every Lab 2 training script takes (a script may add its own)."""
    P = profile.current()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dataset", choices=data.NAMES,
                   default=P.pick(quick="fashion-mnist", cpu="fashion-mnist", gpu="cifar10"))
    p.add_argument("--epochs", type=int, default=P.pick(quick=1, cpu=2, gpu=10))
    p.add_argument("--batch-size", type=int, default=P.pick(quick=64, cpu=128, gpu=256),
                   help="samples per step and process")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of one process")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--n-train", type=int, default=P.pick(quick=2048, cpu=20000, gpu=0),
                   help="training images to use (0: all)")
    p.add_argument("--n-test", type=int, default=P.pick(quick=1024, cpu=5000, gpu=0),
                   help="test images to use (0: all)")
    p.add_argument("--width", type=int, default=P.pick(quick=16, cpu=32, gpu=64),
                   help="channels of the first layer")
    p.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                   help="random crops and flips (default: on for CIFAR-10 only)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--checkpoint", default=None, help="save the final model here")
    p.add_argument("--seed", type=int, default=0)
    return p


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
