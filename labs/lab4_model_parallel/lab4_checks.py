"""Self-checks for Lab 4: the memory formula, the column/row and head splits, and
the claims the notebooks measure (bubble, equal gradients and weights, sharded
memory). Each raises :class:`~lab_utils.checks.CheckFailed` when it does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch.nn import functional as F

import lab4_solutions as reference
from lab_utils import memory, timeline
from lab_utils.checks import close, count, fail, passed, shown, that, within_run


# --------------------------------------------------------------------- exercises
def check_training_state_bytes(fn: Callable) -> None:
    """The student's formula against the reference on every optimizer and precision."""
    for n_params in (1, 1000, 175_000_000_000):
        for opt in ("momentum", "adam"):
            for mixed in (False, True):
                got, want = (
                    fn(n_params, opt, mixed),
                    reference.training_state_bytes(n_params, opt, mixed),
                )
                if not isinstance(got, Mapping) or set(got) != set(want):
                    fail(
                        "training_state_bytes",
                        f"returned {got!r}",
                        "return a dict with keys 'params', 'grads', 'optimizer'",
                    )
                for key in want:
                    if got[key] != want[key]:
                        per = got[key] / n_params
                        fail(
                            "training_state_bytes",
                            f"{opt}, mixed_precision={mixed}: {key} = {per:g} bytes per parameter, "
                            f"expected {want[key] / n_params:g}",
                            "fp32 = 4 bytes, fp16 = 2; momentum is one buffer, Adam two; mixed "
                            "precision keeps an fp32 master copy of the weights in the optimizer",
                        )
    passed("training_state_bytes: momentum and Adam, fp32 and mixed precision")


# The split-layer exercises (MLP, attention heads, ring attention) compare the ranks'
# combined outputs and the gradients with the unsplit computation the same way.
def _parts_shaped(
    check: str,
    parts: list,
    shape: torch.Size,
    *,
    what: str = "partial outputs",
    per: str = "",
    hint: str = "",
) -> None:
    if any(not isinstance(p, torch.Tensor) or p.shape != shape for p in parts):
        fail(
            check,
            f"{what} have shapes {[tuple(getattr(p, 'shape', ())) for p in parts]}, "
            f"expected {tuple(shape)}{per}",
            hint,
        )


def _outputs_close(out: torch.Tensor, full: torch.Tensor, label: str, *, hint: str) -> float:
    return close(out.detach(), full.detach(), what=f"{label}: outputs", rtol=1e-5, hint=hint)


def _grads_close(
    check: str,
    label: str,
    grads: Iterable[tuple[str, torch.Tensor | None, torch.Tensor]],
    *,
    hint: str = "",
    rtol: float = 1e-5,
    atol: float = 0.0,
    skip: tuple[str, ...] = (),
) -> float:
    """Every (name, gradient, wanted) pair: a gradient arrives, and (unless skipped) it
    equals the unsplit one. Returns the largest relative error."""
    worst = 0.0
    for name, got, want in grads:
        if got is None:
            fail(check, f"no gradient reaches {name}", hint)
        if name not in skip:
            worst = max(
                worst,
                close(got, want, what=f"{label}: gradient of {name}", rtol=rtol, atol=atol),
            )
    return worst


def _sum_of_parts_agrees(
    check: str,
    label: str,
    full: torch.Tensor,
    parts: list,
    params: Iterable[tuple[str, torch.Tensor]],
    *,
    bias: torch.Tensor | None = None,
    shape_hint: str = "",
    out_hint: str,
    grad_hint: str = "",
    rtol: float = 1e-5,
    atol: float = 0.0,
    skip: tuple[str, ...] = (),
) -> float:
    """A tensor-parallel split: the ranks' partial outputs summed (+ ``bias``) equal the
    unsplit ``full``, and so do the gradients of Σ out² with respect to every parameter.
    Returns the largest relative error."""
    names, tensors = zip(*params)
    want = torch.autograd.grad((full**2).sum(), tensors)
    _parts_shaped(check, parts, full.shape, hint=shape_hint)
    out = torch.stack(parts).sum(0) + (0 if bias is None else bias)
    worst = _outputs_close(out, full, label, hint=out_hint)
    got = torch.autograd.grad((out**2).sum(), tensors, allow_unused=True)
    return max(
        worst,
        _grads_close(
            check, label, zip(names, got, want), hint=grad_hint, rtol=rtol, atol=atol, skip=skip
        ),
    )


def _mlp_case(seed: int, d: int = 8, hidden: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, d, generator=g)
    w1, b1 = torch.randn(hidden, d, generator=g), torch.randn(hidden, generator=g)
    w2, b2 = torch.randn(d, hidden, generator=g), torch.randn(d, generator=g)
    return x, w1, b1, w2, b2


