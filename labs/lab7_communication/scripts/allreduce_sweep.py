"""All-reduce time against message size on the job's link, and DDP steps on it.

Run inside a link that ``lab_utils.slow_link`` made (a private network namespace whose
loopback the kernel's token-bucket filter rate-limits), every byte the ranks exchange
crosses that link. For each rate in --rates (rank 0 changes the job's own link between
measurements with ``slow_link.set_rate``; ``none`` is the same loopback unshaped), the
script

1. times one all-reduce of each --sizes-kb (float32 payload, Gloo on CPU, NCCL on GPU)
   --repeats times, each round every size once, the order reversed every other round;
   a time is the span from the first rank's start to the last rank's end (one clock:
   every process of one machine reads the same monotonic clock);
2. counts the bytes the link carried per all-reduce (the qdisc's own counter, headers
   included, the barriers around it subtracted);
3. lets the link idle before each timed all-reduce until the token bucket is full
   (1.2 × burst / rate): every message starts with a full bucket, whose burst passes at
   the loopback's own speed;
4. with --ddp, times Lab 6.5's naive and overlapped hand-made DDP, PyTorch's DDP and the
   same step without communication on the character transformer, in rounds that visit
   every rate and every variant (the orders reversed every other round): each step's time
   on rank 0's clock, its span from the first rank's start to the last rank's end, and
   the link bytes of each step that communicates.

Sizes whose all-reduce would take longer than --max-seconds at a rate are left out there.
Outside a slow link (``--rates`` not given) it measures the link it runs on, without
byte counts; alone (one process) nothing crosses any link, and it says so.

    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 allreduce_sweep.py --rates 50 200 none
    torchrun --standalone --nproc-per-node 2 allreduce_sweep.py
    mpirun -np 2 python allreduce_sweep.py --sizes-kb 64 1024

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    link: procs, backend, device, shaped, counted, burst_bytes, latency_ms, mtu, rates
    sweep: rate_mbit, sizes, seconds, link_bytes (mean per size), link_bytes_each (per
        size, per repetition, paired with seconds), barrier_bytes, drops, fill_s
        (one per rate)
    ddp: rate_mbit, bucket_kb, buckets, bucket_bytes, psi_bytes, repeats, variants
        (rank 0's step times), spans (first rank's start to last rank's end, per round),
        backward_s, link_bytes (first round), link_bytes_each (per round, paired with
        spans) (one per rate, with --ddp)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, paths, profile, slow_link

# Lab 6.5's hand-made DDP and its timed training step, reused as they are.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab6_efficiency" / "scripts"))
from ddp_by_hand import Variant, bucket_bytes

# The link's rate, changed in the job between measurements: one place for every Lab 7 script.
from steps import add_rates_arg, barrier_bytes, link_and_rates, link_bytes, switch


def parse_args(argv=None) -> argparse.Namespace:
    S = paths.lab_module("lab7", "settings").SWEEP.of()
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--sizes-kb",
        nargs="+",
        type=float,
        default=S.sizes_kb,
        help="payload sizes (KiB of float32) of the all-reduces timed",
    )
    add_rates_arg(p)
    p.add_argument("--repeats", type=int, default=S.repeats, help="rounds timed")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=S.max_seconds,
        help="leave out the sizes whose all-reduce would take longer at a rate",
    )
    p.add_argument("--ddp", action="store_true", help="also time DDP steps at every rate")
    p.add_argument("--bucket-kb", type=float, default=256, help="DDP's bucket cap (KiB) for --ddp")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spans(starts: list[float], ends: list[float]) -> list[float]:
    """Per round, from the first rank's start to the last rank's end (seconds)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (starts, ends))
    return [max(e[r] for _, e in every) - min(s[r] for s, _ in every) for r in range(len(starts))]


