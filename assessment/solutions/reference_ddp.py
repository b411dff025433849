"""Reference solution with DistributedDataParallel (for instructors).

The starter, made data-parallel with what the course teaches:

1. join the job with ``lab_utils.dist.init()`` (torchrun, mpirun or one process;
   Gloo on CPU, NCCL with one GPU per process);
2. wrap the model in ``DistributedDataParallel``;
3. give each rank its shard of every epoch with a tensor-resident ``TensorLoader``
   (no per-sample Python, batches augmented on the device);
4. scale the learning rate with the global batch (linear rule) and warm it up from
   the single-process rate over the first half epoch (Goyal et al. 2017);
5. evaluate exactly on the whole test set, each rank on its own part;
6. rank 0 alone saves ``checkpoint.pt``; everyone leaves through ``dist.shutdown()``.

On CUDA it also trains in bfloat16 autocast with channels-last images.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import data, dist, models, optim
from lab_utils.loader import TensorLoader
from lab_utils.train import evaluate

CHECKPOINT = "checkpoint.pt"

# The starter's recipe (batch_size and lr are its single-process values) and the
# batch of each process here. On CPU a batch of 128 per process halves the number
# of all-reduces and computes a little more efficiently than 64; the learning rate
# follows the global batch.
RECIPES = {
    "fashion-mnist": {"arch": "fmnist_cnn", "kwargs": {"width": 16}, "epochs": 3,
                      "batch_size": 64, "lr": 0.05, "augment": False, "per_process_batch": 128},
    "cifar10": {"arch": "resnet_cifar", "kwargs": {"width": 64}, "epochs": 16,
                "batch_size": 256, "lr": 0.2, "augment": True, "per_process_batch": 256},
    "synthetic-cifar10": {"arch": "resnet_cifar", "kwargs": {"width": 16}, "epochs": 2,
                          "batch_size": 64, "lr": 0.05, "augment": True, "per_process_batch": 64},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="cifar10", choices=sorted(RECIPES))
    p.add_argument("--budget", type=float, default=None, help="time budget (informative)")
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    recipe = RECIPES[args.dataset]
    epochs = args.epochs or recipe["epochs"]
    start = time.perf_counter()
    info = dist.init()
    cuda = info.device.type == "cuda"

    ds = data.load(args.dataset)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts)
    model = models.build(recipe["arch"], in_channels=ds.x_train.shape[1],
                         num_classes=len(ds.classes), **recipe["kwargs"]).to(info.device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    net = DDP(model, device_ids=[info.device.index] if cuda else None)
    torch.manual_seed(args.seed + info.rank)  # a different augmentation stream per rank

    train_loader = TensorLoader.from_dataset(
        ds, "train", recipe["per_process_batch"], shuffle=True, seed=args.seed, rank=info.rank,
        world_size=info.world_size, drop_last=True, augment=recipe["augment"], crop_pad=4,
        device=info.device, channels_last=cuda)
    test_loader = TensorLoader.from_dataset(ds, "test", 1000, rank=info.rank,
                                            world_size=info.world_size, device=info.device,
                                            channels_last=cuda)

    k = info.world_size
    batch = recipe["per_process_batch"] * k  # the global batch of one step
    lr = optim.scale_lr(recipe["lr"], recipe["batch_size"], batch, "linear")
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    total_steps = epochs * len(train_loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_schedule(
        total_steps, warmup_steps=max(1, len(train_loader) // 2),
        warmup_start=recipe["batch_size"] / batch, decay="linear"))
    autocast_dtype = torch.bfloat16 if cuda else None
    dist.print0(f"{ds.name}: {len(ds.x_train)} training images, {recipe['arch']}, {epochs} "
                f"epochs, batch {recipe['per_process_batch']} x {k} processes ({info.launcher}, "
                f"{info.backend}), lr {lr:g}", flush=True)

    for epoch in range(epochs):
        train_loader.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            with torch.autocast(info.device.type, dtype=autocast_dtype,
                                enabled=autocast_dtype is not None):
                loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            schedule.step()
            if step % 100 == 0:
                dist.print0(f"epoch {epoch + 1} step {step}/{len(train_loader)} loss "
                            f"{loss.item():.4f}  {time.perf_counter() - start:.0f}s")

    result = evaluate(model, test_loader, autocast_dtype=autocast_dtype)
    dist.print0(f"test accuracy {result['acc']:.2%} on {result['n']} images after "
                f"{time.perf_counter() - start:.0f}s")
    if info.is_main:
        models.save(CHECKPOINT, model)
    dist.shutdown()


if __name__ == "__main__":
    main()
