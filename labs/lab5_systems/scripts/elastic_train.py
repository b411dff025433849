"""Data-parallel training that survives a killed rank: checkpoint, restart, resume.

Run it under ``torchrun --max-restarts N``: when a rank dies, torchrun stops the
others and starts every rank again; each resumes from the last checkpoint. It needs
torchrun's agent (the restarting is the lesson) and refuses any other launcher. Every
batch is a function of the global step alone (a per-epoch permutation, cut into
global batches, one slice per rank), so a resumed run replays exactly the batches the
lost one would have seen, and on CPU its final weights equal an uninterrupted run's.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 scripts/elastic_train.py \\
        --ckpt-every 20 --kill-at 50

Each run checkpoints into a folder of its own, ``runs/lab5_elastic/<torchrun run id>``
(the restarted attempts of one job share it; the next job starts afresh). A first
attempt refuses a ``--ckpt-dir`` that already holds a checkpoint unless ``--resume``.

``--kill-at STEP`` makes rank ``--kill-rank`` SIGKILL itself at that step, on the first
attempt only. Rank 0 emits JSON records: ``elastic_start`` (attempt, step resumed from,
process start and the moment it is ready to train), ``elastic_kill`` (the step and time
of the kill), ``elastic_ckpt`` (step, seconds to write it) and ``elastic_done`` (steps,
the attempt's median step time, a checksum of the weights): the parts of what a failure
costs, each measured where it happens.

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    elastic_start: attempt, step, ckpt_dir, time, ready
    elastic_kill: step, time
    elastic_ckpt: step, time, save_s
    elastic_done: attempt, steps, steps_run, step_s, acc, checksum, time
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, paths, profile, tensordata

AUTO = "auto"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = profile.script_parser(__doc__)
    p.add_argument("--steps", type=int, default=200, help="global steps to train")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--n-train", type=int, default=10000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints (0: none)")
    p.add_argument(
        "--ckpt-dir",
        default=AUTO,
        help=f"where the checkpoint lives ({AUTO!r}: runs/lab5_elastic/<torchrun run id>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="let the first attempt resume from a checkpoint already in --ckpt-dir",
    )
    p.add_argument("--kill-at", type=int, default=-1, help="step at which a rank kills itself")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--out", default="", help="final weights (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 0:
        p.error("--steps must be >= 1 and --ckpt-every >= 0")
    return args


def require_torchrun() -> None:
    """Stop unless torchrun's agent started this process: only the agent restarts the
    ranks after a failure. Under mpirun (or plain python) every process would be a job of
    its own, writing the same checkpoint, and nothing would ever restart."""
    launcher = labdist.detect().launcher
    if launcher != "torchrun" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        sys.exit(
            f"elastic_train.py needs torchrun's agent, which restarts the job after a failure; "
            f"it was started by {launcher!r}. Run it as: torchrun --standalone --nproc-per-node 2 "
            "--max-restarts 1 scripts/elastic_train.py"
        )


def checkpoint_dir(arg: str) -> Path:
    """``--ckpt-dir``, or a folder of this job's own under ``runs/`` that every rank and
    every restarted attempt of the job names alike (torchrun's run id)."""
    if arg != AUTO:
        return Path(arg)
    return paths.runs_dir("lab5_elastic") / os.environ.get("TORCHELASTIC_RUN_ID", "none")


def refuse_stale(ckpt: Path, attempt: int, resume: bool) -> None:
    """A first attempt that found a checkpoint would resume another job's training."""
    if attempt == 0 and ckpt.exists() and not resume:
        sys.exit(
            f"{ckpt} already holds a checkpoint from an earlier run: pass a fresh "
            "--ckpt-dir, or --resume to continue from it"
        )


def batch_for(step: int, n: int, batch: int, rank: int, world_size: int, seed: int) -> torch.Tensor:
    """This rank's sample indices at global step ``step`` (epoch = step // steps_per_epoch)."""
    per_epoch = n // (batch * world_size)
    if per_epoch < 1:
        raise ValueError(f"{n} samples cannot fill one global batch of {batch * world_size}")
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * world_size + rank) * batch
    return perm[start : start + batch]


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
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    profile.configure_threads()
    device = profile.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Bit-exact resumes on GPUs need deterministic kernels (cuBLAS wants a fixed workspace).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if world_size == 1:
        return 0, 1, device
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    # NCCL wants one GPU per rank; ranks that share a GPU (or have none) talk through Gloo.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nccl = device.type == "cuda" and local <= torch.cuda.device_count()
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    return rank, world_size, device


