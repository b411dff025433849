"""Command-line trainer: a registry model on a dataset, one process or data-parallel.

    lab-train --dataset fashion-mnist --arch fmnist_cnn --epochs 4 --checkpoint model.pt
    torchrun --standalone --nproc-per-node 2 -m lab_utils.cli --dataset fashion-mnist
    mpirun -np 2 python -m lab_utils.cli ...      horovodrun -np 2 python -m lab_utils.cli ...

Under a launcher it joins the job through :func:`lab_utils.dist.init`, wraps the model
in DistributedDataParallel, gives each rank its shard, scales the learning rate
with the world size (square-root rule by default, with warm-up), and evaluates exactly on the whole test set.
Defaults come from the run profile (``LABS_PROFILE`` or ``--profile``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import data, gloo_exit, models, optim
from . import dist as labdist
from . import profile as lprofile
from .loader import TensorLoader
from .train import Trainer

# Per-profile defaults: (train subset, test subset, epochs).
DEFAULTS = {
    "quick": {"n_train": 2000, "n_test": 1000, "epochs": 1},
    "cpu": {"n_train": None, "n_test": None, "epochs": 4},
    "gpu": {"n_train": None, "n_test": None, "epochs": 10},
}
DEFAULT_ARCH = {
    "fashion-mnist": "fmnist_cnn",
    "cifar10": "resnet_cifar",
    "synthetic-cifar10": "resnet_cifar",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lprofile.script_parser(__doc__.split("\n\n")[0])
    p.prog = "lab-train"
    _data_options(p)
    _optimiser_options(p)
    _speed_options(p)
    _run_options(p)
    return p.parse_args(argv)


def _data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        default="fashion-mnist",
        choices=["fashion-mnist", "cifar10", "synthetic-cifar10"],
    )
    p.add_argument("--data-root", default=None, help="folder holding the dataset files")
    p.add_argument(
        "--arch", default=None, help=f"registry model (default per dataset: {DEFAULT_ARCH})"
    )
    p.add_argument("--width", type=int, default=None, help="model width (channels), if it has one")
    p.add_argument("--profile", default=None, choices=list(lprofile.PROFILES))
    p.add_argument("--n-train", type=int, default=None, help="use a subset of the training set")
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random crop + flip (default: on for CIFAR-10)",
    )


def _optimiser_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--lr", type=float, default=0.05, help="for one process; scaled by world size")
    p.add_argument(
        "--lr-scaling",
        choices=optim.SCALING_RULES,
        default="linear",
        help="N processes use N × lr (linear, with the warm-up: Lab 3's rule), "
        "√N × lr (sqrt) or lr (none)",
    )
    p.add_argument("--no-lr-scaling", action="store_true", help="same as --lr-scaling none")
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def _speed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bfloat16 autocast (default: on for a CPU with native bfloat16 "
        "instructions, AVX512-BF16 or AMX; off otherwise)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="channels-last memory format for images and weights (faster "
        "convolutions with oneDNN on CPUs and with cuDNN)",
    )
    p.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", default="checkpoint.pt", help="final model {arch, kwargs, state_dict}"
    )
    p.add_argument("--resume", default=None, help="resume from an --epoch-checkpoint file")
    p.add_argument(
        "--epoch-checkpoint",
        default=None,
        metavar="PATH",
        help="write a resumable checkpoint (model, optimiser, schedule, epoch, RNG) "
        "to PATH after every epoch",
    )
    p.add_argument("--metrics", default=None, help="JSON-lines metrics file")
    p.add_argument(
        "--eval-every-epoch",
        action="store_true",
        help="also evaluate on the test set after every epoch (val_acc in the metrics)",
    )
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 autocast speeds up training on ``device``'s CPU.

    Only CPUs with bfloat16 instructions (AVX512-BF16, AMX) gain; on others oneDNN
    emulates bfloat16 and autocast makes training slower, so it stays off.
    """
    if device.type != "cpu":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def main(argv: list[str] | None = None) -> int:
    """Train and test as the options say; 0 when done. A rank of a launched job (it
    armed ``gloo_exit``) does not return: it ends through the armed ``sys.exit(0)``."""
    args = parse_args(argv)
    prof = lprofile.current(args.profile)
    info = labdist.init()
    if info.distributed:
        # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on
        # it ends by os._exit with Python's own status (sys.exit, atexit.register and
        # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why). A
        # single process (main() called from Python, as the tests do) is left as it is.
        gloo_exit.arm()
    defaults = DEFAULTS[prof.name]
    epochs = args.epochs or defaults["epochs"]
    torch.manual_seed(args.seed)
    ds = data.load(args.dataset, root=args.data_root).subset(
        n_train=args.n_train or defaults["n_train"],
        n_test=args.n_test or defaults["n_test"],
        seed=args.seed,
    )
    arch = args.arch or DEFAULT_ARCH[args.dataset]
    model = _model(args, arch, ds, info)
    bf16 = args.bf16 if args.bf16 is not None else native_bf16(info.device)
    train_loader, test_loader = _loaders(args, ds, info)
    trainer, lr = _trainer(args, model, info, epochs * len(train_loader), len(train_loader), bf16)
    if args.resume:
        trainer.load_checkpoint(args.resume)
    labdist.print0(
        f"{prof} | {info.launcher} world_size={info.world_size} | {ds.name}: "
        f"{len(ds.x_train)} train / {len(ds.x_test)} test | {arch} | "
        f"batch {args.batch_size}x{info.world_size} lr {lr:g} | {epochs} epochs | "
        f"{'bf16 autocast' if bf16 else 'fp32'}"
        f"{', channels-last' if args.channels_last else ''}"
    )
    start = time.perf_counter()
    result = _fit_and_test(args, trainer, train_loader, test_loader, epochs, len(ds.x_test))
    seconds = time.perf_counter() - start
    labdist.print0(
        f"test accuracy {result['acc']:.2%} (loss {result['loss']:.4f}, "
        f"{result['n']} images) after {trainer.epoch} epochs in {seconds:.1f}s"
    )
    if info.is_main:
        _save(args, model, trainer, result, seconds, info.world_size)
    labdist.shutdown()
    if gloo_exit.armed():
        # End here, through the armed sys.exit: `sys.exit(main())` (this module's last line,
        # and pip's lab-train) looked sys.exit up before main() armed the hook, and Python's
        # own SystemExit would leave the hook without the status (gloo_exit.UNKNOWN_STATUS).
        sys.exit(0)
    return 0


