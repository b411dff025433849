"""Reference solutions for Lab 4 (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn import functional as F

# Two references are library code, re-exported here: lab_utils.moe routes with Lab 4.8's
# top_k_route, and context_parallel.py runs Lab 4.7's ring_attention beside the zig-zag
# ring; a script never imports this module.
from lab_utils.moe import top_k_route as top_k_route
from lab_utils.ring_attention import ring_attention as ring_attention


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


def schedule_bubble(
    actions: Mapping[int, Sequence[tuple[int, str, int]]], cost: Mapping[str, float]
) -> float:
    """The bubble of a pipeline schedule's plan: the idle share of its step, ``1 − mean
    busy time per rank / span``, with every block lasting ``cost[kind]`` and free messages.

    ``actions`` gives per rank the blocks ``(stage, kind, micro-batch)`` in the order the
    rank runs them (torch's plan, :func:`lab_utils.timeline.schedule_actions`). Each block
    starts when its rank is free and the block it needs has ended: F the previous stage's
    F of the micro-batch (stage 0: nothing), B the next stage's B (the last stage: its own
    F, which computed the loss), W its own B. A B with no W of its own (same stage and
    micro-batch: 1F1B's, some of DualPipeV's) is the whole backward and lasts
    ``cost["B"] + cost["W"]``."""
    n_stages = 1 + max(s for acts in actions.values() for s, _, _ in acts)
    split = {(s, i) for acts in actions.values() for s, k, i in acts if k == "W"}

    def length(s: int, k: str, i: int) -> float:
        return cost[k] + (cost["W"] if k == "B" and (s, i) not in split else 0.0)

    def needs(s: int, k: str, i: int) -> tuple[int, str, int] | None:
        if k == "F":
            return (s - 1, "F", i) if s > 0 else None
        if k == "W":
            return (s, "B", i)
        return (s + 1, "B", i) if s < n_stages - 1 else (s, "F", i)

    end: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(actions, 0.0)  # when each rank's previous block ends
    nxt = dict.fromkeys(actions, 0)
    while any(nxt[r] < len(acts) for r, acts in actions.items()):
        moved = False
        for r, acts in actions.items():
            while nxt[r] < len(acts):
                block = tuple(acts[nxt[r]])
                dep = needs(*block)
                if dep is not None and dep not in end:
                    break  # wait for another rank to run it
                end[block] = free[r] = max(free[r], end[dep] if dep else 0.0) + length(*block)
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError("no rank can run its next block: not a valid plan")
    busy = sum(length(*b) for acts in actions.values() for b in acts) / len(actions)
    return 1.0 - busy / max(end.values())


def stage_activation_bytes(cfg, lay, b: int, stage: int) -> float:
    """Peak bytes the blocks of pipeline stage ``stage`` hold for backward on one rank
    (``lab_utils.planner``'s ``Config`` and ``Layout``, micro-batches of ``b`` sequences).

    1F1B has started ``min(pp − stage, microbatches)`` micro-batches on the stage before
    its first backward. Without recomputation each keeps every block's saved tensors.
    With full recomputation each keeps only the blocks' inputs; the backward runs one
    block again at a time, so one block's working set (what it saves, less its input,
    already kept) is added once, not per micro-batch."""
    from lab_utils import planner

    blocks = planner.stage_blocks(cfg.n_layers, lay.pp, stage)
    per_block = planner.block_activation_bytes(cfg, lay, b)
    in_flight = min(lay.pp - stage, lay.microbatches)
    if lay.recompute != "full":
        return in_flight * blocks * per_block
    kept = planner.block_input_bytes(cfg, lay, b)
    working = per_block - kept if blocks else 0.0
    return in_flight * blocks * kept + working


def pieces_to_read(rows: int, saved_ranks: int, rank: int, ranks: int) -> list[tuple[int, ...]]:
    """The pieces of a checkpoint that loading rank ``rank`` of ``ranks`` reads for one
    tensor of ``rows`` rows that ``saved_ranks`` ranks saved, both layouts FSDP's: dim 0
    cut with ``torch.chunk`` (pieces of ⌈rows/n⌉ rows, the last ones shorter).

    Returns ``(saving rank, first row in that rank's saved shard, first row in this
    rank's new shard, rows)`` for every saved shard that overlaps this rank's new one, in
    row order: the saving rank names the file (``__{saving rank}_0.distcp``)."""

    def bounds(n: int) -> list[tuple[int, int]]:
        size = -(-rows // n)  # torch.chunk's piece: rows / n rounded up
        return [(min(i * size, rows), min((i + 1) * size, rows)) for i in range(n)]

    lo, hi = bounds(ranks)[rank]
    out = []
    for saver, (a, b) in enumerate(bounds(saved_ranks)):
        start, end = max(a, lo), min(b, hi)
        if start < end:
            out.append((saver, start - a, start - lo, end - start))
    return out