def check_mlp_column_row_shard(fn: Callable) -> float:
    """Σ_r partial_r + b2 equals the unsplit MLP, outputs and gradients, for n = 1, 2, 4."""
    worst = 0.0
    for n in (1, 2, 4):
        x, w1, b1, w2, b2 = _mlp_case(n)
        params = [t.requires_grad_() for t in (w1, b1, w2)]
        worst = max(
            worst,
            _sum_of_parts_agrees(
                "mlp_column_row_shard",
                f"column→row split, n={n}",
                F.gelu(x @ w1.T + b1) @ w2.T + b2,
                [fn(x, w1, b1, w2, r, n) for r in range(n)],
                zip(("W1", "b1", "W2"), params),
                bias=b2,  # what the all-reduce computes: the partial sums, then b2 once
                shape_hint="each rank returns a full-width (…, d) partial sum",
                out_hint="rank r takes rows r·h/n…(r+1)·h/n of W1 and b1 and the same "
                "columns of W2",
                grad_hint="compute with the tensors you were given (slices keep the graph)",
            ),
        )
    return worst


def _attention(x, wq, bq, wk, bk, wv, bv, wo, n_heads):
    return reference.attention_heads_shard(x, wq, bq, wk, bk, wv, bv, wo, n_heads, 0, 1)


def check_attention_heads_shard(fn: Callable) -> float:
    """Σ_r partial_r equals full attention (outputs and gradients) for n = 1, 2, 4."""
    worst = 0.0
    n_heads, d = 4, 16
    for n in (1, 2, 4):
        g = torch.Generator().manual_seed(10 + n)
        x = torch.randn(2, 6, d, generator=g)
        ws = [
            torch.randn(d, d, generator=g) / d**0.5
            if i % 2 == 0 or i == 6
            else torch.randn(d, generator=g)
            for i in range(7)
        ]
        ws = [w.requires_grad_() for w in ws]
        worst = max(
            worst,
            _sum_of_parts_agrees(
                "attention_heads_shard",
                f"heads split, n={n}",
                _attention(x, *ws, n_heads),
                [fn(x, *ws, n_heads, r, n) for r in range(n)],
                zip(("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo"), ws),
                out_hint="rank r owns heads r·H/n…(r+1)·H/n: those rows of "
                "Wq, Wk, Wv (and biases) and those columns of Wo",
                rtol=1e-4,
                atol=1e-5,
                skip=("bk",),  # zero in exact arithmetic: a key bias cannot change a softmax
            ),
        )
    return worst


# ------------------------------------------------------------------ measurements
def check_state_matches_formula(
    measured: Mapping[str, float], formula: Mapping[str, float], *, what: str, rtol: float = 0.0
) -> None:
    """Measured bytes per kind equal the formula (exactly, or within ``rtol``)."""
    for key, want in formula.items():
        got = measured[key]
        if abs(got - want) > rtol * want + 0.5:
            fail(
                what,
                f"{key}: measured {got:,.0f} bytes, formula says {want:,.0f}",
                "count every tensor of that kind on this rank; sharded tensors only their shard",
            )
    passed(what, ", ".join(f"{k} {measured[k] / 2**20:.2f} MiB" for k in formula))


def check_schedule(run: Mapping) -> None:
    """Counts, exact on any machine: every stage ran m forwards and m backwards, in the
    order of the run's schedule (GPipe: all F, then all B; 1F1B: p − rank F, then B and F
    alternating). One line when it holds; the first stage that differs when not."""
    p, m, name = run["stages"], run["microbatches"], run["schedule"]
    order = timeline.measured_order(run["events"])
    for rank in range(p):
        blocks, want = order.get(rank, []), timeline.schedule_order(name, p, m, rank)
        if blocks == want:
            continue
        for kind in ("F", "B"):
            count(
                sum(1 for k, _ in blocks if k == kind),
                m,
                what=f"{name} m={m}, stage {rank}: {kind} blocks",
                hint="each micro-batch crosses every stage once forward and once backward",
            )
        count(
            sum(1 for got, w in zip(blocks, want) if got != w),
            0,
            what=f"{name} m={m}, stage {rank}: blocks out of the schedule's order",
            hint=f"{name} runs {' '.join(f'{k}{i}' for k, i in want)}; this stage ran "
            f"{' '.join(f'{k}{i}' for k, i in blocks)}",
        )
    count(
        sum(len(order.get(r, [])) for r in range(p)),
        2 * m * p,
        what=f"{name} m={m}, {p} stages: F and B blocks, each stage in the schedule's order",
    )


_FLOOR = 1e-4  # timestamps near 1.7e9 s carry ~0.2 µs of rounding per block


def _replayed(run: Mapping) -> tuple[float, float, float]:
    """The run's measured bubble, the bubble its schedule replayed with its own block times
    gives, and the replay's noise."""
    rep = timeline.replay(run["events"], run.get("order") or run["schedule"])
    return (
        timeline.bubble_fraction(run["events"]),
        rep.bubble,
        timeline.replay_noise(run["events"], rep),
    )


def _bubble_what(run: Mapping) -> str:
    return (
        f"{run['schedule']} m={run['microbatches']}, {run['stages']} stages: "
        "bubble = the schedule replayed with this run's block times"
    )


