"""Self-checks of Lab 5 (systems): the exercises and the claims the notebooks make.

Exercise checks run the student's function on fixed tensors and compare it with the
reference (PyTorch's own ``torch.optim.Adam``, the EASGD equations), trying to name
the mistake. Claim checks take what a job measured. The parameter server's rest on
counts (versions at pull and push, updates per push); claims that depend on timing or
scheduling (sparse writes collide less) are asserted only outside the ``quick``
profile, where they print "not asserted (quick)" instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import lab5_solutions as reference
from lab_utils.checks import close, count, fail, passed, shown, that


def _claim(ok: bool, *, what: str, detail: str, asserted: bool, hint: str = "") -> None:
    if asserted:
        that(ok, what=what, detail=detail, hint=hint)
    else:
        print(
            f"· not asserted (quick): {what} ({detail}; {'holds' if ok else 'does not hold'} "
            "in this run)"
        )


# --------------------------------------------------------------------------- exercises
_ADAM = "adam_server_update = torch.optim.Adam on the averaged gradient"


def check_adam_server_update(fn: Callable, steps: int = 6, workers: int = 3) -> None:
    """``fn(param, grads, m, v, step, lr, betas, eps)`` equals ``torch.optim.Adam`` on the
    averaged gradient, step after step (the synchronous parameter server's update)."""
    g = torch.Generator().manual_seed(5)
    lr, betas, eps = 0.01, (0.9, 0.99), 1e-8
    ref = torch.randn(7, 3, generator=g).requires_grad_()
    opt = torch.optim.Adam([ref], lr=lr, betas=betas, eps=eps)
    param = ref.detach().clone()
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, steps + 1):
        grads = [torch.randn(7, 3, generator=g) * (w + 1) for w in range(workers)]
        ref.grad = torch.stack(grads).mean(0)
        opt.step()
        copies = [gr.clone() for gr in grads]
        out = fn(param.clone(), copies, m.clone(), v.clone(), step, lr=lr, betas=betas, eps=eps)
        if not (isinstance(out, tuple) and len(out) == 3):
            fail(_ADAM, f"returned {type(out).__name__}", "return the tuple (param, m, v)")
        new_param, m, v = (t.detach() for t in out)
        _adam_moments_match(m, v, opt.state[ref], grads, step, betas)
        _adam_param_matches(new_param, ref.detach(), param, m, v, step, lr, betas, eps)
        param = new_param
    passed(_ADAM, f"{steps} steps, {workers} workers")


def _adam_moments_match(
    m: torch.Tensor,
    v: torch.Tensor,
    state: dict,
    grads: list[torch.Tensor],
    step: int,
    betas: tuple[float, float],
) -> None:
    """m and v equal Adam's exp_avg and exp_avg_sq; a sum instead of a mean is named."""
    if not torch.allclose(m, state["exp_avg"], rtol=1e-5, atol=1e-7):
        total = torch.stack(grads).sum(0)
        if step == 1 and torch.allclose(m, (1 - betas[0]) * total, atol=1e-6):
            fail(
                _ADAM,
                "m grew with the *sum* of the pushed gradients",
                "average the workers' gradients (divide by how many pushed)",
            )
        fail(
            _ADAM,
            f"step {step}: m differs from Adam's exp_avg",
            "m ← β1·m + (1−β1)·g with g the mean of the pushed gradients",
        )
    if not torch.allclose(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-9):
        fail(_ADAM, f"step {step}: v differs from Adam's exp_avg_sq", "v ← β2·v + (1−β2)·g²")