def resume(ckpt: Path, net: torch.nn.Module, opt: torch.optim.Optimizer, device) -> int:
    """Load the weights, the optimizer state (momentum) and the step of the last
    checkpoint, if there is one; the step to start from."""
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, map_location=device, weights_only=True)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["step"]


def kill_drill(step: int, args: argparse.Namespace, attempt: int, rank: int) -> None:
    """--kill-at: on the first attempt, rank --kill-rank SIGKILLs itself at that step."""
    if step != args.kill_at or attempt != 0:
        return
    # Rank 0 records the moment (the ranks left the previous step's all-reduce together).
    metrics.emit({"event": "elastic_kill", "step": step, "time": time.time()})
    if rank == args.kill_rank:
        print(f"rank {rank}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(
    net: torch.nn.Module, opt: torch.optim.Optimizer, step: int, ckpt: Path
) -> None:
    """Rank 0 writes weights, optimizer state and step, and records the time it took."""
    t0 = time.perf_counter()
    save_atomic({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt)
    metrics.emit(
        {
            "event": "elastic_ckpt",
            "step": step,
            "time": time.time(),
            "save_s": time.perf_counter() - t0,
        }
    )


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    step: int,
    attempt: int,
    ckpt: Path,
) -> tuple[int, list[float]]:
    """Train from ``step`` to --steps, checkpointing every --ckpt-every steps; the step
    reached and the seconds of this attempt's training steps (checkpoint writes excluded)."""
    rank, world_size = labdist.rank(), labdist.world_size()
    x, y = data
    step_s: list[float] = []
    while step < args.steps:
        kill_drill(step, args, attempt, rank)
        t0 = time.perf_counter()
        idx = batch_for(step, len(x), args.batch_size, rank, world_size, args.seed)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()  # DDP averages the gradients
        opt.step()
        step_s.append(time.perf_counter() - t0)
        step += 1
        if args.ckpt_every and step % args.ckpt_every == 0 and rank == 0:
            save_checkpoint(net, opt, step, ckpt)
    return step, step_s


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    require_torchrun()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = checkpoint_dir(args.ckpt_dir) / "checkpoint.pt"
    refuse_stale(ckpt, attempt, args.resume)  # before joining: no rank has written yet
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    _rank, _world_size, device = init_attempt(attempt)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    data = tensordata.load(args.n_train, args.n_test, seed=args.seed)

    torch.manual_seed(args.seed)
    net = models.build("mlp", hidden=(args.hidden,)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    step = resume(ckpt, net, opt, device)
    model = DDP(net) if dist.is_initialized() else net
    metrics.emit(
        {
            "event": "elastic_start",
            "attempt": attempt,
            "step": step,
            "time": started,
            "ready": time.time(),
            "ckpt_dir": str(ckpt.parent),
        }
    )
    labdist.print0(f"attempt {attempt}: starting at step {step} ({ckpt.parent})")
    train_xy = (data.x_train.to(device), data.y_train.to(device))
    step, step_s = train(args, model, net, opt, train_xy, step, attempt, ckpt)
    finish(args, net, data, attempt, step, step_s)


def finish(
    args: argparse.Namespace,
    net: torch.nn.Module,
    data: tensordata.Tensors,
    attempt: int,
    step: int,
    step_s: list[float],
) -> None:
    """Test accuracy, the final weights (rank 0), the attempt's record; then leave."""
    acc = tensordata.accuracy(net, data.x_test, data.y_test)
    if labdist.is_main() and args.out:
        models.save(args.out, net, step=step)
    metrics.emit(
        {
            "event": "elastic_done",
            "attempt": attempt,
            "steps": step,
            "time": time.time(),
            "steps_run": len(step_s),
            "step_s": statistics.median(step_s) if step_s else 0.0,
            "acc": acc,
            "checksum": checksum(net),
        }
    )
    labdist.print0(f"done: {step} steps, test accuracy {acc:.3f}, attempt {attempt}")
    if dist.is_initialized():
        dist.barrier()  # (Gloo on torch 2.13 may abort at exit without it)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
