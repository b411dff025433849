"""Train a small classifier on Fashion-MNIST or CIFAR-10 with DistributedDataParallel.

train_serial.py made data-parallel; each change is marked [1]..[7]. It runs under
torchrun, mpirun, horovodrun, srun or alone:

    torchrun --standalone --nproc-per-node 2 train_ddp.py --dataset fashion-mnist
    mpirun -np 2 python train_ddp.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    eval: step, seconds, val_acc (each evaluation, common.look)
    summary: script, world_size, launcher, steps, lr, global_batch, samples_per_s,
        train_loss, val_acc, train_seconds
"""

import os  # [1]
import sys  # [2]
import time
from datetime import timedelta  # [1]

import common
import torch
import torch.distributed as dist  # [1]
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # [4]

import lab_utils.gloo_exit as gloo_exit  # [1]
from lab_utils import data, metrics, models, optim  # [5]
from lab_utils.dist import set_torch_env_from_launcher  # [1]
from lab_utils.loader import TensorLoader


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TensorLoader) -> torch.Tensor:
    """Sums over the test set: loss, correct predictions, images."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=loader.device)
    for x, y in loader:
        out = model(x)
        sums += torch.stack([F.cross_entropy(out, y, reduction="sum"),
                             (out.argmax(1) == y).sum(), torch.tensor(len(y), device=x.device)])
    model.train()
    dist.all_reduce(sums)  # [7] add up every rank's part of the test set
    return sums



def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--lr-scaling", choices=optim.SCALING_RULES, default="linear",  # [5]
                   help="N processes use N × lr (linear), √N × lr (sqrt) or lr (none)")
    p.add_argument("--warmup-epochs", type=float, default=common.WARMUP_EPOCHS,  # [5]
                   help="epochs over which the learning rate rises from lr to its scaled value")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,  # [4]
                   help="DDP gradient bucket size in MB")
    args = common.parse_args(p)
    # [1] mpirun/srun/horovodrun: set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* as torchrun does
    launcher = set_torch_env_from_launcher().launcher
    # [1] Gloo's threads (torch 2.13) can abort or hang a rank at exit: it now ends by os._exit
    # with Python's status (sys.exit, atexit.register, destroy_process_group wrapped: gloo_exit.py)
    gloo_exit.arm()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # [1]
    local_rank = int(os.environ["LOCAL_RANK"])  # [2] this process's index on its machine
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():  # [2] one GPU per process
        if local_rank >= torch.cuda.device_count():  # [2] NCCL needs one GPU per rank
            sys.exit(f"local rank {local_rank}: NCCL needs one GPU per rank; this has fewer")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:  # [2] or a fair share of the CPU cores
        device = torch.device("cpu")
        torch.set_num_threads(max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))
    backend = "nccl" if device.type == "cuda" else "gloo"  # [1]
    timeout = timedelta(seconds=120)  # [1] a collective that waits longer fails the job
    dist.init_process_group(backend, timeout=timeout)  # [1]

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device,
                                      rank=rank, world_size=world_size)  # [3] my shard
    test = TensorLoader.from_dataset(ds, "test", 512, device=device,
                                     rank=rank, world_size=world_size)  # [3] my part

    model = common.build_model(args).to(device)
    torch.manual_seed(args.seed + rank)  # [2] different augmentations on each rank
    # [4] DDP copies rank 0's weights to all, then all-reduces gradients in buckets
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    # [5] N× the batch per step: N× the learning rate (linear scaling, Goyal et al.; Lab 3),
    #     reached by a gradual warm-up from the one-process rate, then annealed as before
    lr = optim.scale_lr(args.lr, args.batch_size, args.batch_size * world_size, args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    total = common.total_steps(args, len(train))  # the rate follows a cosine down to 0
    warm = min(total, round(args.warmup_epochs * len(train)))  # [5]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_schedule(
        total, warmup_steps=warm, warmup_start=args.lr / lr, decay="cosine"))  # [5]

    step, start, paused = 0, time.perf_counter(), 0.0  # paused: seconds spent evaluating
    for epoch in range(args.epochs):
        train.set_epoch(epoch)  # a new shuffle every epoch
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, steps
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()  # [5]
            step += 1
            train_sums += torch.stack([loss.detach().double(), torch.ones((), device=device)])
            if step == 1:
                start = time.perf_counter()  # time from the second step: the first warms up
            if args.eval_every and step % args.eval_every == 0:  # accuracy against time
                trained = time.perf_counter() - start - paused
                paused += common.look(evaluate, model.module, test, step, trained, rank == 0)  # [6]
            if step == args.max_steps:
                break
        seconds = time.perf_counter() - start - paused  # training time: evaluations left out
        dist.all_reduce(train_sums)  # [7] the loss averaged over all ranks
        loss_sum, n_steps = train_sums.tolist()
        evaluated = time.perf_counter()
        test_loss, correct, n = evaluate(model.module, test).tolist()  # [4] unwrapped
        paused += time.perf_counter() - evaluated
        if rank == 0:  # [6] one rank reports
            print(f"epoch {epoch + 1}: train_loss {loss_sum / n_steps:.4f}  "
                  f"val_loss {test_loss / n:.4f}  val_acc {correct / n:.2%}", flush=True)
        if step == args.max_steps:
            break

    if args.checkpoint and rank == 0:  # [6] one rank saves
        models.save(args.checkpoint, model.module)
    global_batch = args.batch_size * world_size  # [7] samples per step, all ranks together
    samples_per_s = (step - 1) * global_batch / max(seconds, 1e-9)
    summary = {"event": "summary", "script": "ddp", "world_size": world_size, "launcher": launcher,
               "steps": step, "lr": lr, "global_batch": global_batch, "samples_per_s": samples_per_s,
               "train_loss": loss_sum / n_steps, "val_acc": correct / n, "train_seconds": seconds}
    if rank == 0:  # [6] one rank writes and prints
        metrics.emit(summary)
        print(f"{step} steps, {samples_per_s:.0f} samples/s, val_acc {correct / n:.2%}",
              flush=True)
    # [1] leave together, then free the default group (the process then ends without an
    #     abort at exit: set_torch_env_from_launcher arranged it)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
