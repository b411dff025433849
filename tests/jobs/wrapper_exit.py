"""Test job: a few steps under a distributed wrapper (or each), ``dist.shutdown()``, exit.

    torchrun --nproc-per-node 2 wrapper_exit.py ddp|zero|fsdp|dtensor|all [--exit N|--raise|--abort]

Each rank ends its part with a tensor just all-reduced and dropped, as a training
script does; the process must then end with status 0 (or the one asked for) and never
with SIGABRT. ``all`` trains one model under each wrapper in turn, every one of them
still holding the default group when the process exits (one launch for the four).
``--raise`` fails after the job's work, ``--exit N`` calls ``sys.exit(N)``, ``--abort``
dies as a process did when Gloo aborted it at exit.
"""

import argparse
import os
import sys
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist, gloo_exit

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


WRAPPERS = ["ddp", "zero", "fsdp", "dtensor"]


def wrap(kind: str, model: torch.nn.Sequential) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of one wrapper, each holding the default group."""
    if kind == "fsdp":
        fully_shard(model)
    elif kind == "dtensor":
        mesh = init_device_mesh("cpu", (dist.world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        model = DDP(model)
    if kind == "zero":
        return model, ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1
        )
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wrapper", choices=[*WRAPPERS, "all"])
    p.add_argument("--exit", type=int, default=None)
    p.add_argument("--raise", dest="fail", action="store_true")
    p.add_argument("--abort", action="store_true")
    args = p.parse_args()
    gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
    info = dist.init()
    torch.manual_seed(0)
    kept = []  # every wrapper's model and optimizer stay alive until the process exits
    for kind in WRAPPERS if args.wrapper == "all" else [args.wrapper]:
        model, opt = wrap(
            kind,
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
        )
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
        loss = dist.average(float(model(torch.randn(8, 16)).square().mean()))
        dist.print0(f"{kind}: {info.world_size} ranks, loss {loss:.4f}")
        kept.append((model, opt))
    dist.shutdown()
    if args.fail:
        raise RuntimeError(f"rank {info.rank} failed after its work")
    if args.abort:
        print("terminate called without an active exception", file=sys.stderr, flush=True)
        os.abort()
    if args.exit is not None:
        sys.exit(args.exit)


if __name__ == "__main__":
    main()
