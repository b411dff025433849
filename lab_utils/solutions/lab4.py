"""Reference solutions for Lab 4 (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def training_state_bytes(n_params: int, optimizer: str, mixed_precision: bool) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state for ``n_params`` weights.

    fp32: 4-byte weights and gradients; SGD with momentum keeps one 4-byte buffer,
    Adam two (first and second moment). Mixed precision (ZeRO paper): 2-byte fp16
    weights and gradients, and the optimizer keeps an fp32 master copy (4 bytes)
    besides its fp32 buffers.
    """
    buffers = {"momentum": 1, "adam": 2}[optimizer]
    if mixed_precision:
        return {
            "params": 2 * n_params,
            "grads": 2 * n_params,
            "optimizer": (4 + 4 * buffers) * n_params,
        }
    return {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": 4 * buffers * n_params}


def mlp_column_row_shard(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, rank: int, n: int
) -> torch.Tensor:
    """Rank ``rank``'s partial output of ``gelu(x W1ᵀ + b1) W2ᵀ``: its block of W1's
    rows (= output columns of the first layer) and b1, and the matching block of
    W2's columns (= input rows of the second). Summing the n partials (the
    all-reduce) gives the full output, without the second bias."""
    cols = w1.shape[0] // n
    part = slice(rank * cols, (rank + 1) * cols)
    return F.gelu(x @ w1[part].T + b1[part]) @ w2[:, part].T


def attention_heads_shard(
    x: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor,
    wk: torch.Tensor,
    bk: torch.Tensor,
    wv: torch.Tensor,
    bv: torch.Tensor,
    wo: torch.Tensor,
    n_heads: int,
    rank: int,
    n: int,
) -> torch.Tensor:
    """Rank ``rank``'s partial output of causal self-attention computed with its
    ``n_heads / n`` heads: the heads' rows of Wq, Wk, Wv and their columns of Wo."""
    b, t, d = x.shape
    hd = d // n_heads
    width = d // n
    part = slice(rank * width, (rank + 1) * width)

    def heads(z: torch.Tensor) -> torch.Tensor:
        return z.view(b, t, -1, hd).transpose(1, 2)

    q, k, v = (heads(x @ w[part].T + bias[part]) for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, width) @ wo[:, part].T


def top_k_route(logits: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, ...]:
    """Top-k routing with a capacity per expert, for ``logits`` of shape ``(N, E)``.

    Returns ``(experts, gates, slots, kept)``, each ``(N, k)``: the chosen experts in
    order of preference, their softmax probabilities renormalised over the k choices,
    each choice's slot in its expert's buffer (how many choices of that expert came
    before it: every token's first choice, in token order, then every second choice, …),
    and whether the slot is below ``capacity`` (a choice beyond it is dropped).
    """
    probs = torch.softmax(logits, dim=-1)
    top, experts = probs.topk(k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True)
    n, n_experts = logits.shape
    onehot = F.one_hot(experts.T.reshape(-1), n_experts)  # (k·N, E), choice-major
    slots = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(k, n).T
    return experts, gates, slots, slots < capacity


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, pass_kv: Callable
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
