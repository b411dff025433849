"""What Lab 7's training scripts share: the batches, and a step loop that counts each
step's all-reduce bytes (``lab_utils.traffic``), times it, and averages its loss."""

import time

import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import parallel, traffic


def batches(args, device) -> list:
    """The --steps global batches, the same on every rank (seeded by step)."""
    data = parallel.corpus(args)
    return [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]


def run_steps(net, opt, batches: list) -> dict:
    """Train ``net`` on this rank's share of each batch: per step, the loss (mean over
    ranks), the bytes every ``torch.distributed.all_reduce`` carried, and the seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, sent, seconds = [], [], []
    for x, y in batches:
        share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        start = time.perf_counter()
        with traffic.count() as seen:
            opt.zero_grad()
            loss = parallel.lm_loss(net(x[share]), y[share])
            loss.backward()
            opt.step()
        seconds.append(time.perf_counter() - start)
        sent.append(seen.get("all_reduce", 0))
        losses.append(labdist.average(loss.item()))
    return {"bytes_by_step": sent, "losses": losses, "seconds": seconds}