def expected_link_s(nbytes: int, link: slow_link.Link | None) -> float:
    """Roughly how long one all-reduce of ``nbytes`` takes on ``link`` (to leave out
    sizes): every rank sends 2(N−1)/N of it, all over the one link."""
    if link is None or link.rate_mbit is None:
        return 0.0
    n = dist.get_world_size()
    return 2 * (n - 1) * nbytes * 1.05 / link.rate_bytes_per_s


def sweep(args, device: torch.device, link: slow_link.Link | None) -> dict:
    """Steps 1–2 at the current rate."""
    sizes = [
        4 * max(1, round(kb * 1024 / 4))
        for kb in args.sizes_kb
        if expected_link_s(kb * 1024, link) <= args.max_seconds
    ]
    tensors = [torch.ones(n // 4, device=device) for n in sizes]
    for t in tensors:
        dist.all_reduce(t)  # warm-up: connections, buffers
    per_barrier = barrier_bytes(device)
    # [3] time for the bucket to fill: every all-reduce starts with a full bucket
    rate = None if link is None else link.rate_bytes_per_s
    fill_s = 1.2 * link.burst_bytes / rate if rate else 0.0
    starts: list[list[float]] = [[] for _ in sizes]
    ends: list[list[float]] = [[] for _ in sizes]
    counted: list[list[float]] = [[] for _ in sizes]  # per repetition: the bound pairs them
    for r in range(args.repeats):
        order = range(len(sizes)) if r % 2 == 0 else reversed(range(len(sizes)))
        for i in order:
            dist.barrier()
            before = link_bytes()
            time.sleep(fill_s)
            dist.barrier()
            sync(device)
            starts[i].append(time.perf_counter())
            dist.all_reduce(tensors[i])
            sync(device)
            ends[i].append(time.perf_counter())
            dist.barrier()
            after = link_bytes()
            if before is not None:
                counted[i].append(after - before - 2 * per_barrier)
    c = slow_link.counters() if dist.get_rank() == 0 else None
    return {
        "sizes": sizes,
        "seconds": [spans(s, e) for s, e in zip(starts, ends, strict=True)],
        "link_bytes": [sum(x) / len(x) for x in counted] if per_barrier is not None else None,
        "link_bytes_each": counted if per_barrier is not None else None,
        "barrier_bytes": per_barrier,
        "drops": None if c is None else c["drops"],
        "fill_s": fill_s,
    }


def ddp_rounds(args, data, device, rates: list | None, link) -> dict:
    """Step 4: every round visits every rate (the order reversed every other round) and
    times one step of every variant there (their order reversed too), so that a machine
    getting busier favours no rate and no variant. Every step's link bytes are counted
    (each variant that communicates) and its span taken from the first rank's start to
    the last rank's end: a bound on a step needs that step's own bytes, and rank 0's
    clock alone can stop before its last bytes reach the other rank. Returns per rate."""
    kb = args.bucket_kb
    variants = [
        Variant("naive", args, device, kb, "naive"),
        Variant("overlapped", args, device, kb, "overlap"),
        Variant("DDP", args, device, kb, "ddp"),
        Variant("no communication", args, device, kb, "none"),
    ]
    order = rates if rates is not None else [None if link is None else link.rate_mbit]
    out = {
        r: {
            "variants": {v.name: [] for v in variants},
            "backward": [],
            "link_bytes": {v.name: [] for v in variants if v.kind != "none"},
            "starts": {v.name: [] for v in variants},
            "ends": {v.name: [] for v in variants},
        }
        for r in order
    }
    per_barrier = {}  # link bytes of one barrier, at each rate
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * args.batch_size // n, (rank + 1) * args.batch_size // n)
    x, y = data.batch(args.batch_size, args.seq_len, 0, args.seed)
    x, y = x[mine].to(device), y[mine].to(device)
    for v in variants:  # warm-up: HandDDP builds its buckets in its first step, as DDP does
        v.step(x, y)
    for r in range(args.repeats):
        for rate in order if r % 2 == 0 else order[::-1]:
            switch(rate, rates, link)
            counting = link is not None  # the same on every rank
            if counting and rate not in per_barrier:
                per_barrier[rate] = barrier_bytes(device)
            for v in variants if r % 2 == 0 else variants[::-1]:
                dist.barrier()  # every rank starts the variant together
                before = link_bytes() if counting else None
                out[rate]["starts"][v.name].append(time.perf_counter())
                v.step(x, y)
                out[rate]["ends"][v.name].append(time.perf_counter())
                if counting and v.kind != "none":
                    dist.barrier()
                    after = link_bytes()
                    if before is not None:  # rank 0
                        out[rate]["link_bytes"][v.name].append(after - before - per_barrier[rate])
                out[rate]["variants"][v.name].append(v.seconds[-1])
                if v.kind == "none":
                    out[rate]["backward"].append(v.backward_seconds[-1])
    hand = variants[0].hand
    psi = sum(p.numel() * p.element_size() for p in variants[-1].model.parameters())
    for o in out.values():  # every rank joins, in the same order
        o["spans"] = {name: spans(o["starts"][name], o["ends"][name]) for name in o["starts"]}
    return {
        rate: {
            "buckets": len(hand.buckets),
            "bucket_bytes": bucket_bytes(hand),
            "psi_bytes": psi,
            "variants": o["variants"],
            "spans": o["spans"],
            "backward_s": statistics.median(o["backward"]),
            "link_bytes": {k: b[0] for k, b in o["link_bytes"].items() if b} or None,
            "link_bytes_each": {k: b for k, b in o["link_bytes"].items() if b} or None,
        }
        for rate, o in out.items()
    }


def main() -> None:
    args = parse_args()
    link, rates = link_and_rates(args, "allreduce_sweep.py")
    if args.ddp:
        parallel.require_batch_split(args.batch_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    device = info.device
    if info.world_size == 1:
        labdist.print0(
            "one process: an all-reduce sends nothing, so no byte crosses any link; the "
            "times below are the collective's own overhead. Start 2 or more processes."
        )
    metrics.emit(
        {
            "event": "link",
            "procs": info.world_size,
            "backend": info.backend,
            "device": str(device),
            "shaped": link is not None,
            "counted": link is not None,
            "burst_bytes": None if link is None else link.burst_bytes,
            "latency_ms": None if link is None else link.latency_ms,
            "mtu": None if link is None else link.mtu,
            "rates": [None if link is None else link.rate_mbit] if rates is None else rates,
        }
    )
    for rate in rates or [None if link is None else link.rate_mbit]:
        here = switch(rate, rates, link)
        label = here.label if here is not None else "the link this job runs on (not counted)"
        result = sweep(args, device, here)
        metrics.emit({"event": "sweep", "rate_mbit": rate, **result})
        biggest = result["sizes"][-1]
        labdist.print0(
            f"{label}: all-reduce of {biggest / 1024:,.0f} KiB in "
            f"{statistics.median(result['seconds'][-1]) * 1e3:.1f} ms (median of "
            f"{args.repeats})"
            + (
                f", {result['link_bytes'][-1] / biggest:.3f} bytes on the link per payload byte"
                if result["link_bytes"]
                else ""
            )
        )
    if args.ddp:
        steps = ddp_rounds(args, parallel.corpus(args), device, rates, link)
        for rate, at_rate in steps.items():
            metrics.emit(
                {
                    "event": "ddp",
                    "rate_mbit": rate,
                    "bucket_kb": args.bucket_kb,
                    "repeats": args.repeats,
                    **at_rate,
                }
            )
            med = {k: statistics.median(v) * 1e3 for k, v in at_rate["variants"].items()}
            name = f"{rate:g} Mbit/s" if rate is not None else "unshaped"
            name = name if link is not None else "the link this job runs on"
            labdist.print0(
                f"DDP at {name}: median step (ms) "
                + ", ".join(f"{k} {t:.1f}" for k, t in med.items())
            )
    labdist.shutdown()


if __name__ == "__main__":
    main()
