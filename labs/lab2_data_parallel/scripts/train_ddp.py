"""Train a small classifier on Fashion-MNIST or CIFAR-10 with DistributedDataParallel.

train_serial.py made data-parallel; each change is marked [1]..[7]. It runs under
torchrun, mpirun, horovodrun, srun or alone:

    torchrun --standalone --nproc-per-node 2 train_ddp.py --dataset fashion-mnist
    mpirun -np 2 python train_ddp.py
"""

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP  # [4]

from lab_utils import data, dist, metrics, models, profile  # [1]
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
    p.add_argument("--lr", type=float, default=0.05,  # [5]
                   help="learning rate of one process; N processes use N × lr")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,  # [4]
                   help="DDP gradient bucket size in MB")
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
    info = dist.init()  # [1] join the job: rank, world size, Gloo (CPU) or NCCL (GPU)
    torch.manual_seed(args.seed)
    device = info.device  # [2] this rank's GPU (cuda:local_rank), or the CPU with cores/ranks threads

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    # [3] each rank its own shard; the Trainer calls train.set_epoch(e): a new shuffle per epoch
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device,
                                      rank=info.rank, world_size=info.world_size)  # [3]
    test = TensorLoader.from_dataset(ds, "test", 512, device=device,  # [3] exact evaluation
                                     rank=info.rank, world_size=info.world_size)

    model = build_model(args).to(device)
    torch.manual_seed(args.seed + info.rank)  # [2] different augmentations on each rank
    lr = args.lr * info.world_size  # [5] N× the batch per step: N× the learning rate
    if info.distributed:  # [4] DDP copies rank 0's weights, then all-reduces gradients in buckets
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    timer = StepTimer(args.max_steps)
    trainer = Trainer(model, optimizer, callbacks=[timer], max_seconds=args.max_seconds,
                      checkpoint_path=args.checkpoint)  # [6] logs and saves on rank 0 only
    history = trainer.fit(train, args.epochs, val_loader=test)

    timing = dist.average_metrics({"steps": timer.steps, "seconds": timer.seconds})  # [7]
    global_batch = args.batch_size * info.world_size
    samples_per_s = timing["steps"] * global_batch / max(timing["seconds"], 1e-9)
    summary = {"event": "summary", "script": "ddp", "world_size": info.world_size,
               "launcher": info.launcher, "steps": trainer.step, "lr": lr,
               "global_batch": global_batch, "samples_per_s": samples_per_s,
               "train_loss": history.last["train_loss"], "val_acc": history.last["val_acc"]}
    metrics.emit(summary)  # [6] rank 0 writes
    dist.print0(f"{trainer.step} steps, {samples_per_s:.0f} samples/s, "  # [6]
                f"val_acc {summary['val_acc']:.2%}")
    dist.shutdown()  # [1] barrier, then leave the process group


if __name__ == "__main__":
    main()
