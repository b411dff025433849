"""Each collective of torch.distributed once: every rank prints its buffer before → after.

torchrun --standalone --nproc-per-node 4 collectives_demo.py
"""

import torch
import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import gloo_exit


def show(name: str, before: torch.Tensor, after) -> None:
    """Print this rank's data before and after one collective, then wait for the others."""
    after = after.tolist() if isinstance(after, torch.Tensor) else after
    print(f"{name:<15} {str(before.tolist()):>18} → {after}", flush=True)
    labdist.barrier()  # keeps the collectives apart in the output


def main() -> None:
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    rank, world_size = info.rank, info.world_size
    dev = info.device  # Gloo works on CPU tensors, NCCL on GPU tensors
    mine = torch.tensor([float(rank + 1)], device=dev)  # rank r holds r + 1

    x = mine.clone()
    dist.broadcast(x, src=0)  # rank 0's tensor to every rank
    show("broadcast", mine, x)

    parts = [torch.tensor([10.0 * i, 10.0 * i + 1], device=dev) for i in range(world_size)]
    out = torch.empty(2, device=dev)
    dist.scatter(out, scatter_list=parts if rank == 0 else None, src=0)  # piece i to rank i
    show("scatter", torch.cat(parts) if rank == 0 else torch.tensor([]), out)

    bucket = [torch.empty(1, device=dev) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, gather_list=bucket, dst=0)  # every rank's tensor to rank 0
    show("gather", mine, torch.cat(bucket) if rank == 0 else "(nothing)")

    x = mine.clone()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # the sum, on rank 0 only
    show("reduce", mine, x if rank == 0 else "(unspecified)")

    x = mine.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # the sum, on every rank
    show("all_reduce", mine, x)

    everyone = [torch.empty(1, device=dev) for _ in range(world_size)]
    dist.all_gather(everyone, mine)  # every rank's tensor, on every rank
    show("all_gather", mine, torch.cat(everyone))

    total = world_size * (world_size + 1) // 2
    labdist.print0(f"sum of 1..{world_size} = {total}: compare with reduce and all_reduce")
    labdist.shutdown()


if __name__ == "__main__":
    main()
