"""Data-parallel training with the training state replicated (DDP) or sharded (ZeRO-1, FSDP2).

For each --strategies entry the character transformer is trained --steps Adam steps
on a global batch split over the ranks, then this script reports per rank the bytes
of parameters, gradients and optimizer state (measured from the tensors), the bytes
the collectives carried in one step, and how far the weights are from one process
training the unsplit model on the whole batch. The last strategy's model is saved.

    torchrun --standalone --nproc-per-node 2 sharded.py --strategies ddp zero1 fsdp
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
from lab_utils import memory, metrics, models, parallel, profile, traffic

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


def main() -> None:
    args = parse_args()
    n = parallel.require_batch_split(args.batch_size)
    info = labdist.init(group_if_alone=True)
    rank, device = info.rank, info.device
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]

    reference = None
    if rank == 0:  # one process, whole batch
        reference = parallel.build_model(args).to(device)
        opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
        for x, y in batches:
            opt.zero_grad()
            parallel.lm_loss(reference(x), y).backward()
            opt.step()
        one = memory.state_bytes(reference, opt)
        psi = sum(q.numel() for q in reference.parameters())
        metrics.emit({"event": "one_process", "psi": psi, **one})

    for strategy in args.strategies:
        model = parallel.build_model(args).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        comm: dict = {}
        model, opt = wrap(strategy, model, args, device)
        seconds = []
        for x, y in batches:
            mine = slice(rank * args.batch_size // n, (rank + 1) * args.batch_size // n)
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
        ranks = [None] * n
        dist.all_gather_object(ranks, per_rank) if n > 1 else ranks.__setitem__(0, per_rank)
        state = full_state(model)
        step_s = labdist.average(min(seconds)) if n > 1 else min(seconds)
        if rank == 0:
            err = parallel.relative_error(
                state, {k: v.cpu() for k, v in reference.state_dict().items()}
            )
            metrics.emit(
                {
                    "event": "sharded",
                    "strategy": strategy,
                    "procs": n,
                    "steps": args.steps,
                    "per_rank": ranks,
                    "comm_bytes": comm,
                    "weights_rel_err": err,
                    "step_s": step_s,
                }
            )
            mib = {k: f"{ranks[0][k] / 2**20:.2f}" for k in ("params", "grads", "optimizer")}
            print(
                f"{strategy:5s} on {n}: rank 0 holds {mib} MiB; one step moved {comm} bytes; "
                f"weights vs one process {err:.1e}; {step_s * 1e3:.1f} ms per step",
                flush=True,
            )
            if args.checkpoint and strategy == args.strategies[-1]:
                plain = parallel.build_model(args)
                plain.load_state_dict(state)
                models.save(args.checkpoint, plain, steps=args.steps, strategy=strategy, procs=n)
                print(f"saved {args.checkpoint}", flush=True)
        del model, opt
    labdist.shutdown()


if __name__ == "__main__":
    main()
