"""Pieces for context parallelism: the sequence cut into one contiguous chunk per rank,
and a differentiable pass of a tensor one step around the ring of ranks.

:func:`ring_pass` sends this rank's tensor to the next rank and returns the previous
rank's; its backward sends the gradient the other way (to the previous rank) and
receives the next rank's, so autograd differentiates a ring-attention forward written
with it (:class:`Ring` makes sure every rank runs every pass's backward). :func:`simulated_ring` gives the same passes inside one process, from the
chunks of every rank, so a ring-attention function can be checked without processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as tdist

Pass = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk(t: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of ``t`` along the sequence dimension ``dim``."""
    return t.chunk(world, dim=dim)[rank]


def _exchange(t: torch.Tensor, to: int, frm: int, group=None) -> torch.Tensor:
    out = torch.empty_like(t)
    ops = [
        tdist.P2POp(tdist.isend, t.contiguous(), to, group),
        tdist.P2POp(tdist.irecv, out, frm, group),
    ]
    for work in tdist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        rank, world = tdist.get_rank(group), tdist.get_world_size(group)
        ctx.peers = (
            tdist.get_global_rank(group, (rank - 1) % world) if group else (rank - 1) % world,
            tdist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world,
        )
        prev, nxt = ctx.peers
        return _exchange(t, nxt, prev, group)

    @staticmethod
    def backward(ctx, grad):
        prev, nxt = ctx.peers  # the gradient goes back where the tensor came from
        return _exchange(grad, prev, nxt, ctx.group), None


def ring_pass(k: torch.Tensor, v: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Send this rank's (k, v) block to the next rank and return the previous rank's
    (one message: both stacked). Differentiable: the backward passes gradients back."""
    kv = _RingPass.apply(torch.stack([k, v]), group)
    return kv[0], kv[1]


class Ring:
    """``pass_kv`` for one rank of a real ring of processes (:func:`ring_pass`).

    A causal rank skips the blocks of later ranks, so on that rank the loss does not
    depend on them and autograd would skip their passes' backward, while the peer
    waits for that gradient message. :meth:`tie` makes the output depend (with weight
    zero) on every block received, so every rank runs every pass's backward."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.received: list[torch.Tensor] = []

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = ring_pass(k, v, self.group)
        self.received += [k, v]
        return k, v

    def tie(self, out: torch.Tensor) -> torch.Tensor:
        """``out``, plus zero times every received block."""
        if not self.received:
            return out
        return out + 0.0 * torch.stack([t.sum() for t in self.received]).sum()


def simulated_ring(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], rank: int) -> Pass:
    """For rank ``rank`` of ``len(ks)`` simulated ranks: a pass function that returns, at its
    s-th call, the block of rank (rank − s) mod n, taken from ``ks`` and ``vs`` (slices of the
    full tensors, so gradients flow back to them)."""
    n, calls = len(ks), [0]

    def pass_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        src = (rank - calls[0]) % n
        return ks[src], vs[src]

    return pass_kv