def check_bubble(run: Mapping, *, k: float = 4.0) -> float:
    """The measured bubble equals the bubble the run's schedule must have given its own
    measured block durations and overheads (:func:`lab_utils.timeline.replay`), within
    ``k`` × the run's own spread. A stage that idles for another reason, or a schedule that
    is not the one named, fails. Returns the margin (a share of the step)."""
    # Every timed step, when the run kept them: another program on the machine delays a
    # block now and then (one step), a stage that idles for a reason of its own does so in
    # every step. So the least disturbed step must agree; how many did is printed.
    steps = run.get("every_step_bubble") or []
    if len(steps) > 1:
        gaps = [
            k * noise + _FLOOR - abs(measured - replayed) for measured, replayed, noise in steps
        ]
        measured, replayed, noise = steps[max(range(len(steps)), key=gaps.__getitem__)]
        which = (
            f" (the least disturbed of {len(steps)} timed steps; "
            f"{sum(g >= 0 for g in gaps)} of {len(steps)} agree)"
        )
    else:
        (measured, replayed, noise), which = _replayed(run), ""
    return _bubble_within_run(measured, replayed, noise, what=_bubble_what(run) + which, k=k)


def check_step_bubble(run: Mapping, *, k: float = 4.0) -> float | None:
    """The measured bubble equals the bubble the run's schedule must have given its own
    measured block durations and overheads (:func:`lab_utils.timeline.replay`), within
    ``k`` × the run's own spread, on the step the table and the figure show (the fastest
    timed step). A stage that idles for another reason, or a schedule that is not the one
    named, fails. Returns the margin (a share of the step), or None when the run cannot
    resolve it: where the allowed margin is at least the replayed bubble, a timeline with
    no idle time at all would agree too, so the comparison is shown, not passed."""
    # run["events"] is that step's timeline (pipeline_schedules.py keeps the fastest);
    # no step is picked here by how well it agrees.
    measured, replayed, noise = _replayed(run)
    return bubble_agrees(measured, replayed, noise, what=_bubble_what(run), k=k, floor=_FLOOR)


def bubble_agrees(
    measured: float, replayed: float, noise: float, *, what: str, k: float = 4.0, floor: float = 0.0
) -> float | None:
    """``measured`` = ``replayed`` within ``k`` × ``noise`` + ``floor``, asserted only where
    that margin is smaller than the replayed bubble (so a timeline with no idle time
    fails); otherwise shown as not resolved and None returned."""
    allowed = k * noise + floor
    if allowed >= replayed:
        shown(
            what,
            f"measured {measured:.4g}, replayed {replayed:.4g}, this run's spread allows "
            f"±{allowed:.3g} — not resolved: a timeline with no idle time would agree too",
            "blocks this short vary by more than the bubble the schedule leaves",
        )
        return None
    return _bubble_within_run(measured, replayed, noise, what=what, k=k, floor=floor)


def _bubble_within_run(
    measured: float, replayed: float, noise: float, *, what: str, k: float, floor: float = _FLOOR
) -> float:
    return within_run(
        measured,
        replayed,
        noise=noise,
        k=k,
        floor=floor,
        what=what,
        hint="a stage idled where the schedule gives it work: look for a wide "
        "white gap on the timeline that no arrow of the schedule explains",
    )


def check_in_flight(in_flight: Mapping[str, Mapping[int, int]], p: int, m: int) -> None:
    """GPipe holds all m micro-batches on every stage; 1F1B at most p − rank."""
    for rank in range(p):
        g, f = in_flight["gpipe"][rank], in_flight["1f1b"][rank]
        if g != m or f > min(m, p - rank):
            fail(
                "peak in-flight micro-batches",
                f"rank {rank}: GPipe {g} (expected {m}), 1F1B {f} (expected ≤ {min(m, p - rank)})",
            )
    passed(
        "peak in-flight micro-batches: GPipe m on every stage, 1F1B ≤ p − rank",
        f"GPipe {[in_flight['gpipe'][r] for r in range(p)]}, 1F1B {[in_flight['1f1b'][r] for r in range(p)]}",
    )


def check_equal(err: float, *, what: str, tol: float = 1e-5) -> float:
    """A relative error (split vs unsplit) at float32 rounding level."""
    that(
        err <= tol,
        what=what,
        detail=f"relative error {err:.1e} (tolerance {tol:.0e})",
        hint="the split computes something else than the unsplit model",
    )
    return err


def check_sharded_memory(
    per_rank: Mapping[str, float],
    psi: int,
    n: int,
    stage: int,
    k: int,
    *,
    what: str,
    slack: float = 0.10,
) -> None:
    """Per-rank bytes of a ZeRO stage ≤ (1 + slack) × the formula, and ≥ (1 − slack) ×."""
    want = memory.zero_bytes_per_rank(psi, n, stage, k)
    for key, w in want.items():
        got = per_rank[key]
        if not (1 - slack) * w <= got <= (1 + slack) * w:
            fail(
                what,
                f"{key}: {got:,.0f} bytes per rank, formula {w:,.0f} (±{slack:.0%})",
                "ZeRO-1 shards the optimizer state, ZeRO-2 also gradients, ZeRO-3/FSDP all three",
            )
    passed(what, ", ".join(f"{k} {per_rank[k] / want[k]:.2f}× formula" for k in want))