def _model(
    args: argparse.Namespace, arch: str, ds: data.Dataset, info: labdist.DistInfo
) -> torch.nn.Module:
    kwargs = {"in_channels": ds.x_train.shape[1], "num_classes": len(ds.classes)}
    if args.width is not None:
        kwargs["width"] = args.width
    model = models.build(arch, **kwargs).to(info.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _loaders(
    args: argparse.Namespace, ds: data.Dataset, info: labdist.DistInfo
) -> tuple[TensorLoader, TensorLoader]:
    """This rank's shard of the training set (shuffled, even) and of the test set
    (uneven shards: every test image is evaluated exactly once)."""
    augment = args.augment if args.augment is not None else args.dataset != "fashion-mnist"
    shard = {"rank": info.rank, "world_size": info.world_size, "device": info.device}
    train = TensorLoader.from_dataset(
        ds,
        "train",
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        augment=augment,
        drop_last=True,
        channels_last=args.channels_last,
        **shard,
    )
    test = TensorLoader.from_dataset(
        ds,
        "test",
        1024,
        shuffle=False,
        even_shards=False,
        channels_last=args.channels_last,
        **shard,
    )
    return train, test


def _trainer(
    args: argparse.Namespace,
    model: torch.nn.Module,
    info: labdist.DistInfo,
    steps: int,
    steps_per_epoch: int,
    bf16: bool,
) -> tuple[Trainer, float]:
    """The trainer, with SGD at the rate scaled for the world size (and that rate)."""
    rule = "none" if args.no_lr_scaling else args.lr_scaling
    lr = optim.scale_lr(args.lr, args.batch_size, args.batch_size * info.world_size, rule)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=lr,
        momentum=args.momentum,
        nesterov=args.momentum > 0,
        weight_decay=args.weight_decay,
    )
    warm = min(steps, max(1, int(args.warmup_epochs * steps_per_epoch)))
    schedule = optim.lambda_lr(
        optimizer,
        optim.lr_schedule(  # from the one-process rate
            steps, warmup_steps=warm, warmup_start=args.lr / lr, decay="cosine"
        ),
    )
    trainer = Trainer(
        DDP(model) if info.distributed else model,
        optimizer,
        scheduler=schedule,
        max_seconds=args.max_seconds,
        progress=args.progress,
        metrics_path=args.metrics,
        checkpoint_path=args.epoch_checkpoint,
        loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
        autocast_dtype=torch.bfloat16 if bf16 else None,
    )
    return trainer, lr


def _fit_and_test(
    args: argparse.Namespace,
    trainer: Trainer,
    train_loader: TensorLoader,
    test_loader: TensorLoader,
    epochs: int,
    n_test: int,
) -> dict:
    """Train, then the test accuracy of the final model."""
    before = len(trainer.history.epochs)
    trainer.fit(train_loader, epochs, val_loader=test_loader if args.eval_every_epoch else None)
    last = trainer.history.epochs[-1] if len(trainer.history.epochs) > before else {}
    if "val_acc" in last:  # the last epoch already evaluated the final model on the test set
        return {"acc": last["val_acc"], "loss": last["val_loss"], "n": n_test}
    return trainer.evaluate(test_loader)


def _save(
    args: argparse.Namespace,
    model: torch.nn.Module,
    trainer: Trainer,
    result: dict,
    seconds: float,
    world_size: int,
) -> None:
    """Rank 0: the final record in the metrics, and the checkpoint."""
    from . import metrics

    metrics.emit(
        {
            "event": "final",
            "test_acc": result["acc"],
            "test_loss": result["loss"],
            "seconds": seconds,
            "epochs": trainer.epoch,
            "world_size": world_size,
        },
        args.metrics,
    )
    if args.checkpoint:
        Path(args.checkpoint).parent.mkdir(parents=True, exist_ok=True)
        models.save(args.checkpoint, model, test_acc=result["acc"], epochs=trainer.epoch)
        print(f"saved {args.checkpoint}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
