"""Measure two DDP knobs: gradient bucket size and no_sync gradient accumulation.

A communication hook counts the all-reduce calls DDP makes (one per bucket) and
the bytes they carry; the step time is the slowest rank's. Rank 0 emits ``bucket``
and ``accum`` records.

    torchrun --standalone --nproc-per-node 2 ddp_bench.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    bucket: bucket_cap_mb, params, allreduce_calls_per_step, bytes_per_step,
        seconds_per_step (one per bucket size)
    accum: accum, allreduce_calls_per_micro_batch, seconds_per_micro_batch (one per
        accumulation)
"""

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, paths, profile


def parse_args() -> argparse.Namespace:
    S = paths.lab_module("lab2", "settings").DDP_KNOBS.of()  # the profile's sizes
    p = profile.script_parser(__doc__.splitlines()[0])
    p.add_argument("--arch", default="fmnist_cnn", choices=["fmnist_cnn", "resnet_cifar"])
    p.add_argument("--width", type=int, default=S.width)
    p.add_argument("--batch-size", type=int, default=S.batch_size)
    p.add_argument("--steps", type=int, default=S.steps, help="timed steps per setting")
    p.add_argument(
        "--bucket-caps",
        type=float,
        nargs="+",
        default=[0.01, 0.1, 25.0],
        help="bucket_cap_mb values to compare",
    )
    p.add_argument(
        "--accum",
        type=int,
        nargs="+",
        default=[1, 4],
        help="micro-batches per optimiser step to compare",
    )
    return p.parse_args()


class CallCounter:
    """State of the counting hook: all-reduce calls and bytes since the last reset."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0


def counting_allreduce(state: CallCounter, bucket):
    """DDP's default all-reduce of one bucket, counted."""
    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


def make_model(args, device, bucket_cap_mb: float) -> tuple[DDP, CallCounter]:
    torch.manual_seed(0)
    net = models.build(args.arch, width=args.width, batch_norm=False).to(device)
    model = DDP(
        net,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )
    counter = CallCounter()
    model.register_comm_hook(counter, counting_allreduce)
    return model, counter


def run_steps(model: DDP, opt, batch, steps: int, accum: int) -> float:
    """Seconds per optimiser step of ``accum`` micro-batches (slowest rank)."""
    x, y = batch
    labdist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            # no_sync: gradients only accumulate locally; the last micro-batch all-reduces
            with contextlib.nullcontext() if last else model.no_sync():
                (F.cross_entropy(model(x), y) / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    return float(labdist.all_reduce_sum(elapsed) / labdist.world_size()) / steps


def main() -> None:
    args = parse_args()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    device = info.device
    shape = (1, 28, 28) if args.arch == "fmnist_cnn" else (3, 32, 32)
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)

    for cap in args.bucket_caps:
        model, counter = make_model(args, device, cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run_steps(model, opt, (x, y), 1, 1)  # warm-up: DDP builds its buckets on step 1
        counter.calls = counter.bytes = 0
        seconds = run_steps(model, opt, (x, y), args.steps, 1)
        params = sum(p.numel() for p in model.parameters())
        metrics.emit(
            {
                "event": "bucket",
                "bucket_cap_mb": cap,
                "params": params,
                "allreduce_calls_per_step": counter.calls / args.steps,
                "bytes_per_step": counter.bytes / args.steps,
                "seconds_per_step": seconds,
            }
        )
        labdist.print0(
            f"bucket_cap_mb={cap:<6g} {counter.calls / args.steps:4.0f} all-reduces/step "
            f"{seconds * 1e3:7.1f} ms/step"
        )

    for accum in args.accum:
        model, counter = make_model(args, device, 25.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run_steps(model, opt, (x, y), 1, accum)
        counter.calls = counter.bytes = 0
        steps = max(1, args.steps // accum)
        seconds = run_steps(model, opt, (x, y), steps, accum)
        metrics.emit(
            {
                "event": "accum",
                "accum": accum,
                "allreduce_calls_per_micro_batch": counter.calls / (steps * accum),
                "seconds_per_micro_batch": seconds / accum,
            }
        )
        labdist.print0(
            f"accum={accum}: {counter.calls / (steps * accum):.2f} all-reduces and "
            f"{seconds / accum * 1e3:.1f} ms per micro-batch"
        )
    labdist.shutdown()


if __name__ == "__main__":
    main()
