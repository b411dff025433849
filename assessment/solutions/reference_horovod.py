"""Reference solution with Horovod (for instructors).

The starter, made data-parallel with Horovod; run it with ``horovodrun -np N`` or
``mpirun -np N``. The same steps as the DDP reference, the Horovod way:

1. ``hvd.init()``; one GPU per process (``hvd.local_rank()``) when there are GPUs;
2. rank 0's initial weights and optimiser state are broadcast to everyone;
3. ``hvd.DistributedOptimizer`` averages the gradients (all-reduce) before each step;
4. each rank trains on its own shard with a tensor-resident ``TensorLoader``;
5. learning rate scaled with the global batch and warmed up over half an epoch;
6. exact evaluation: every rank counts its part of the test set and
   ``lab_utils.train.evaluate`` sums the counts with Horovod's all-reduce;
7. rank 0 alone saves ``checkpoint.pt``.
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from assessment.starter import CHECKPOINT, RECIPES, VALIDATION_SHARE, parse_args
from lab_utils import data, models, optim
from lab_utils import profile as lprofile
from lab_utils.loader import TensorLoader
from lab_utils.train import evaluate

# Each process takes the starter's batch, except on Fashion-MNIST (the CPU target):
# there 128 per process instead of 64 halves the all-reduces and computes a little
# more efficiently on one core. The learning rate follows the global batch.
PER_PROCESS_BATCH = {"fashion-mnist": 128}


def print0(*args: object) -> None:
    if hvd.rank() == 0:
        print(*args, flush=True)


def join() -> torch.device:
    """Phase 1: join the job; one GPU per process where there are GPUs."""
    hvd.init()
    lprofile.configure_threads()  # share the cores between the local processes
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        return torch.device("cuda", hvd.local_rank())
    return torch.device("cpu")


def build_model(recipe: dict, ds: data.Dataset, device: torch.device, seed: int) -> torch.nn.Module:
    """Phase 2: the model (rank 0's weights are broadcast with the optimiser below)."""
    torch.manual_seed(seed)
    model = models.build(
        recipe["arch"],
        in_channels=ds.x_train.shape[1],
        num_classes=len(ds.classes),
        **recipe["kwargs"],
    ).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def make_loaders(
    recipe: dict, ds: data.Dataset, per_process: int, seed: int, device: torch.device
) -> tuple[TensorLoader, TensorLoader]:
    """Phase 3: this rank's shard of every epoch, and its part of the test images."""
    cuda = device.type == "cuda"
    train_loader = TensorLoader.from_dataset(
        ds,
        "train",
        per_process,
        shuffle=True,
        seed=seed,
        rank=hvd.rank(),
        world_size=hvd.size(),
        drop_last=True,
        augment=recipe["augment"],
        crop_pad=4,
        device=device,
        channels_last=cuda,
    )
    test_loader = TensorLoader.from_dataset(
        ds, "test", 1000, rank=hvd.rank(), world_size=hvd.size(), device=device, channels_last=cuda
    )
    return train_loader, test_loader


def make_optimizer(
    model: torch.nn.Module, recipe: dict, batch: int, steps_per_epoch: int, epochs: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, float]:
    """Phase 4: rank 0's weights and optimiser state to everyone, gradients averaged by
    Horovod's optimiser, the learning rate scaled with the global ``batch`` and warmed
    up over half an epoch: (optimizer, schedule, lr)."""
    lr = optim.scale_lr(recipe["lr"], recipe["batch_size"], batch, "linear")
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        optim.lr_schedule(
            epochs * steps_per_epoch,
            warmup_steps=max(1, steps_per_epoch // 2),
            warmup_start=recipe["batch_size"] / batch,
            decay="linear",
        ),
    )
    return optimizer, schedule, lr


def train(
    model: torch.nn.Module,
    train_loader: TensorLoader,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    epochs: int,
    autocast_dtype: torch.dtype | None,
    start: float,
) -> None:
    """Phase 5: the training loop; Horovod all-reduces each gradient as it is ready."""
    device_type = next(model.parameters()).device.type
    for epoch in range(epochs):
        train_loader.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_loader):
            with torch.autocast(
                device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None
            ):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()  # Horovod's wrapper takes no arguments
            loss.backward()  # Horovod starts all-reducing each gradient as it is ready
            optimizer.step()  # ... and waits for the averages here
            schedule.step()
            if step % 100 == 0:
                print0(
                    f"epoch {epoch + 1} step {step}/{len(train_loader)} loss "
                    f"{loss.item():.4f}  {time.perf_counter() - start:.0f}s"
                )


def finish(
    model: torch.nn.Module,
    test_loader: TensorLoader,
    autocast_dtype: torch.dtype | None,
    start: float,
) -> None:
    """Phase 6: exact evaluation over all ranks, rank 0 saves, everyone leaves together."""
    result = evaluate(model, test_loader, autocast_dtype=autocast_dtype)  # sums with hvd.allreduce
    print0(
        f"validation accuracy {result['acc']:.2%} on {result['n']} images after "
        f"{time.perf_counter() - start:.0f}s"
    )
    if hvd.rank() == 0:
        models.save(CHECKPOINT, model)
    hvd.barrier()  # every rank waits until rank 0 has saved
    hvd.shutdown()


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    recipe = RECIPES[args.dataset]
    per_process = PER_PROCESS_BATCH.get(args.dataset, recipe["batch_size"])
    epochs = args.epochs or recipe["epochs"]
    start = time.perf_counter()
    device = join()
    # The test split is the grader's (its sandbox shows the training split alone):
    # accuracy is reported on a validation part of the training split.
    ds = data.load(args.dataset).holdout(VALIDATION_SHARE)
    model = build_model(recipe, ds, device, args.seed)
    torch.manual_seed(args.seed + hvd.rank())  # a different augmentation stream per rank
    train_loader, test_loader = make_loaders(recipe, ds, per_process, args.seed, device)
    k = hvd.size()
    batch = per_process * k  # the global batch of one step
    optimizer, schedule, lr = make_optimizer(model, recipe, batch, len(train_loader), epochs)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    print0(
        f"{ds.name}: {len(ds.x_train)} training images, {recipe['arch']}, {epochs} epochs, "
        f"batch {per_process} x {k} Horovod processes, lr {lr:g}"
    )
    train(model, train_loader, optimizer, schedule, epochs, autocast_dtype, start)
    finish(model, test_loader, autocast_dtype, start)


if __name__ == "__main__":
    main()
