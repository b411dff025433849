"""Train a small classifier on Fashion-MNIST or CIFAR-10 in one process.

The serial baseline of Lab 2: train_ddp.py and train_horovod.py are this script
with the changes that make it data-parallel.

    python train_serial.py --dataset fashion-mnist --epochs 2
"""

import argparse

import torch

from lab_utils import data, metrics, models, profile
from lab_utils.loader import TensorLoader
from lab_utils.train import StepTimer, Trainer


def parse_args(argv=None) -> argparse.Namespace:
    P = profile.current()  # LABS_PROFILE=quick|cpu|gpu picks the defaults
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget")
    p.add_argument("--checkpoint", default=None, help="save a checkpoint here after every epoch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.augment is None:
        args.augment = args.dataset != "fashion-mnist"
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.dataset == "fashion-mnist":  # no BatchNorm: see the equivalence test in the notebook
        return models.build("fmnist_cnn", width=args.width, batch_norm=False)
    return models.build("resnet_cifar", width=args.width)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = profile.device()

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device)
    test = TensorLoader.from_dataset(ds, "test", 512, device=device)

    model = build_model(args).to(device)
    lr = args.lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    timer = StepTimer(args.max_steps)
    trainer = Trainer(model, optimizer, callbacks=[timer], max_seconds=args.max_seconds,
                      checkpoint_path=args.checkpoint)
    history = trainer.fit(train, args.epochs, val_loader=test)

    samples_per_s = timer.steps * args.batch_size / max(timer.seconds, 1e-9)
    summary = {"event": "summary", "script": "serial", "world_size": 1, "steps": trainer.step,
               "lr": lr, "global_batch": args.batch_size, "samples_per_s": samples_per_s,
               "train_loss": history.last["train_loss"], "val_acc": history.last["val_acc"]}
    metrics.emit(summary)
    print(f"{trainer.step} steps, {samples_per_s:.0f} samples/s, "
          f"val_acc {summary['val_acc']:.2%}", flush=True)


if __name__ == "__main__":
    main()