# ------------------------------------------------------------------ experts (notebook 8)
def _route_cases() -> list[tuple[torch.Tensor, int, int]]:
    g = torch.Generator().manual_seed(8)
    skewed = torch.randn(40, 4, generator=g)
    skewed[:, 1] += 2.0  # most tokens prefer expert 1: its slots run out
    return [
        (torch.randn(12, 4, generator=g), 1, 3),
        (torch.randn(12, 4, generator=g), 2, 6),
        (skewed, 2, 12),
        (torch.randn(30, 8, generator=g), 2, 5),
    ]


def check_top_k_route(fn: Callable) -> None:
    """The student's router against the reference: the experts chosen, their gates, the
    slot of every choice and which choices the capacity drops, on cases with drops."""
    names = ("experts", "gates", "slots", "kept")
    hints = {
        "experts": "take the k largest router probabilities, best first (topk)",
        "gates": "softmax over all experts, then divide the k chosen by their sum",
        "slots": "count, per expert, the choices before this one: all first choices in "
        "token order come before any second choice",
        "kept": "a choice is kept when its slot < capacity",
    }
    for logits, k, cap in _route_cases():
        got, want = fn(logits, k, cap), reference.top_k_route(logits, k, cap)
        if not isinstance(got, tuple) or len(got) != 4:
            fail(
                "top_k_route",
                f"returned {type(got).__name__}",
                "return (experts, gates, slots, kept)",
            )
        for name, a, b in zip(names, got, want):
            ok = a.shape == b.shape and (torch.allclose(a.float(), b.float(), atol=1e-6))
            if not ok:
                fail(
                    "top_k_route",
                    f"{name} differ for {logits.shape[0]} tokens, {logits.shape[1]} "
                    f"experts, k={k}, capacity {cap}: got {a.tolist()[:3]}…, expected "
                    f"{b.tolist()[:3]}…",
                    hints[name],
                )
    passed(
        "top_k_route: experts, gates, slots and drops equal the reference",
        f"{len(_route_cases())} cases, with and without drops",
    )


def check_moe_run(run: Mapping, *, tol: float = 1e-5) -> None:
    """An expert-parallel run: outputs, gradients and weights equal one process (float32
    rounding), every all-to-all carried E · capacity · d values (a count), four per MoE
    layer per step (dispatch and combine, forward and backward), and every choice is
    accounted for (tokens per expert sum to tokens × k on each layer)."""
    for key in ("outputs", "gradients", "weights"):
        check_equal(
            run["errors"][key],
            tol=tol,
            what=f"{run['experts']} experts on {run['procs']} ranks: {key} = one process",
        )
    count(
        len(run["all_to_all_bytes"]),
        4 * run["layers"],
        what="all-to-alls in one step: 2 per MoE layer forward, 2 backward",
    )
    for i, b in enumerate(run["all_to_all_bytes"]):
        count(
            b,
            run["formula_bytes"],
            what=f"bytes of all-to-all {i}: E · capacity · d · 4",
            hint="each rank sends every expert's capacity slots, empty ones included",
        )
    tokens = run["tokens_per_rank"] * run["procs"] * run["top_k"]
    for i, per in enumerate(run["first"]):
        count(sum(per), tokens, what=f"layer {i}: choices routed = tokens × k")


# --------------------------------------------------------------- checkpoints (notebook 9)
def check_resharded(loaded: Mapping, saved: Mapping) -> None:
    """A checkpoint saved by ``saved['procs']`` ranks and loaded by ``loaded['procs']``:
    one data file per saving rank plus ``.metadata`` (a count), and the loaded model and
    optimizer state equal what the saving run held in memory (bit for bit: loading copies
    bytes, it computes nothing)."""
    data = [f for f in saved["files"] if f.endswith(".distcp")]
    count(len(data), saved["procs"], what=f"data files written by {saved['procs']} ranks")
    that(
        ".metadata" in saved["files"],
        what="the coordinator wrote .metadata",
        detail=", ".join(saved["files"]),
        hint="dcp.save writes it last, after every rank's data",
    )
    for key in ("model", "optim"):
        check_equal(
            loaded["errors"][key],
            tol=0.0,
            what=f"saved on {saved['procs']} ranks, loaded on {loaded['procs']}: {key} state",
        )


def check_incomplete(files: list[str], error: BaseException | None) -> None:
    """A save that died before its end: data files but no ``.metadata``, and loading it
    fails instead of reading a partial state."""
    that(
        any(f.endswith(".distcp") for f in files) and ".metadata" not in files,
        what="a save killed before its end leaves data files and no .metadata",
        detail=", ".join(files) or "no files",
    )
    that(
        error is not None,
        what="loading the incomplete checkpoint fails",
        detail=f"{type(error).__name__}: {str(error).splitlines()[-1][:120]}"
        if error
        else "it loaded",
        hint="without .metadata nothing says which piece of which tensor is where",
    )


