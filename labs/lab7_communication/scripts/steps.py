"""What Lab 7's training scripts share: the batches, a step loop that counts each step's
all-reduce bytes (``lab_utils.traffic``) and, inside a slow link, the bytes the link
carried (the qdisc's own counter), times it, and averages its loss; and the link's rate,
changed in the job between runs (``--rates``, :func:`switch`)."""

import argparse
import dataclasses
import time

import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import parallel, slow_link, traffic


def batches(args, device) -> list:
    """The --steps global batches, the same on every rank (seeded by step)."""
    data = parallel.corpus(args)
    return [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]


# ----------------------------------------------------------------- the link's rate


def add_rates_arg(p: argparse.ArgumentParser) -> None:
    """The ``--rates`` option: the link rates a job runs at, one after the other."""
    p.add_argument(
        "--rates",
        nargs="+",
        default=None,
        help="link rates (Mbit/s, or 'none': unshaped) run one after the other; needs "
        "the job inside a slow link (python -m lab_utils.slow_link ... -- torchrun ...)",
    )


def rate_of(word: str) -> float | None:
    """A --rates word: Mbit/s, or ``None`` for 'none' (the same loopback unshaped)."""
    return None if word.lower() == "none" else float(word)


def link_and_rates(args: argparse.Namespace, script: str) -> tuple[slow_link.Link | None, list]:
    """The link this job runs on (``None``: none of its own) and the rates of --rates
    (``None`` when not given). Stops the job (before it joins the group, so nobody
    waits) when --rates is given outside a link: only the job's own link may change."""
    link = slow_link.current()
    rates = [rate_of(w) for w in args.rates] if args.rates else None
    parallel.require(
        rates is None or link is not None,
        "--rates changes the job's own link: start the job inside one, e.g. "
        "python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone "
        f"--nproc-per-node 2 {script} --rates 50 none",
    )
    return link, rates


def rates_to_run(rates: list | None, link: slow_link.Link | None) -> list:
    """The rates a job visits: --rates, else the one it was started on (``None`` off a link)."""
    return rates if rates is not None else [None if link is None else link.rate_mbit]


def link_event(link: slow_link.Link | None, rates: list | None) -> dict:
    """The ``link`` event's fields: whether the job runs on a link of its own (shaped
    and its bytes counted), the bucket, the MTU, and the rates it visits."""
    return {
        "shaped": link is not None,
        "counted": link is not None,
        "burst_bytes": None if link is None else link.burst_bytes,
        "latency_ms": None if link is None else link.latency_ms,
        "mtu": None if link is None else link.mtu,
        "rates": rates_to_run(rates, link),
    }


def switch(rate: float | None, rates: list | None, link: slow_link.Link | None):
    """The job's link at ``rate`` (changed by rank 0 when --rates asks for several)."""
    if rates is None:
        return link
    dist.barrier()
    time.sleep(0.05)  # nothing in flight while the qdisc is replaced
    if dist.get_rank() == 0:  # the job's own link: one rank changes it for all
        slow_link.set_rate(rate)
    dist.barrier()
    return dataclasses.replace(link, rate_mbit=rate)


def link_bytes() -> int | None:
    """The bytes the job's link has carried so far (rank 0 reads, None when uncounted)."""
    if dist.get_rank() != 0:
        return None
    c = slow_link.counters()
    return None if c is None else c["bytes"]


def barrier_bytes(device=None, n: int = 10) -> float | None:
    """Link bytes of one barrier, from ``n`` of them (None on other ranks, or uncounted)."""
    dist.barrier()
    before = link_bytes()
    for _ in range(n):
        dist.barrier()
    after = link_bytes()
    return None if before is None else (after - before) / n


# ----------------------------------------------------------------- the step loop


def run_steps(net, opt, batches: list) -> dict:
    """Train ``net`` on this rank's share of each batch: per step, the loss (mean over
    ranks), the bytes every ``torch.distributed.all_reduce`` carried, the seconds from
    the first rank's start to the last rank's end (every process of one machine reads
    the same monotonic clock), and, inside a link of the job's own, the bytes the link
    carried during the step (rank 0 reads the qdisc's counter between barriers and
    subtracts theirs; ``None`` elsewhere). Every step starts on a barrier, so the
    ranks start together with a link or without."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counted = slow_link.current() is not None  # the same on every rank
    per_barrier = barrier_bytes() if counted else None
    losses, sent, on_link, starts, ends = [], [], [], [], []
    for x, y in batches:
        share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        dist.barrier()
        before = link_bytes() if counted else None
        dist.barrier()  # the counter read lies outside the step's time
        starts.append(time.perf_counter())
        with traffic.count() as seen:
            opt.zero_grad()
            loss = parallel.lm_loss(net(x[share]), y[share])
            loss.backward()
            opt.step()
        ends.append(time.perf_counter())
        if counted:
            dist.barrier()  # every rank's step over: all of its bytes have passed
            after = link_bytes()
            if before is not None:  # rank 0
                on_link.append(after - before - 2 * per_barrier)
        sent.append(seen.get("all_reduce", 0))
        losses.append(labdist.average(loss.item()))
    every = [None] * world
    dist.all_gather_object(every, (starts, ends))
    seconds = [
        max(e[s] for _, e in every) - min(b[s] for b, _ in every) for s in range(len(batches))
    ]
    return {
        "bytes_by_step": sent,
        "link_bytes_by_step": on_link if on_link else None,
        "losses": losses,
        "seconds": seconds,
    }
