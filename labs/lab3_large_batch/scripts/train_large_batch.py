"""Data-parallel training with the large-batch recipe of Lab 3.

N workers with ``--batch-per-worker b`` train with a global batch of N·b. The recipe
adapts the learning rate to that global batch (``--scale linear`` by default, from
``--base-lr`` tuned at ``--base-batch``), warms it up over ``--warmup-epochs`` and
decays it with a cosine; ``--optimizer lars`` or ``lamb`` takes over where plain SGD
stops scaling. Runs under torchrun, mpirun, horovodrun or alone:

    torchrun --standalone --nproc-per-node 2 train_large_batch.py --batch-per-worker 256

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    epoch: epoch, step, train_loss, train_acc, lr, val_loss, val_acc, time
        (lab_utils.train.Trainer, after each epoch)
    summary: world_size, global_batch, lr, optimizer, updates, test_acc
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import data, gloo_exit, metrics, models, optim, paths, profile
from lab_utils import dist as labdist
from lab_utils.loader import TensorLoader
from lab_utils.train import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    S = paths.lab_module("lab3", "settings").RECIPE.of()  # the profile's defaults
    p = profile.script_parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=S.epochs)
    p.add_argument("--batch-per-worker", type=int, default=S.batch_per_worker)
    p.add_argument(
        "--base-batch",
        type=int,
        default=S.base_batch,
        help="the batch size --base-lr was tuned for",
    )
    p.add_argument("--base-lr", type=float, default=S.base_lr)
    p.add_argument(
        "--scale",
        choices=optim.SCALING_RULES,
        default="linear",
        help="how the learning rate follows the global batch",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="use this learning rate instead of a scaling rule (LARS, LAMB)",
    )
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--optimizer", choices=("sgd", "lars", "lamb"), default="sgd")
    p.add_argument(
        "--n-train",
        type=int,
        default=S.n_train,
        help="training images (0: all)",
    )
    p.add_argument("--n-test", type=int, default=S.n_test, help="test images (0: all)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "lars":
        return optim.LARS(model.parameters(), lr=lr, momentum=0.9, exclude_bias_and_norm=True)
    if name == "lamb":
        return optim.LAMB(model.parameters(), lr=lr, exclude_bias_and_norm=True)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def main(argv: list[str] | None = None) -> dict:
    """Train, print and emit the summary (rank 0), and return it."""
    args = parse_args(argv)
    info = labdist.init()
    if info.distributed:  # a group was joined (notebook 3 also calls main() in its kernel)
        # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on
        # it ends by os._exit with Python's own status (sys.exit, atexit.register and
        # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
        gloo_exit.arm()
    device = info.device
    ds = data.load("fashion-mnist").subset(args.n_train or None, args.n_test or None)
    train = TensorLoader.from_dataset(
        ds,
        "train",
        args.batch_per_worker,
        seed=args.seed,
        device=device,
        rank=info.rank,
        world_size=info.world_size,
    )
    test = TensorLoader.from_dataset(
        ds, "test", 1024, device=device, rank=info.rank, world_size=info.world_size
    )
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts)
    model = models.build("mlp", hidden=(256, 128)).to(device)  # no BatchNorm: exact N·b batch
    if info.distributed:  # one worker alone has no process group and needs no DDP
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    global_batch = args.batch_per_worker * info.world_size
    lr = args.lr or optim.scale_lr(args.base_lr, args.base_batch, global_batch, args.scale)
    optimizer = make_optimizer(args.optimizer, model, lr)
    steps = len(train) * args.epochs
    warm = round(args.warmup_epochs * len(train))
    factor = optim.lr_schedule(
        steps,
        warmup_steps=warm,
        decay="cosine",
        warmup_start=min(1.0, args.base_batch / global_batch),
    )
    trainer = Trainer(model, optimizer, scheduler=optim.lambda_lr(optimizer, factor))
    history = trainer.fit(train, args.epochs, val_loader=test)

    summary = {
        "event": "summary",
        "world_size": info.world_size,
        "global_batch": global_batch,
        "lr": lr,
        "optimizer": args.optimizer,
        "updates": trainer.step,
        "test_acc": history.last["val_acc"],
    }
    metrics.emit(summary)
    workers = f"{info.world_size} worker{'s' if info.world_size > 1 else ''}"
    labdist.print0(
        f"{workers} × batch {args.batch_per_worker} = {global_batch}, "
        f"{args.optimizer} lr {lr:g}: {trainer.step} updates, "
        f"test accuracy {summary['test_acc']:.2%}"
    )
    labdist.shutdown()
    return summary


if __name__ == "__main__":
    main()
