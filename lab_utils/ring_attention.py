"""Pieces for context parallelism: the sequence cut into one contiguous chunk per rank
(:func:`chunk`, with its ring attention :func:`ring_attention`, which is also the reference
of Lab 4.7's exercise), or into the load-balanced zig-zag layout (:func:`zigzag_chunk`,
with its ring attention :func:`zigzag_ring_attention`), and a differentiable pass of a
tensor one step around the ring of ranks.

:func:`ring_pass` sends this rank's tensor to the next rank and returns the previous
rank's; its backward sends the gradient the other way (to the previous rank) and
receives the next rank's, so autograd differentiates a ring-attention forward written
with it (:class:`Ring` makes sure every rank runs every pass's backward). :func:`simulated_ring` gives the same passes inside one process, from the
chunks of every rank, so a ring-attention function can be checked without processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

Pass = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk(t: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of ``t`` along the sequence dimension ``dim``."""
    return t.chunk(world, dim=dim)[rank]


def zigzag_chunk(t: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s load-balanced share of ``t`` along ``dim``: the sequence is cut into
    2·world equal chunks and the rank holds chunk ``rank`` and chunk ``2·world − 1 − rank``
    (one early, one late), so every rank meets the same number of unmasked causal scores
    (the zig-zag layout of the Ultra-Scale Playbook's context-parallelism section)."""
    parts = t.chunk(2 * world, dim=dim)
    return torch.cat([parts[rank], parts[2 * world - 1 - rank]], dim=dim)


def zigzag_unchunk(shares: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag share (the inverse of
    :func:`zigzag_chunk`): the ranks' early halves in rank order, then their late halves in
    reverse rank order."""
    halves = [s.chunk(2, dim=dim) for s in shares]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, pass_kv: Pass
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, which is cut into
    ``world`` contiguous chunks (rank r holds positions r·t … (r+1)·t − 1 of q, k, v,
    each ``(batch, heads, t, head_dim)``). The K/V blocks travel around the ring
    (``pass_kv(k, v)`` returns the previous rank's block); each block updates an
    online softmax: the running row maximum, the running denominator and the
    running weighted sum of values, rescaled by exp(old max − new max) whenever the
    maximum grows. A block from a later rank is all in the future and skipped; the
    rank's own block (the first) gets the causal mask."""
    scale = q.shape[-1] ** -0.5
    t = q.shape[-2]
    row_max = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    denom = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    acc = torch.zeros_like(q)
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    for step in range(world):
        src = (rank - step) % world
        if src <= rank:
            scores = q @ k.transpose(-2, -1) * scale
            if src == rank:
                scores = scores.masked_fill(future, float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(-1))
            weights = torch.exp(scores - new_max.unsqueeze(-1))
            rescale = torch.exp(row_max - new_max)
            denom = denom * rescale + weights.sum(-1)
            acc = acc * rescale.unsqueeze(-1) + weights @ v
            row_max = new_max
        if step < world - 1:
            k, v = pass_kv(k, v)
    return acc / denom.unsqueeze(-1)


class _Online:
    """The online softmax of one block of query rows: running row maximum, denominator
    and weighted sum of values, updated one block of keys at a time."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q, self.scale = q, q.shape[-1] ** -0.5
        self.row_max = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        self.denom = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
        self.acc = torch.zeros_like(q)

    def add(self, k: torch.Tensor, v: torch.Tensor, diagonal: bool) -> None:
        """Scores against the key block ``k`` (all earlier, or the same positions as the
        queries when ``diagonal``: then the causal mask)."""
        scores = self.q @ k.transpose(-2, -1) * self.scale
        if diagonal:
            n = scores.shape[-1]
            future = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        new_max = torch.maximum(self.row_max, scores.amax(-1))
        weights = torch.exp(scores - new_max.unsqueeze(-1))
        rescale = torch.exp(self.row_max - new_max)
        self.denom = self.denom * rescale + weights.sum(-1)
        self.acc = self.acc * rescale.unsqueeze(-1) + weights @ v
        self.row_max = new_max

    def out(self) -> torch.Tensor:
        return self.acc / self.denom.unsqueeze(-1)


def zigzag_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, pass_kv: Pass
) -> torch.Tensor:
    """Causal ring attention on the zig-zag layout (:func:`zigzag_chunk`): this rank's
    q, k, v hold chunks ``rank`` (early half) and ``2·world − 1 − rank`` (late half).

    At step s the K/V block of rank src = (rank − s) mod world is here. Its halves are
    chunks src and 2·world − 1 − src; a query chunk sees a key chunk entirely when the key
    chunk is earlier, through the causal mask when it is the same, not at all when later:
    - src = rank: early×early (masked), late×early, late×late (masked): 3 quarter blocks;
    - src < rank: both query halves × the early key half: 2 quarter blocks;
    - src > rank: the late query half × both key halves: 2 quarter blocks.
    Every rank computes 2·world + 1 quarter blocks of scores, whatever its rank."""
    half = q.shape[-2] // 2
    early, late = _Online(q[..., :half, :]), _Online(q[..., half:, :])
    for step in range(world):
        src = (rank - step) % world
        k0, k1, v0, v1 = k[..., :half, :], k[..., half:, :], v[..., :half, :], v[..., half:, :]
        if src == rank:
            early.add(k0, v0, diagonal=True)
            late.add(k0, v0, diagonal=False)
            late.add(k1, v1, diagonal=True)
        elif src < rank:
            early.add(k0, v0, diagonal=False)
            late.add(k0, v0, diagonal=False)
        else:
            late.add(k, v, diagonal=False)
        if step < world - 1:
            k, v = pass_kv(k, v)
    return torch.cat([early.out(), late.out()], dim=-2)


def score_blocks(rank: int, world: int, layout: str) -> int:
    """Causal score blocks rank ``rank`` computes in ring attention, in units of one
    (T/2n)² block (a quarter of a contiguous rank's chunk × chunk): contiguous, rank r
    computes its own block and those of the r earlier ranks, 4·(r + 1); zig-zag, every rank
    2·world + 1 (:func:`zigzag_ring_attention`)."""
    if layout == "contiguous":
        return 4 * (rank + 1)
    if layout == "zigzag":
        return 2 * world + 1
    raise ValueError(f"unknown layout {layout!r}: 'contiguous' or 'zigzag'")


def _exchange(t: torch.Tensor, to: int, frm: int, group=None) -> torch.Tensor:
    out = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), to, group),
        dist.P2POp(dist.irecv, out, frm, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx.peers = (
            dist.get_global_rank(group, (rank - 1) % world) if group else (rank - 1) % world,
            dist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world,
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