# (rows, saving ranks, loading ranks): uneven cuts, and more loaders than savers
PIECE_CASES = [(10, 4, 3), (10, 4, 2), (7, 3, 2), (13, 4, 3), (14, 3, 4), (96, 4, 2)]


def dcp_reads(rows: int, saved_ranks: int, rank: int, ranks: int) -> list[tuple[int, ...]]:
    """What ``torch.distributed.checkpoint`` reads for loading rank ``rank`` of ``ranks``:
    its own resharding function (``create_read_items_for_chunk_list``) on a checkpoint
    whose ``saved_ranks`` pieces, and the loader's piece, are cut by ``torch.chunk`` as
    FSDP cuts dim 0. ``(saving rank, row in its saved shard, row in the new shard,
    rows)``, in row order."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def chunk(piece: torch.Tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size([int(piece[0])]), torch.Size([len(piece)]))

    saved = [chunk(p) for p in torch.arange(rows).chunk(saved_ranks)]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows]), saved)
    mine = chunk(torch.arange(rows).chunk(ranks)[rank])
    starts = [c.offsets[0] for c in saved]
    return sorted(
        (
            starts.index(r.storage_index.offset[0]),
            r.storage_offsets[0],
            r.dest_offsets[0],
            r.lengths[0],
        )
        for r in create_read_items_for_chunk_list("t", md, [mine])
    )


def _pieces_mistake(got, rows: int, saved_ranks: int, rank: int, ranks: int) -> str:
    """The likely mistake behind a wrong answer: each one's answer, computed here."""

    def floor_cut(n: int) -> list[tuple[int, int]]:
        size = rows // n
        return [(i * size, rows if i == n - 1 else (i + 1) * size) for i in range(n)]

    def overlaps(cut) -> list[tuple[int, ...]]:
        lo, hi = cut(ranks)[rank]
        return [
            (s, max(a, lo) - a, max(a, lo) - lo, min(b, hi) - max(a, lo))
            for s, (a, b) in enumerate(cut(saved_ranks))
            if max(a, lo) < min(b, hi)
        ]

    want = dcp_reads(rows, saved_ranks, rank, ranks)
    starts = [int(p[0]) for p in torch.arange(rows).chunk(saved_ranks)]
    mine = int(torch.arange(rows).chunk(ranks)[rank][0])
    if got == overlaps(floor_cut):
        return (
            "FSDP cuts dim 0 with torch.chunk: pieces of ⌈rows / n⌉ rows, the last ones "
            "shorter — not rows // n with the rest on the last rank"
        )
    if got == [(s, starts[s] + a, mine + d, n) for s, a, d, n in want]:
        return "give rows relative to each shard: the saved shard's first row and yours are 0"
    if got and {g[0] for g in got} == set(range(saved_ranks)) and len(want) < saved_ranks:
        return "read only the saved shards that overlap your new shard, not every file"
    return (
        "your new shard is rows [r·⌈R/n⌉, (r+1)·⌈R/n⌉) of the tensor; intersect it with each "
        "saved shard's rows and give each overlap's start in both shards and its length"
    )


def check_pieces_to_read(fn: Callable, reads: Mapping | None = None) -> None:
    """The student's pieces against what DCP reads: its own resharding function on uneven
    FSDP cuts (``torch.chunk``), and, with ``reads`` (the ``loaded`` record of
    ``reshard_checkpoint.py --load``), what each loading rank of that real run read from the
    real checkpoint's files for every tensor."""
    cases = [(rows, s, r, n) for rows, s, n in PIECE_CASES for r in range(n)]
    for rows, s, r, n in cases:
        got, want = fn(rows, s, r, n), dcp_reads(rows, s, r, n)
        got = [tuple(int(x) for x in g) for g in got] if isinstance(got, list) else got
        if got != want:
            fail(
                "pieces_to_read",
                f"{rows} rows saved by {s} ranks, loading rank {r} of {n}: got {got}, "
                f"DCP reads {want}",
                _pieces_mistake(got, rows, s, r, n),
            )
    real = 0
    if reads is not None:
        for rank, per_tensor in reads["reads"].items():
            for fqn, pieces in per_tensor.items():
                rows = reads["rows"][fqn]
                want = sorted(tuple(p) for p in pieces)
                got = [
                    tuple(int(x) for x in g)
                    for g in fn(rows, reads["saved_procs"], int(rank), reads["procs"])
                ]
                if got != want:
                    fail(
                        "pieces_to_read",
                        f"{fqn} ({rows} rows) loaded by rank {rank} of {reads['procs']}: got "
                        f"{got}, the run read {want}",
                        _pieces_mistake(got, rows, reads["saved_procs"], int(rank), reads["procs"]),
                    )
                real += 1
    passed(
        "pieces_to_read = what torch.distributed.checkpoint reads",
        f"{len(cases)} uneven cuts"
        + (f"; {real} tensor pieces the {reads['procs']}-rank load read" if reads else ""),
    )


