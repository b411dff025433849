"""Each collective of torch.distributed once: every rank prints its buffer before → after.

torchrun --standalone --nproc-per-node 4 collectives_demo.py
"""

import torch
import torch.distributed as tdist

from lab_utils import dist


def show(name: str, before: torch.Tensor, after) -> None:
    """Print this rank's data before and after one collective, then wait for the others."""
    after = after.tolist() if isinstance(after, torch.Tensor) else after
    print(f"{name:<15} {str(before.tolist()):>18} → {after}", flush=True)
    dist.barrier()  # keeps the collectives apart in the output


def main() -> None:
    info = dist.init()
    r, n = info.rank, info.world_size
    dev = info.device  # Gloo works on CPU tensors, NCCL on GPU tensors
    mine = torch.tensor([float(r + 1)], device=dev)  # rank r holds r + 1

    x = mine.clone()
    tdist.broadcast(x, src=0)  # rank 0's tensor to every rank
    show("broadcast", mine, x)

    parts = [torch.tensor([10.0 * i, 10.0 * i + 1], device=dev) for i in range(n)]
    out = torch.empty(2, device=dev)
    tdist.scatter(out, scatter_list=parts if r == 0 else None, src=0)  # piece i to rank i
    show("scatter", torch.cat(parts) if r == 0 else torch.tensor([]), out)

    bucket = [torch.empty(1, device=dev) for _ in range(n)] if r == 0 else None
    tdist.gather(mine, gather_list=bucket, dst=0)  # every rank's tensor to rank 0
    show("gather", mine, torch.cat(bucket) if r == 0 else "(nothing)")

    x = mine.clone()
    tdist.reduce(x, dst=0, op=tdist.ReduceOp.SUM)  # the sum, on rank 0 only
    show("reduce", mine, x if r == 0 else "(unspecified)")

    x = mine.clone()
    tdist.all_reduce(x, op=tdist.ReduceOp.SUM)  # the sum, on every rank
    show("all_reduce", mine, x)

    everyone = [torch.empty(1, device=dev) for _ in range(n)]
    tdist.all_gather(everyone, mine)  # every rank's tensor, on every rank
    show("all_gather", mine, torch.cat(everyone))

    dist.print0(f"sum of 1..{n} = {n * (n + 1) // 2}: compare with reduce and all_reduce")
    dist.shutdown()


if __name__ == "__main__":
    main()
