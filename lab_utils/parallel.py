"""Plumbing shared by Lab 4's model-parallel scripts: their common options, the
character model and loss, a clean stop when the process count does not fit the
split, and gathering a split model's pieces on rank 0 for a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping

import psutil
import torch
import torch.distributed as dist
from torch import nn

from . import dist as labdist
from . import models, text
from .settings import By, Settings

# The character transformer and its data, as Labs 4, 6 and 7 size it: one place for the
# scripts' defaults (add_model_args) and for the notebooks that launch them
# (MODEL.of().d_model, MODEL.args("d_model", "layers")).
MODEL = Settings(
    d_model=By(quick=64, cpu=128, gpu=512),
    heads=4,
    layers=4,
    seq_len=By(quick=32, cpu=64, gpu=256),
    batch_size=By(quick=16, cpu=32, gpu=64),
    n_chars=By(quick=200_000, cpu=1_000_000, gpu=0),
    steps=By(quick=3, cpu=20, gpu=100),
    lr=1e-3,
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options of the character transformer and its data, defaults from :data:`MODEL`
    for the current profile. Every option has a help text, so a parser from
    :func:`lab_utils.profile.script_parser` shows its default for the profile in ``--help``."""
    m = MODEL.of()
    p.add_argument("--d-model", type=int, default=m.d_model, help="width d of the model")
    p.add_argument("--heads", type=int, default=m.heads, help="attention heads per block")
    p.add_argument("--layers", type=int, default=m.layers, help="transformer blocks")
    p.add_argument("--seq-len", type=int, default=m.seq_len, help="characters per sequence")
    p.add_argument(
        "--batch-size",
        type=int,
        default=m.batch_size,
        help="sequences per step (the whole batch, all micro-batches / ranks)",
    )
    p.add_argument(
        "--n-chars",
        type=int,
        default=m.n_chars,
        help=f"characters of the {text.NAME} corpus to use (0: 5 million)",
    )
    p.add_argument("--steps", type=int, default=m.steps, help="training steps")
    p.add_argument("--lr", type=float, default=m.lr, help="Adam's learning rate")
    p.add_argument("--checkpoint", default=None, help="save the whole trained model here (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")


def build_model(args: argparse.Namespace) -> nn.Module:
    """The same initial char_transformer on every rank (seeded)."""
    torch.manual_seed(args.seed)
    return models.build(
        "char_transformer",
        vocab=text.VOCAB,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        max_len=args.seq_len,
    )


def corpus(args: argparse.Namespace) -> text.Corpus:
    return text.load(args.n_chars or 5_000_000)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def require(ok: bool, message: str) -> None:
    """Stop the job with ``message`` when ``ok`` is false.

    Call it before the process group is joined: each rank decides alone from the
    launcher's environment, so nobody waits for a peer that has left (no hang). The
    first process on each machine (local rank 0) prints ``error: message`` and exits
    with status 2; the others leave quietly with status 0, and under torchrun local
    rank 0 waits for them to have left, so torchrun neither kills a rank that is still
    starting nor reports more than this one stop. torchrun then adds its report of that
    failed rank (a ChildFailedError summary) and exits with status 1; one process
    started with ``python`` exits with status 2."""
    if ok:
        return
    env = labdist.detect()
    if env.local_rank != 0:
        sys.exit(0)
    print(f"error: {message}", file=sys.stderr, flush=True)
    if env.launcher == "torchrun":
        print(
            "(torchrun's ChildFailedError report below names this stop, exitcode 2; "
            "nothing else failed)",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_the_other_workers()
    sys.exit(2)


def require_batch_split(batch_size: int) -> int:
    """:func:`require` that the global batch splits evenly over the job's processes;
    returns their number."""
    n = labdist.detect().world_size
    require(
        batch_size % n == 0,
        f"the global batch {batch_size} cannot be split over {n} "
        f"processes: use a --batch-size divisible by {n}",
    )
    return n


def _wait_for_the_other_workers(timeout: float = 30.0) -> None:
    """Return once no other child of this process's parent (torchrun's agent on this
    machine) is running, or after ``timeout`` seconds."""
    me, deadline = os.getpid(), time.monotonic() + timeout
    try:
        agent = psutil.Process(os.getppid())
        while time.monotonic() < deadline:
            if not [c for c in agent.children() if c.pid != me and _running(c)]:
                return
            time.sleep(0.05)
    except psutil.Error:  # the agent is gone: nothing to wait for
        return


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gather_on_rank0(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Union of every rank's ``{name: tensor}`` (as CPU copies) on rank 0; ``None``
    elsewhere. Works for one process too."""
    local = {k: v.detach().cpu().clone() for k, v in tensors.items()}
    if not dist.is_initialized():
        return local
    pieces: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, pieces, dst=0)
    if pieces is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for piece in pieces:
        out.update(piece)
    return out


def relative_error(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all the tensors together (the names must match). Taken
    as a whole because some gradients are zero in exact arithmetic (a key's bias
    cannot change a softmax) and their own relative error is only rounding noise."""
    if set(a) != set(b):
        raise KeyError(f"different names: {sorted(set(a) ^ set(b))[:5]}")
    diff = sum(float((a[k].detach().double() - b[k].detach().double()).pow(2).sum()) for k in b)
    ref = sum(float(b[k].detach().double().pow(2).sum()) for k in b)
    return (diff / max(ref, 1e-300)) ** 0.5
