"""The ring all-reduce in real processes: checked against dist.all_reduce, then timed.

Run it with any launcher, e.g. ``torchrun --standalone --nproc-per-node 4 ring_check.py``.
Rank 0 emits JSON records: ``ring_check`` (errors per group size, length and dtype),
``timing`` (seconds per all-reduce by algorithm and size) and ``traffic`` (bytes per rank).

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    ring_check: world_size, length, dtype, max_rel_err (the ring against dist.all_reduce)
    timing: world_size, algo, nbytes, seconds (one per algorithm and size)
    traffic: world_size, algo, nbytes, rank, bytes_sent, bytes_received (one per rank)
"""

import argparse
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from lab_utils import collectives, gloo_exit, metrics
from lab_utils import dist as labdist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2**k for k in range(8, 21, 2)],
        help="message sizes to time, in float32 elements",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size")
    p.add_argument(
        "--bench-ranks",
        type=int,
        default=2,
        help="ranks in the timed group (at most one per core for honest timings)",
    )
    return p.parse_args()


def check_group(world_size: int, group, comm) -> None:
    """Ring vs dist.all_reduce on the first world_size ranks, for awkward lengths and two dtypes."""
    for length in (1000 * world_size, 1000 * world_size + 1, world_size - 1, 1):
        for dtype in (torch.float32, torch.int64):
            g = torch.Generator().manual_seed(17 * comm.rank + length)
            x = (torch.randn(length, generator=g) * 100).to(comm.device, dtype)
            ring = collectives.ring_all_reduce(x, comm)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            err = (ring - ref).double().norm() / ref.double().norm().clamp_min(1e-30)
            dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)  # worst rank
            metrics.emit(
                {
                    "event": "ring_check",
                    "world_size": world_size,
                    "length": length,
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_rel_err": float(err),
                }
            )


def time_one(fn, group) -> float:
    """Seconds for one call, as seen by the slowest rank of the group."""
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    elapsed = elapsed.to(labdist.info().device)  # NCCL reduces GPU tensors only
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def bench(sizes, repeats: int, group, comm) -> None:
    # Warm up every algorithm on every size before timing any: the first calls open
    # connections and allocate buffers, which would make the smallest message look slow.
    for numel in sizes:
        x = torch.randn(numel, device=comm.device)
        for _ in range(2):
            collectives.ring_all_reduce(x, comm)
            collectives.server_all_reduce(x, comm)
            dist.all_reduce(x.clone(), group=group)
    for numel in sizes:
        x = torch.randn(numel, device=comm.device)
        algos = {
            "ring (ours)": partial(collectives.ring_all_reduce, x, comm),
            "server (ours)": partial(collectives.server_all_reduce, x, comm),
            "dist.all_reduce": partial(dist.all_reduce, x.clone(), group=group),
        }
        for name, fn in algos.items():
            time_one(fn, group)  # warm-up: connections, allocations
            times = sorted(time_one(fn, group) for _ in range(repeats))
            metrics.emit(
                {
                    "event": "timing",
                    "algo": name,
                    "world_size": comm.world_size,
                    "nbytes": 4 * numel,
                    "seconds": times[len(times) // 2],
                }
            )


def traffic(numel: int, group, comm) -> None:
    """Bytes through each rank for one all-reduce of numel float32 with each algorithm."""
    x = torch.randn(numel, device=comm.device)
    for name, fn in (
        ("ring", collectives.ring_all_reduce),
        ("server", collectives.server_all_reduce),
    ):
        comm.traffic = collectives.Traffic(comm.rank)
        fn(x, comm)
        for t in collectives.gather_traffic(comm):
            metrics.emit(
                {
                    "event": "traffic",
                    "algo": name,
                    "world_size": comm.world_size,
                    "nbytes": 4 * numel,
                    "rank": t.rank,
                    "bytes_sent": t.bytes_sent,
                    "bytes_received": t.bytes_received,
                }
            )


def main() -> None:
    args = parse_args()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    if info.world_size < 2:
        sys.exit("run me with at least 2 processes (torchrun --nproc-per-node 2 ...)")
    # Every rank takes part in creating every group, members or not.
    groups = {size: dist.new_group(list(range(size))) for size in range(2, info.world_size + 1)}
    for size, group in groups.items():
        if info.rank < size:
            check_group(size, group, collectives.TorchComm(group))
    labdist.print0(f"ring all-reduce checked on groups of 2..{info.world_size} ranks")
    n_bench = min(args.bench_ranks, info.world_size)
    if info.rank < n_bench:
        bench(args.sizes, args.repeats, groups[n_bench], collectives.TorchComm(groups[n_bench]))
    labdist.barrier()
    labdist.print0(f"timed {len(args.sizes)} sizes on {n_bench} ranks")
    everyone = groups[info.world_size]
    traffic(max(args.sizes), everyone, collectives.TorchComm(everyone))
    labdist.shutdown()


if __name__ == "__main__":
    main()
