"""Data-parallel training that survives a killed rank: checkpoint, restart, resume.

Run it under ``torchrun --max-restarts N``: when a rank dies, torchrun stops the
others and starts every rank again; each resumes from the last checkpoint. Every
batch is a function of the global step alone (a per-epoch permutation, cut into
global batches, one slice per rank), so a resumed run replays exactly the batches the
lost one would have seen, and on CPU its final weights equal an uninterrupted run's.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 elastic_train.py \\
        --ckpt-every 20 --kill-at 50 --out final.pt

``--kill-at STEP`` makes rank ``--kill-rank`` SIGKILL itself at that step, on the first
attempt only. Rank 0 emits JSON records: ``elastic_start`` (attempt, step resumed
from), ``elastic_ckpt`` and ``elastic_done`` (steps, wall time, a checksum of the weights).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import metrics, models, profile, tensordata


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="global steps to train")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--n-train", type=int, default=10000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints (0: none)")
    p.add_argument("--ckpt-dir", default="elastic_ckpt", help="where the checkpoint lives")
    p.add_argument("--kill-at", type=int, default=-1, help="step at which a rank kills itself")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--out", default="", help="final weights (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 0:
        p.error("--steps must be >= 1 and --ckpt-every >= 0")
    return args


def batch_for(step: int, n: int, batch: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's sample indices at global step ``step`` (epoch = step // steps_per_epoch)."""
    per_epoch = n // (batch * world)
    if per_epoch < 1:
        raise ValueError(f"{n} samples cannot fill one global batch of {batch * world}")
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * world + rank) * batch
    return perm[start:start + batch]


def save_atomic(state: dict, path: Path) -> None:
    """Write to a temporary file, then rename: a kill never leaves half a checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def init_attempt(attempt: int) -> tuple[int, int, torch.device]:
    """Join this attempt's process group; returns (rank, world size, device).

    torchrun keeps one key-value store for the whole job. A restarted attempt must not
    read the addresses that the dead attempt's ranks left there (its Gloo ranks would
    try to connect to a process that no longer exists), so each attempt rendezvouses
    under a prefix of its own.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    profile.configure_threads()
    device = profile.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Bit-exact resumes on GPUs need deterministic kernels (cuBLAS wants a fixed workspace).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if world == 1:
        return 0, 1, device
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                           is_master=False, timeout=timedelta(seconds=60))
    # NCCL wants one GPU per rank; ranks that share a GPU (or have none) talk through Gloo.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nccl = device.type == "cuda" and local <= torch.cuda.device_count()
    tdist.init_process_group("nccl" if nccl else "gloo",
                             store=tdist.PrefixStore(f"attempt{attempt}", store),
                             rank=rank, world_size=world, timeout=timedelta(seconds=60))
    return rank, world, device


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world, device = init_attempt(attempt)
    main_rank = rank == 0
    ckpt = Path(args.ckpt_dir) / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    data = tensordata.load(args.n_train, args.n_test, seed=args.seed)
    x, y = data.x_train.to(device), data.y_train.to(device)

    torch.manual_seed(args.seed)
    net = models.build("mlp", hidden=(args.hidden,)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    step = 0
    if ckpt.exists():  # resume: weights, optimizer state (momentum) and the step
        state = torch.load(ckpt, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    model = DDP(net) if world > 1 else net
    metrics.emit({"event": "elastic_start", "attempt": attempt, "step": step, "time": started})
    if main_rank:
        print(f"attempt {attempt}: starting at step {step}", flush=True)

    while step < args.steps:
        if step == args.kill_at and attempt == 0 and rank == args.kill_rank:
            print(f"rank {rank}: SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        idx = batch_for(step, len(x), args.batch_size, rank, world, args.seed)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()  # DDP averages the gradients
        opt.step()
        step += 1
        if args.ckpt_every and step % args.ckpt_every == 0 and main_rank:
            save_atomic({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt)
            metrics.emit({"event": "elastic_ckpt", "step": step, "time": time.time()})

    acc = tensordata.accuracy(net, data.x_test, data.y_test)
    if main_rank and args.out:
        models.save(args.out, net, step=step)
    metrics.emit({"event": "elastic_done", "attempt": attempt, "steps": step, "time": time.time(),
                  "acc": acc, "checksum": checksum(net)})
    if main_rank:
        print(f"done: {step} steps, test accuracy {acc:.3f}, attempt {attempt}", flush=True)
    if world > 1:
        tdist.barrier()  # (Gloo on torch 2.13 may abort at exit without it)
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