def _adam_param_matches(
    new_param: torch.Tensor,
    expected: torch.Tensor,
    param: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """The new parameters equal Adam's; a step without bias correction is named."""
    if torch.allclose(new_param, expected, rtol=1e-5, atol=1e-7):
        return
    b1, b2 = betas
    raw = param - lr * m / (v.sqrt() + eps)
    if torch.allclose(new_param, raw, atol=1e-6):
        fail(
            _ADAM,
            f"step {step}: the step has no bias correction",
            f"divide m by 1−β1^t and v by 1−β2^t (t = step, from 1): "
            f"at t=1 that is ×{1 / (1 - b1):.0f} and ×{1 / (1 - b2):.0f}",
        )
    err = float((new_param - expected).abs().max())
    fail(
        _ADAM,
        f"step {step}: parameters differ from Adam's by up to {err:.2e}",
        "param ← param − lr · m̂ / (√v̂ + ε)",
    )


def check_easgd(worker_fn: Callable, center_fn: Callable) -> None:
    """The two EASGD equations on fixed tensors:
    x_i ← x_i − η (g_i + ρ (x_i − x̃)) and x̃ ← x̃ + η Σ_i ρ (x_i − x̃)."""
    g = torch.Generator().manual_seed(11)
    lr, rho = 0.1, 2.5
    xs = [torch.randn(5, generator=g) for _ in range(3)]
    grads = [torch.randn(5, generator=g) for _ in range(3)]
    center = torch.randn(5, generator=g)
    for x, gr in zip(xs, grads, strict=True):
        got = worker_fn(x.clone(), gr.clone(), center.clone(), lr, rho)
        want = x - lr * (gr + rho * (x - center))
        if torch.allclose(got, x - lr * (gr - rho * (x - center)), atol=1e-6):
            fail(
                "easgd_worker",
                "the elastic force pushes x_i away from the centre",
                "the term is +ρ(x_i − x̃) inside the bracket: x_i moves towards x̃",
            )
        if torch.allclose(got, x - lr * gr, atol=1e-6):
            fail("easgd_worker", "no elastic term", "add η·ρ·(x_i − x̃) to the gradient step")
        close(
            got,
            want,
            what="easgd_worker: x_i − η(g_i + ρ(x_i − x̃))",
            rtol=1e-6,
            hint="x_i ← x_i − η (g_i + ρ (x_i − x̃))",
        )
    got = center_fn(center.clone(), [x.clone() for x in xs], lr, rho)
    want = center + lr * rho * sum(x - center for x in xs)
    moved = [
        reference.easgd_worker(x, gr, center, lr, rho) for x, gr in zip(xs, grads, strict=True)
    ]
    if torch.allclose(got, center + lr * rho * sum(x - center for x in moved), atol=1e-6):
        fail(
            "easgd_center",
            "used the workers' *new* x_i",
            "both equations use x_i^t, the values before this round's moves",
        )
    if torch.allclose(got, center + lr * rho * sum(x - center for x in xs) / len(xs), atol=1e-6):
        fail(
            "easgd_center", "averaged the differences", "the centre moves by the *sum* over workers"
        )
    close(
        got,
        want,
        what="easgd_center: x̃ + η Σ ρ(x_i − x̃)",
        rtol=1e-6,
        hint="x̃ ← x̃ + η Σ_i ρ (x_i − x̃)",
    )
    # The symmetric force: what the workers lose the centre gains (round of one worker).
    x = xs[0]
    lost = x - worker_fn(x.clone(), torch.zeros(5), center.clone(), lr, rho)
    gained = center_fn(center.clone(), [x.clone()], lr, rho) - center
    close(gained, lost, what="elastic force is symmetric (what x_i loses, x̃ gains)", rtol=1e-6)


# --------------------------------------------------------------------------- claims
def check_sync_server(summary: Mapping[str, Any]) -> None:
    """Synchronous PS: one update per round of N pushes, and no gradient is ever stale."""
    that(
        summary["updates"] * summary["workers"] == summary["gradients"],
        what="sync server: one update per N pushes",
        detail=f"{summary['updates']} updates from {summary['gradients']} gradients of "
        f"{summary['workers']} workers",
    )
    stale = [s for s in summary["staleness"] if s != 0]
    that(
        not stale,
        what="sync server: every gradient applied at the version it was computed on",
        detail=f"{len(stale)} stale of {len(summary['staleness'])}",
    )


def staleness_by_worker(summary: Mapping[str, Any]) -> dict[int, dict[str, int]]:
    """Per worker, counted from the server's log of every push ``(worker, version pulled,
    version when applied)``: its pushes ``n``, the sum of their staleness, the updates the
    others applied before its first pull (``head``) and after its last push (``tail``),
    and ``own_in_window``: its own updates inside the windows it was stale over (0 when
    every push was computed on the weights its previous push returned)."""
    total = len(summary["pushes"])
    out: dict[int, dict[str, int]] = {}
    for w in sorted({p[0] for p in summary["pushes"]}):
        mine = [(pulled, applied) for worker, pulled, applied in summary["pushes"] if worker == w]
        own = sorted(a for _, a in mine)
        out[w] = {
            "n": len(mine),
            "stale": sum(a - p for p, a in mine),
            "head": mine[0][0],
            "tail": total - 1 - own[-1],
            "own_in_window": sum(1 for p, a in mine for v in own if p <= v < a),
        }
    return out


def check_async_server(summary: Mapping[str, Any]) -> None:
    """Async PS, from counts only: every push is one update, and the staleness of each push
    is the number of *other* workers' updates since its pull (none of its own: it waited
    for its previous answer). Hence the mean over all pushes is at most ``W − 1`` — each
    update is missed at most once by each of the other workers — whatever the scheduling."""
    n_total, workers = summary["updates"], summary["workers"]
    count(len(summary["pushes"]), summary["gradients"], what="async server: every push logged")
    count(n_total, summary["gradients"], what="async server: every push applied as one update")
    count(sum(1 for s in summary["staleness"] if s < 0), 0, what="no staleness is negative")
    per = staleness_by_worker(summary)
    count(
        sum(c["own_in_window"] for c in per.values()),
        0,
        what="each push computed on the weights its own previous push returned",
        hint="a worker must install the server's answer before its next step",
    )
    mean = sum(summary["staleness"]) / len(summary["staleness"])
    that(
        mean <= workers - 1,
        what=f"mean staleness ≤ W − 1 = {workers - 1}",
        detail=f"mean {mean:.2f} over {len(summary['staleness'])} pushes",
    )


def check_staleness_prediction(summary: Mapping[str, Any]) -> None:
    """When compute dominates, every worker runs over the whole job, so each push misses
    every other worker's pushes since its pull: worker i's mean staleness is predicted as
    ``(N − n_i) / n_i`` — ``W − 1`` for equal workers, ``K·(W − 1)`` for a straggler that is K
    times slower and pushes 1/K as often. The measured mean falls short of it by exactly
    ``(head + tail) / n_i``: the updates made while worker i had not started or had
    finished, counted, not timed."""
    n_total, workers, k = summary["updates"], summary["workers"], summary.get("straggler", 1)
    per = staleness_by_worker(summary)
    for w, c in per.items():
        predicted = (n_total - c["n"]) / c["n"]
        edge = c["head"] + c["tail"]
        name = f"worker {w}" + (f" (straggler, {k}× slower)" if k > 1 and w == workers - 1 else "")
        count(
            c["stale"],
            n_total - c["n"] - edge,
            what=f"{name}: mean staleness {c['stale'] / c['n']:.2f} = predicted {predicted:.2f} "
            f"− {edge / c['n']:.2f} ({edge} updates outside its run, counted)",
        )
    if k > 1:
        s = per[workers - 1]
        count(
            n_total - s["n"],
            k * (workers - 1) * s["n"],
            what=f"straggler's prediction (N − n)/n = K·(W − 1) = {k * (workers - 1)} "
            "(the others push K times as often)",
        )
    if k > 1:
        return
    at = sum(1 for x in summary["staleness"] if x == workers - 1) / len(summary["staleness"])
    shown(
        f"share of pushes exactly W − 1 = {workers - 1} stale",
        f"{at:.0%}",
        "which pushes interleave depends on timing; the sums above are exact",
    )


def check_accuracy_curve(summary: Mapping[str, Any], evals: Sequence[Mapping[str, Any]]) -> None:
    """The accuracy curve covers the whole run: it starts at the initial weights (update 0,
    time 0) and ends at the server's final model, whose accuracy the run printed."""
    what = f"{summary['mode']} accuracy curve spans the run"
    if not evals or "updates" not in evals[0]:
        fail(
            what,
            "no points at the server's update counts",
            "plot the server's own model at fixed update counts, not one worker's snapshots",
        )
    count(evals[0]["updates"], 0, what=f"{what}: first point at update 0")
    count(evals[-1]["updates"], summary["updates"], what=f"{what}: last point at the last update")
    that(
        evals[-1]["acc"] == summary["final_acc"],
        what=f"{what}: ends at the final accuracy",
        detail=f"last point {evals[-1]['acc']:.3f}, printed final {summary['final_acc']:.3f}",
    )


def show_throughput_scaling(rows: Sequence[Mapping[str, Any]], cores: int) -> None:
    """What adding workers did to the measured rate, per setting: shown, never asserted
    (wall-clock throughput on a shared CPU depends on what else the machine runs)."""
    for mode, shards in sorted({(r["mode"], r["shards"]) for r in rows}):
        sel = sorted(
            (r for r in rows if (r["mode"], r["shards"]) == (mode, shards)),
            key=lambda r: r["workers"],
        )
        if len(sel) < 2:
            continue
        lo, hi = sel[0], sel[-1]
        shown(
            f"{mode}, {shards} shard(s): {lo['workers']} → {hi['workers']} workers",
            f"{lo['grads_per_s']:.0f} → {hi['grads_per_s']:.0f} gradients/s "
            f"(×{hi['grads_per_s'] / lo['grads_per_s']:.2f}) on {cores} core(s) for "
            f"{shards + hi['workers']} processes",
            "a rate in wall time on a shared machine",
        )


def check_lock(records: Sequence[Mapping[str, Any]], asserted: bool) -> None:
    """A lock keeps writes apart; without it sparse writes collide less than dense ones."""
    for r in records:
        if r["lock"]:
            that(
                r["overlapped"] == 0,
                what=f"{r['model']} model with a lock: no writes overlap",
                detail=f"{r['overlapped']} of {r['updates']} overlapped",
            )
    by = {(r["model"], r["lock"]): r for r in records}
    if ("dense", False) in by and ("sparse", False) in by:
        d = by[("dense", False)]["collided_when_overlapping"]
        s = by[("sparse", False)]["collided_when_overlapping"]
        _claim(
            s < d and by[("sparse", False)]["overlapped"] > 0,
            what="overlapping lock-free writes collide on fewer weights when sparse",
            detail=f"sparse {s:.1%} vs dense {d:.1%} of the weights they wrote",
            asserted=asserted,
        )


def show_lock_speed(records: Sequence[Mapping[str, Any]]) -> None:
    """Per model, which of lock and no lock gave more updates per second in this run:
    printed from the run's numbers, never asserted (which wins depends on the machine)."""
    by = {(r["model"], r["lock"]): r["updates_per_s"] for r in records}
    for model in ("dense", "sparse"):
        if (model, True) in by and (model, False) in by:
            locked, free = by[(model, True)], by[(model, False)]
            winner = "the lock" if locked > free else "no lock"
            shown(
                f"{model} model: {winner} gave more updates per second",
                f"lock {locked:,.0f}/s, no lock {free:,.0f}/s "
                f"({max(locked, free) / max(min(locked, free), 1e-9):.2f}×)",
                "one run of each on a shared machine; the winner depends on its cores, "
                "caches and load",
            )


def check_same_outputs(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    close(actual, expected, what=what, rtol=1e-6, atol=1e-6)


def check_graph_breaks(plain: int, branchy: int) -> None:
    """torch.compile captures the plain model whole and breaks on the data-dependent branch."""
    that(plain == 0, what="plain model: one graph, no break", detail=f"{plain} breaks")
    that(
        branchy >= 1,
        what="data-dependent branch: Dynamo breaks the graph",
        detail=f"{branchy} break(s)",
    )


def check_resume_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """The resumed run's weights equal the uninterrupted run's, bit for bit."""
    what = "killed-and-resumed run = uninterrupted run (bitwise)"
    if set(a) != set(b):
        fail(what, f"different tensors: {sorted(set(a) ^ set(b))}")
    diffs = {
        k: float((a[k].double() - b[k].double()).abs().max())
        for k in a
        if not torch.equal(a[k], b[k])
    }
    if diffs:
        k = max(diffs, key=diffs.get)
        fail(
            what,
            f"{len(diffs)} of {len(a)} tensors differ; largest difference {diffs[k]:.3g} in {k}",
            "resume must restore the optimizer state and replay the same batches",
        )
    passed(what, f"{len(a)} tensors equal")