# ------------------------------------------------- interleaved and zero-bubble schedules
def _blocks(acts: list, around: int) -> str:
    """``0F2 2B0 …``: the blocks near position ``around``."""
    return " ".join(f"{s}{k}{i}" for s, k, i in acts[max(around - 2, 0) : around + 3])


def check_schedule_blocks(run: Mapping) -> None:
    """Counts, exact on any machine: every rank ran the blocks ``(stage, kind,
    micro-batch)`` of its schedule (``run["order"]``, from torch's own plan), each once,
    in that order; as many W blocks as the plan splits off."""
    name, m, p = run["schedule"], run["microbatches"], run["stages"]
    measured = timeline.measured_actions(run["events"])
    for rank in range(p):
        blocks = measured.get(rank, [])
        want = [tuple(a) for a in run["order"][str(rank)]]
        if blocks == want:
            continue
        count(
            len(blocks),
            len(want),
            what=f"{name} m={m}, rank {rank}: blocks",
            hint="each micro-batch crosses every stage once forward and once backward",
        )
        first = next(i for i, (a, b) in enumerate(zip(blocks, want)) if a != b)
        fail(
            f"{name} m={m}, rank {rank}: blocks in the schedule's order",
            f"block {first}: the schedule runs …{_blocks(want, first)}…, this rank ran "
            f"…{_blocks(blocks, first)}…",
            "a block that ran early or late: the timeline is not this schedule's",
        )
    kinds = {k: sum(1 for e in run["events"] if e["kind"] == k) for k in ("F", "B", "W")}
    n_stages = p * run["virtual"]
    count(kinds["F"], n_stages * m, what=f"{name} m={m}: F blocks (stages × micro-batches)")
    count(kinds["B"], n_stages * m, what=f"{name} m={m}: B blocks")
    planned_w = sum(1 for acts in run["order"].values() for _, k, _ in acts if k == "W")
    if planned_w:  # DualPipeV splits only some backwards
        count(
            kinds["W"],
            planned_w,
            what=f"{name} m={m}: W blocks (the weights' backward split "
            f"off the inputs', for {planned_w} of the {n_stages * m} backwards)",
        )
    passed(
        f"{name} m={m}, {p} ranks × {run['virtual']} stages: every rank ran its schedule's "
        "blocks in its order"
    )


def _bubble_cases() -> list[tuple[str, dict, dict]]:
    """torch's own plans (built without processes) and block costs."""
    from torch.distributed import pipelining as pp

    plans = [
        ("1F1B, p=4, m=8", pp.Schedule1F1B, 4, 8, 1, False),
        ("interleaved 1F1B, p=2, v=2, m=4", pp.ScheduleInterleaved1F1B, 2, 4, 2, False),
        ("interleaved ZB, p=4, v=2, m=8", pp.ScheduleInterleavedZeroBubble, 4, 8, 2, False),
        ("ZB-V, p=2, m=4", pp.ScheduleZBVZeroBubble, 2, 4, 2, True),
        ("DualPipeV, p=2, m=4", pp.ScheduleDualPipeV, 2, 4, 2, True),
    ]
    costs = [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.5, "W": 0.5}]
    return [
        (f"{name}, F/B/W = {c['F']:g}/{c['B']:g}/{c['W']:g}", timeline.plan(cls, p, m, v, vs), c)
        for name, cls, p, m, v, vs in plans
        for c in costs
    ]


def _every_b_alone(actions: Mapping, cost: Mapping) -> float:
    """The bubble when every B lasts ``cost["B"]``, a whole backward too."""
    ev = [
        timeline.Event(int(r), k, i, 0.0, cost[k], stage=s)
        for r, acts in actions.items()
        for s, k, i in acts
    ]
    return timeline.replay(ev, actions).bubble


def _own_span_bubbles(actions: Mapping, cost: Mapping) -> list[float]:
    """The bubble with each rank measured from its own first block to its own last: summed
    over ranks, and the paper's way (:func:`lab_utils.timeline.stage_ratio`)."""
    by_rank: dict[int, list] = {}
    for e in timeline.ideal_replay(actions, cost).events:
        by_rank.setdefault(e.rank, []).append(e)
    work = [sum(e.end - e.start for e in v) for v in by_rank.values()]
    spans = [max(e.end for e in v) - min(e.start for e in v) for v in by_rank.values()]
    q = timeline.stage_ratio(actions, cost)
    return [1 - sum(work) / sum(spans), q / (1 + q)]


