"""Self-checks for Lab 4: the memory formula, the column/row and head splits, and
the claims the notebooks measure (bubble, equal gradients and weights, sharded
memory). Each raises :class:`~lab_utils.checks.CheckFailed` when it does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.nn import functional as F

from lab_utils import memory, timeline
from lab_utils.checks import close, count, fail, passed, that, within_run
from lab_utils.solutions import lab4 as reference


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
        full = F.gelu(x @ w1.T + b1) @ w2.T + b2
        (full**2).sum().backward()
        want = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        parts = [fn(x, w1, b1, w2, r, n) for r in range(n)]
        if any(not isinstance(p, torch.Tensor) or p.shape != full.shape for p in parts):
            fail(
                "mlp_column_row_shard",
                f"partial outputs have shapes "
                f"{[tuple(getattr(p, 'shape', ())) for p in parts]}, expected {tuple(full.shape)}",
                "each rank returns a full-width (…, d) partial sum",
            )
        out = torch.stack(parts).sum(0) + b2  # what the all-reduce computes
        worst = max(
            worst,
            close(
                out.detach(),
                full.detach(),
                what=f"column→row split, n={n}: outputs",
                rtol=1e-5,
                hint="rank r takes rows r·h/n…(r+1)·h/n of W1 and b1 and the same columns of W2",
            ),
        )
        (out**2).sum().backward()
        for name, p, w in zip(("W1", "b1", "W2"), params, want):
            if p.grad is None:
                fail(
                    "mlp_column_row_shard",
                    f"no gradient reaches {name}",
                    "compute with the tensors you were given (slices keep the graph)",
                )
            worst = max(
                worst,
                close(p.grad, w, what=f"column→row split, n={n}: gradient of {name}", rtol=1e-5),
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
        full = _attention(x, *ws, n_heads)
        (full**2).sum().backward()
        want = [w.grad.clone() for w in ws]
        for w in ws:
            w.grad = None
        parts = [fn(x, *ws, n_heads, r, n) for r in range(n)]
        if any(not isinstance(p, torch.Tensor) or p.shape != full.shape for p in parts):
            fail(
                "attention_heads_shard",
                f"partial outputs have shapes "
                f"{[tuple(getattr(p, 'shape', ())) for p in parts]}, expected {tuple(full.shape)}",
            )
        out = torch.stack(parts).sum(0)
        worst = max(
            worst,
            close(
                out.detach(),
                full.detach(),
                what=f"heads split, n={n}: outputs",
                rtol=1e-5,
                hint="rank r owns heads r·H/n…(r+1)·H/n: those rows of "
                "Wq, Wk, Wv (and biases) and those columns of Wo",
            ),
        )
        (out**2).sum().backward()
        for name, w, ref in zip(("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo"), ws, want):
            if w.grad is None:
                fail("attention_heads_shard", f"no gradient reaches {name}")
            if name == "bk":  # zero in exact arithmetic: a key bias cannot change a softmax
                continue
            worst = max(
                worst,
                close(
                    w.grad,
                    ref,
                    what=f"heads split, n={n}: gradient of {name}",
                    rtol=1e-4,
                    atol=1e-5,
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


def check_bubble(run: Mapping, *, k: float = 4.0) -> float:
    """The measured bubble equals the bubble the run's schedule must have given its own
    measured block durations and overheads (:func:`lab_utils.timeline.replay`), within
    ``k`` × the run's own spread. A stage that idles for another reason, or a schedule that
    is not the one named, fails. Returns the margin (a share of the step)."""
    # Every timed step, when the run kept them: another program on the machine delays a
    # block now and then (one step), a stage that idles for a reason of its own does so in
    # every step. So the least disturbed step must agree; how many did is printed.
    floor = 1e-4  # timestamps near 1.7e9 s carry ~0.2 µs of rounding per block
    steps = run.get("every_step_bubble") or []
    if len(steps) > 1:
        gaps = [k * noise + floor - abs(measured - replayed) for measured, replayed, noise in steps]
        measured, replayed, noise = steps[max(range(len(steps)), key=gaps.__getitem__)]
        which = (
            f" (the least disturbed of {len(steps)} timed steps; "
            f"{sum(g >= 0 for g in gaps)} of {len(steps)} agree)"
        )
    else:
        rep = timeline.replay(run["events"], run.get("order") or run["schedule"])
        measured, replayed = timeline.bubble_fraction(run["events"]), rep.bubble
        noise, which = timeline.replay_noise(run["events"], rep), ""
    return within_run(
        measured,
        replayed,
        noise=noise,
        k=k,
        floor=floor,
        what=f"{run['schedule']} m={run['microbatches']}, {run['stages']} stages: "
        f"bubble = the schedule replayed with this run's block times{which}",
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
        if any(not isinstance(p, torch.Tensor) or p.shape != qs[0].shape for p in parts):
            fail(
                "ring_attention",
                f"outputs have shapes {[tuple(getattr(p, 'shape', ())) for p in parts]}, "
                f"expected {tuple(qs[0].shape)} per rank",
                "return this rank's rows of the output",
            )
        out = torch.cat(parts, dim=2)
        worst = max(
            worst,
            close(
                out.detach(),
                full.detach(),
                what=f"ring attention, {n} ranks: outputs",
                rtol=1e-5,
                hint="each block must rescale the running sum and "
                "denominator by exp(old max − new max); the rank's own block needs "
                "the causal mask; blocks from later ranks are all in the future",
            ),
        )
        got = torch.autograd.grad((out * weight).sum(), (q, k, v), allow_unused=True)
        for name, gr, w in zip("qkv", got, want):
            if gr is None:
                fail(
                    "ring_attention",
                    f"no gradient reaches {name}",
                    "compute with the tensors you were given and the blocks pass_kv returns",
                )
            worst = max(
                worst,
                close(gr, w, what=f"ring attention, {n} ranks: gradient of {name}", rtol=1e-5),
            )
    return worst
