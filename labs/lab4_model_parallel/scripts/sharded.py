"""Data-parallel training with the training state replicated (DDP) or sharded (ZeRO-1, FSDP2).

For each --strategies entry the character transformer is trained --steps Adam steps
on a global batch split over the ranks, then this script reports per rank the bytes
of parameters, gradients and optimizer state (measured from the tensors), the bytes
the collectives carried in one step, and how far the weights are from one process
training the unsplit model on the whole batch. The last strategy's model is saved.

    torchrun --standalone --nproc-per-node 2 sharded.py --strategies ddp zero1 fsdp

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    one_process: psi, params, grads, optimizer (bytes of the unsplit model's state)
    sharded: strategy, procs, steps, per_rank, comm_bytes, step_s, weights_rel_err (one
        per strategy)
"""

import argparse
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, memory, metrics, models, parallel, profile, traffic

STRATEGIES = ("ddp", "zero1", "fsdp")
# The model's outputs are views; nothing here modifies them in place, which is what FSDP2 warns about.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP keeps parameters, gradients and optimizer state in CPU memory "
        "(CPUOffloadPolicy; only meaningful on GPUs)",
    )
    return p.parse_args(argv)


def wrap(
    strategy: str, model: torch.nn.Module, args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of one strategy."""
    if strategy == "fsdp":
        kw = {"offload_policy": CPUOffloadPolicy()} if args.cpu_offload else {}
        for layer in model.layers:  # one all-gather / reduce-scatter unit per layer
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, traffic.ddp_hook())  # so traffic.count sees the buckets
    if strategy == "zero1":
        return ddp, ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr
        )
    return ddp, torch.optim.Adam(ddp.parameters(), lr=args.lr)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in model.state_dict().items()
    }


def train_one_process(args: argparse.Namespace, batches: list, device) -> torch.nn.Module:
    """Rank 0: one process trains the unsplit model on the whole batches (the yardstick)."""
    reference = parallel.build_model(args).to(device)
    opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for x, y in batches:
        opt.zero_grad()
        parallel.lm_loss(reference(x), y).backward()
        opt.step()
    one = memory.state_bytes(reference, opt)
    psi = sum(q.numel() for q in reference.parameters())
    metrics.emit({"event": "one_process", "psi": psi, **one})
    return reference


def train_strategy(
    strategy: str, args: argparse.Namespace, batches: list, info: labdist.DistInfo
) -> dict:
    """Train with one strategy on this rank's part of each batch: every rank's state
    bytes, the whole weights, the bytes of the last step's collectives, the best step."""
    device, world_size = info.device, info.world_size
    model = parallel.build_model(args).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    comm: dict = {}
    model, opt = wrap(strategy, model, args, device)
    mine = slice(
        info.rank * args.batch_size // world_size, (info.rank + 1) * args.batch_size // world_size
    )
    seconds = []
    for x, y in batches:
        start = time.perf_counter()
        with traffic.count() as seen:
            opt.zero_grad()  # the last step's gradients stay: they are measured below
            loss = parallel.lm_loss(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
        seconds.append(time.perf_counter() - start)
        comm = dict(seen)  # the bytes of the last step
    per_rank = memory.state_bytes(model, opt)
    per_rank["peak_cuda"] = memory.peak_cuda_bytes(device) or 0
    ranks = [None] * world_size
    dist.all_gather_object(ranks, per_rank)
    return {
        "per_rank": ranks,
        "state": full_state(model),
        "comm": comm,
        "step_s": labdist.average(min(seconds)),
    }


def report(strategy: str, args: argparse.Namespace, run: dict, reference: torch.nn.Module) -> None:
    """Rank 0: what rank 0 holds, what one step moved, the weights against one process."""
    err = parallel.relative_error(
        run["state"], {k: v.cpu() for k, v in reference.state_dict().items()}
    )
    world_size, ranks, comm = len(run["per_rank"]), run["per_rank"], run["comm"]
    metrics.emit(
        {
            "event": "sharded",
            "strategy": strategy,
            "procs": world_size,
            "steps": args.steps,
            "per_rank": ranks,
            "comm_bytes": comm,
            "weights_rel_err": err,
            "step_s": run["step_s"],
        }
    )
    mib = {k: f"{ranks[0][k] / 2**20:.2f}" for k in ("params", "grads", "optimizer")}
    print(
        f"{strategy:5s} on {world_size}: rank 0 holds {mib} MiB; one step moved {comm} bytes; "
        f"weights vs one process {err:.1e}; {run['step_s'] * 1e3:.1f} ms per step",
        flush=True,
    )


def save(args: argparse.Namespace, strategy: str, state: dict, world_size: int) -> None:
    """Rank 0 saves the gathered weights as a plain, unsplit model."""
    plain = parallel.build_model(args)
    plain.load_state_dict(state)
    models.save(args.checkpoint, plain, steps=args.steps, strategy=strategy, procs=world_size)
    print(f"saved {args.checkpoint}", flush=True)


def main() -> None:
    args = parse_args()
    parallel.require_batch_split(args.batch_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(info.device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]
    reference = train_one_process(args, batches, info.device) if info.rank == 0 else None
    for strategy in args.strategies:
        run = train_strategy(strategy, args, batches, info)
        if reference is not None:
            report(strategy, args, run, reference)
            if args.checkpoint and strategy == args.strategies[-1]:
                save(args, strategy, run["state"], info.world_size)
    labdist.shutdown()


if __name__ == "__main__":
    main()