def _bubble_mistake(got: float, actions: Mapping, cost: Mapping) -> str:
    """The likely mistake behind a wrong bubble: each one's value, computed here."""
    want = reference.schedule_bubble(actions, cost)
    ws = {(s, i) for acts in actions.values() for s, k, i in acts if k == "W"}
    blocks = [b for acts in actions.values() for b in acts]
    busy = sum(
        cost[k] + (cost["W"] if k == "B" and (s, i) not in ws else 0.0) for s, k, i in blocks
    ) / len(actions)
    span = busy / (1 - want)
    w = sum(cost["W"] for _, k, _ in blocks if k == "W") / len(actions)
    candidates = [
        (
            want / (1 - want),
            "that is idle / compute; the bubble is a share of the step: idle / (idle + "
            "compute) = 1 − busy / span",
        ),
        (
            1 - (busy - w) / span,
            "W blocks are work (the weights' gradient), not idle time: count them as busy",
        ),
        *(
            (
                value,
                "that measures each rank from its own first block to its own last (as Qi "
                "et al. count); the step runs from 0 to the last block on any rank: a "
                "later rank's late start is idle too",
            )
            for value in _own_span_bubbles(actions, cost)
        ),
        (
            0.0,
            "no rank ever idled: each block must wait for the block whose result it needs "
            "(F for the previous stage's F, B for the next stage's B, W for its own B) — "
            "that wait is the warm-up and the cool-down",
        ),
        (
            1 - busy / (span * len(actions)),
            "divide one rank's mean busy time by the span, not by the span of all ranks added",
        ),
    ]
    if len(ws) < sum(k == "B" for _, k, _ in blocks):  # some B is a whole backward
        candidates.append(
            (
                _every_b_alone(actions, cost),
                "a B with no W of its own (same stage and micro-batch) is the whole "
                "backward: it lasts B + W",
            )
        )
    for value, hint in candidates:
        if abs(got - value) < 1e-6:
            return hint
    return (
        "place each block at max(its rank's previous block's end, the end of the block it "
        "waits for), the last stage's B after its own F; bubble = 1 − mean busy / span"
    )


def check_schedule_bubble(fn: Callable) -> float:
    """The student's bubble of a plan against the reference, on torch's own plans of five
    schedules (1F1B, interleaved 1F1B, interleaved zero bubble, ZB-V, DualPipeV) with equal
    and unequal F/B/W costs. Returns the largest difference."""
    worst = 0.0
    for what, actions, cost in _bubble_cases():
        got, want = fn(actions, dict(cost)), reference.schedule_bubble(actions, cost)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            fail(
                "schedule_bubble",
                f"{what}: got {got!r}, expected {want:.4f}",
                _bubble_mistake(got, actions, cost)
                if isinstance(got, (int, float))
                else "return a float",
            )
        worst = max(worst, abs(got - want))
    passed(
        "schedule_bubble: the idle share of torch's plans of 5 schedules",
        f"{len(_bubble_cases())} plans and costs",
    )
    return worst


# ------------------------------------------------------------------- planner (notebook 10)
def check_predictions(rows: list[Mapping]) -> float:
    """Each row ``{what, predicted, measured, margin}``: ``|predicted − measured| ≤ margin ×
    measured`` (margin 0: exact). Returns the largest relative error."""
    worst = 0.0
    for r in rows:
        err = abs(r["predicted"] - r["measured"]) / max(abs(r["measured"]), 1e-300)
        if err > r["margin"] + 1e-12:
            fail(
                f"planner: {r['what']}",
                f"predicted {r['predicted']:,.0f}, measured "
                f"{r['measured']:,.0f} bytes ({err:.2%} off, allowed {r['margin']:.0%})",
                "which tensors does this rank hold, and how is each one cut?",
            )
        worst = max(worst, err)
    passed(f"planner: {len(rows)} predictions within their margins", f"largest error {worst:.2%}")
    return worst


def _activation_cases() -> list[tuple[str, object, object, int, int]]:
    """Small models and GPT-3 on layouts where each likely mistake gives another number."""
    from lab_utils import planner

    small = planner.Config(vocab=96, d_model=64, n_layers=8, n_heads=4, seq_len=32)
    cases = []
    for recompute in ("none", "full"):
        for pp, m, stage in ((4, 8, 0), (4, 8, 2), (4, 2, 0), (2, 6, 1)):
            for tp, sp in ((1, "none"), (2, "torch"), (2, "megatron")):
                lay = planner.Layout(
                    tp=tp, pp=pp, microbatches=m, recompute=recompute, sequence_parallel=sp
                )
                what = f"pp {pp}, m {m}, stage {stage}, tp {tp}, sp {sp}, recompute {recompute}"
                cases.append((f"small model, {what}", small, lay, 2, stage))
    gpt3 = planner.Layout(
        dp=8, tp=8, pp=16, zero=1, precision="bf16", recompute="full", microbatches=64
    )
    what = "GPT-3, dp 8 × tp 8 × pp 16, bf16, recompute full, m 64"
    cases.append((what, planner.GPT3, gpt3, 3, 0))
    return cases


