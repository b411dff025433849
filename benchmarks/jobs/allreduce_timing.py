"""Time the hand-built ring all-reduce against torch.distributed's (Gloo) all-reduce.

Run under a launcher, e.g. ``torchrun --standalone --nproc-per-node 4 allreduce_timing.py``.
For every size, both algorithms run alternately (ring, library, library, ring, ...)
after a warm-up; one call's time is that of the slowest rank. Rank 0 emits one
``allreduce`` record per size with the seconds of every call of each, and the
largest relative difference between the two sums.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from lab_utils import collectives, gloo_exit, metrics
from lab_utils import dist as labdist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", required=True, help="message sizes in bytes")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm and size")
    p.add_argument(
        "--budget-s",
        type=float,
        default=2.0,
        help="fewer repeats (at least 3) for sizes whose calls exceed this in total",
    )
    return p.parse_args()


def slowest_rank_seconds(fn) -> float:
    """Seconds one call of ``fn`` takes on the slowest rank (all start together)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def main() -> None:
    args = parse_args()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(backend="gloo")  # CPU tensors, also on a machine with GPUs
    comm = collectives.TorchComm()
    for nbytes in args.sizes:
        numel = max(1, nbytes // 4)  # float32
        x = torch.randn(numel, generator=torch.Generator().manual_seed(info.rank))
        ring_out: list[torch.Tensor] = []

        def ring(x=x, out=ring_out):
            out[:] = [collectives.ring_all_reduce(x, comm)]

        lib_buf = x.clone()

        def library(x=x, buf=lib_buf):
            buf.copy_(x)  # all_reduce works in place; the ring copies too
            dist.all_reduce(buf)

        first = {"ring": slowest_rank_seconds(ring), "gloo": slowest_rank_seconds(library)}
        repeats = args.repeats
        if sum(first.values()) * repeats > args.budget_s:
            repeats = max(3, int(args.budget_s / max(sum(first.values()), 1e-9)))
        times: dict[str, list[float]] = {"ring": [], "gloo": []}
        for i in range(repeats):
            order = ("ring", "gloo") if i % 2 == 0 else ("gloo", "ring")
            for name in order:
                times[name].append(slowest_rank_seconds(ring if name == "ring" else library))
        err = (ring_out[0] - lib_buf).abs().max() / lib_buf.abs().max().clamp_min(1e-30)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        metrics.emit(
            {
                "event": "allreduce",
                "world_size": info.world_size,
                "nbytes": 4 * numel,
                "ring_s": times["ring"],
                "gloo_s": times["gloo"],
                "max_rel_err": float(err),
            }
        )
    labdist.shutdown()


if __name__ == "__main__":
    main()
