"""Reference solutions of the Lab 2 exercises (used when ``LABS_SOLUTIONS=1``).

Written the way the notebooks ask for them; the tested library versions live in
:mod:`lab_utils.collectives`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def ring_all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    """Sum of ``x`` over the ring of ``comm``'s ranks: reduce-scatter, then all-gather."""
    n, r = comm.world_size, comm.rank
    result = x.detach().clone().reshape(-1)
    if n == 1:
        return result.view_as(x)
    base, extra = divmod(result.numel(), n)
    sizes = [base + (1 if i < extra else 0) for i in range(n)]
    chunks = list(torch.split(result, sizes))
    right, left = (r + 1) % n, (r - 1) % n

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        # Post the send first: if every rank blocked in recv(), nobody would send.
        work = comm.isend(send, right) if send.numel() else None
        if recv.numel():
            comm.recv(recv, left)
        if work is not None:
            work.wait()

    for step in range(n - 1):  # reduce-scatter: add what the left neighbour sends
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], buf)
        chunks[recv_i] += buf
    for step in range(n - 1):  # all-gather: pass the complete chunks round
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        exchange(chunks[send_i], chunks[recv_i])
    return result.view_as(x)


def ring_time(nbytes: float, world_size: int, latency_s: float, bandwidth: float) -> float:
    """α–β model: 2(N−1) messages of latency α, and 2(N−1)/N · S bytes at bandwidth B."""
    if world_size < 2:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * latency_s + steps / world_size * nbytes / bandwidth


def shard_indices(n: int, rank: int, world_size: int, epoch: int, seed: int = 0) -> torch.Tensor:
    """This rank's sample indices for one epoch, as ``DistributedSampler`` picks them.

    Every rank draws the same permutation (same seed, same epoch), pads it by wrapping
    round to a multiple of ``world_size`` so all ranks get the same number of samples,
    and takes every ``world_size``-th index starting at its rank.
    """
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g)
    total = -(-n // world_size) * world_size
    if total > n:  # wrap round (more than once if there are fewer samples than ranks)
        perm = perm.repeat(-(-total // n))[:total]
    return perm[rank::world_size]


def scaling_efficiency(throughput: Mapping[int, float]) -> dict[int, float]:
    """Efficiency of N processes: throughput(N) / (N · throughput(1))."""
    base = throughput[1]
    return {n: t / (n * base) for n, t in throughput.items()}


def time_to_target(evals: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose accuracy reached ``target`` (``None``
    if none did). ``evals``: the run's ``{"seconds", "val_acc"}`` records in time order."""
    for e in evals:
        if e["val_acc"] >= target:
            return e["seconds"]
    return None
