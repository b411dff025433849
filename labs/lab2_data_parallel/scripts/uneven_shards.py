"""Uneven shards hang a DDP job; padding the shards or DDP's join() fixes it.

With ``--fix none`` the training set is split without padding (as for evaluation),
so rank 0 gets one batch more than rank 1: its last backward pass waits in an
all-reduce that rank 1 never joins, until the collective timeout
(``$LABS_DIST_TIMEOUT``) or the launcher's timeout ends the job.

    torchrun --standalone --nproc-per-node 2 uneven_shards.py --fix none   # hangs
    torchrun --standalone --nproc-per-node 2 uneven_shards.py --fix pad    # equal shards
    torchrun --standalone --nproc-per-node 2 uneven_shards.py --fix join   # DDP join()
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit
from lab_utils.loader import TensorLoader


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fix", choices=["none", "pad", "join"], default="none")
    p.add_argument("--batches", type=int, default=4, help="batches of the shortest shard")
    p.add_argument("--batch-size", type=int, default=8)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    n_samples = info.world_size * args.batches * args.batch_size + 1  # one too many
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_samples, 20, generator=g)
    y = torch.randint(0, 10, (n_samples,), generator=g)
    loader = TensorLoader(
        x,
        y,
        args.batch_size,
        rank=info.rank,
        world_size=info.world_size,
        even_shards=args.fix == "pad",
    )  # pad: wrap round like DistributedSampler
    print(f"rank {info.rank}: {len(loader)} batches", flush=True)

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(20, 10).to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # join(): a rank that runs out of data shadows the others' all-reduces with zeros
    with model.join() if args.fix == "join" else contextlib.nullcontext():
        steps = 0
        for xb, yb in loader:
            F.cross_entropy(model(xb.to(info.device)), yb.to(info.device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
    print(f"rank {info.rank}: done after {steps} steps", flush=True)
    labdist.barrier()  # the rank with fewer batches waits here for the others
    labdist.print0("all ranks finished")
    labdist.shutdown()


if __name__ == "__main__":
    main()
