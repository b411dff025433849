"""Train a small classifier on Fashion-MNIST or CIFAR-10 with Horovod.

train_serial.py made data-parallel with Horovod; each change is marked [1]..[7].

    horovodrun -np 2 -H localhost:2 --gloo python train_horovod.py
    mpirun -np 2 python train_horovod.py
"""

import argparse

import horovod.torch as hvd  # [1]
import torch

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
    hvd.init()  # [1] Horovod's own communication (MPI or Gloo), started by horovodrun or mpirun
    torch.manual_seed(args.seed)
    device = profile.device()  # [2] pin: one GPU per process, cuda:hvd.local_rank()
    if device.type == "cuda":
        torch.cuda.set_device(hvd.local_rank())  # [2]

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    # [3] each rank its own shard; the Trainer calls train.set_epoch(e): a new shuffle per epoch
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device,
                                      rank=hvd.rank(), world_size=hvd.size())  # [3]
    test = TensorLoader.from_dataset(ds, "test", 512, device=device,  # [3] exact evaluation
                                     rank=hvd.rank(), world_size=hvd.size())

    model = build_model(args).to(device)
    torch.manual_seed(args.seed + hvd.rank())  # [2] different augmentations on each rank
    lr = args.lr * hvd.size()  # [5] N× the batch per step: N× the learning rate
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    # [4] average gradients with all-reduce during backward; start every rank from rank 0's state
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # [4]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # [4]
    timer = StepTimer(args.max_steps)
    trainer = Trainer(model, optimizer, callbacks=[timer], max_seconds=args.max_seconds,
                      checkpoint_path=args.checkpoint)  # [6] logs and saves on rank 0 only
    history = trainer.fit(train, args.epochs, val_loader=test)

    timing = hvd.allreduce(torch.tensor([timer.steps, timer.seconds], dtype=torch.float64),
                           op=hvd.Average, name="timing")  # [7] averaged over ranks
    global_batch = args.batch_size * hvd.size()
    samples_per_s = float(timing[0]) * global_batch / max(float(timing[1]), 1e-9)
    summary = {"event": "summary", "script": "horovod", "world_size": hvd.size(),
               "launcher": dist.detect().launcher, "steps": trainer.step, "lr": lr,
               "global_batch": global_batch, "samples_per_s": samples_per_s,
               "train_loss": history.last["train_loss"], "val_acc": history.last["val_acc"]}
    metrics.emit(summary)  # [6] rank 0 writes
    if hvd.rank() == 0:  # [6]
        print(f"{trainer.step} steps, {samples_per_s:.0f} samples/s, "
              f"val_acc {summary['val_acc']:.2%}", flush=True)


if __name__ == "__main__":
    main()