def _activation_mistake(got: float, cfg, lay, b: int, stage: int) -> str:
    """The likely mistake behind a wrong peak: each one's value, computed here."""
    from lab_utils import planner

    blocks = planner.stage_blocks(cfg.n_layers, lay.pp, stage)
    per_block = planner.block_activation_bytes(cfg, lay, b)
    kept = planner.block_input_bytes(cfg, lay, b)
    k = min(lay.pp - stage, lay.microbatches)
    full = lay.recompute == "full"

    def peak(n: int) -> float:
        if full:
            return n * blocks * kept + per_block - kept
        return n * blocks * per_block

    candidates = [
        (
            peak(lay.microbatches),
            "1F1B does not run every micro-batch's forward first (GPipe does): stage s has "
            "min(pp − s, microbatches) micro-batches in flight",
        ),
        (
            peak(lay.pp - stage),
            "a step with fewer micro-batches than pp − stage has only that many in flight",
        ),
        (
            peak(min(lay.pp, lay.microbatches)),
            "later stages start fewer micro-batches before their first backward: pp − stage",
        ),
    ]
    if full:
        candidates = [
            (
                k * (blocks * kept + per_block - kept),
                "the recomputed block's working set is there once, not per micro-batch: the "
                "backward runs one block again at a time and frees what it saved",
            ),
            (
                k * blocks * kept + per_block,
                "the recomputed block's input is the one already kept: add what the block "
                "saves less its input",
            ),
            (
                k * blocks * kept,
                "the backward runs a checkpointed block again, and it saves its tensors "
                "then: add one block's working set",
            ),
            (k * blocks * per_block, "with full recomputation a block keeps only its input"),
            *candidates,
        ]
    for value, hint in candidates:
        if abs(got - value) <= 1e-9 * max(abs(value), 1.0):
            return hint
    return (
        "in flight = min(pp − stage, microbatches); without recomputation every block's "
        "saved values per micro-batch in flight; with it, the blocks' inputs per micro-batch "
        "and one block's working set once"
    )


def check_stage_activation_bytes(fn: Callable) -> float:
    """The student's peak of a pipeline stage's saved activations against the reference
    (which ``tests/test_planner.py`` checks against the saved-bytes meter) on small models
    with tensor and both forms of sequence parallelism, and on GPT-3. Returns the largest
    relative difference."""
    worst = 0.0
    for what, cfg, lay, b, stage in _activation_cases():
        got, want = fn(cfg, lay, b, stage), reference.stage_activation_bytes(cfg, lay, b, stage)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9 * want:
            fail(
                "stage_activation_bytes",
                f"{what}: got {got!r}, expected {want:,.0f} bytes",
                _activation_mistake(got, cfg, lay, b, stage)
                if isinstance(got, (int, float))
                else "return a number of bytes",
            )
        worst = max(worst, abs(got - want) / want)
    passed(
        "stage_activation_bytes: the peak a pipeline stage holds for backward",
        f"{len(_activation_cases())} layouts, with and without recomputation",
    )
    return worst


# ------------------------------------------------------------ context parallelism
def check_ring_attention(fn: Callable) -> float:
    """The student's ring attention, run for every rank of a ring of n = 1, 2, 4 inside one
    process (:func:`lab_utils.ring_attention.simulated_ring` hands each rank the previous
    ranks' K/V blocks), equals full causal attention: outputs, and gradients of q, k, v.
    Returns the largest relative error."""
    from lab_utils import ring_attention as ring

    worst = 0.0
    for n in (1, 2, 4):
        g = torch.Generator().manual_seed(20 + n)
        q, k, v = (torch.randn(2, 3, 8, 16, generator=g).requires_grad_() for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        weight = torch.randn(full.shape, generator=g)
        want = torch.autograd.grad((full * weight).sum(), (q, k, v))
        qs, ks, vs = ([ring.chunk(t, r, n) for r in range(n)] for t in (q, k, v))
        parts = [fn(qs[r], ks[r], vs[r], r, n, ring.simulated_ring(ks, vs, r)) for r in range(n)]
        _parts_shaped(
            "ring_attention",
            parts,
            qs[0].shape,
            what="outputs",
            per=" per rank",
            hint="return this rank's rows of the output",
        )
        out = torch.cat(parts, dim=2)
        label = f"ring attention, {n} ranks"
        worst = max(
            worst,
            _outputs_close(
                out,
                full,
                label,
                hint="NaN in the output: a query row with every score masked (−inf − "
                "(−inf)); on the rank's own block mask only the future, j > i, and keep "
                "the diagonal"
                if bool(out.isnan().any())
                else "each block must rescale the running sum and "
                "denominator by exp(old max − new max); the rank's own block needs "
                "the causal mask; blocks from later ranks are all in the future (the "
                "block at step s comes from rank (rank − s) mod n)",
            ),
        )
        got = torch.autograd.grad((out * weight).sum(), (q, k, v), allow_unused=True)
        worst = max(
            worst,
            _grads_close(
                "ring_attention",
                label,
                zip("qkv", got, want),
                hint="compute with the tensors you were given and the blocks pass_kv returns",
            ),
        )
    return worst
