"""Figures for Lab 2: who sends what in each collective, the ring step by step, timings
and traffic, DDP knobs, Horovod's timeline (read by ``lab2_horovod_timeline``) and
scaling. The script diffs by step are ``lab2_script_diff``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from lab2_horovod_timeline import Span
from lab_utils import metrics

RANK_COLORS = plt.get_cmap("tab10").colors


# ------------------------------------------------------------------ collectives
# Each collective as (before, after, messages): per rank a list of cells, a cell being
# (label, owner rank, or -1 for a sum over all ranks); messages are (src, dst) pairs.
def _collective(name: str, n: int) -> tuple[list, list, list[tuple[int, int]]]:
    each = [[(f"x{r}", r)] for r in range(n)]
    total = [("Σx", -1)]
    if name == "broadcast":
        return (
            [[("x0", 0)]] + [[] for _ in range(n - 1)],
            [[("x0", 0)] for _ in range(n)],
            [(0, r) for r in range(1, n)],
        )
    if name == "scatter":
        return (
            [[(f"x0[{i}]", 0) for i in range(n)]] + [[] for _ in range(n - 1)],
            [[(f"x0[{r}]", 0)] for r in range(n)],
            [(0, r) for r in range(1, n)],
        )
    if name == "gather":
        return (
            each,
            [[(f"x{i}", i) for i in range(n)]] + [[] for _ in range(n - 1)],
            [(r, 0) for r in range(1, n)],
        )
    if name == "reduce":
        return each, [total] + [[] for _ in range(n - 1)], [(r, 0) for r in range(1, n)]
    if name == "all_reduce":
        return (
            each,
            [total for _ in range(n)],
            [(s, d) for s in range(n) for d in range(n) if s != d],
        )
    if name == "all_gather":
        return (
            each,
            [[(f"x{i}", i) for i in range(n)] for _ in range(n)],
            [(s, d) for s in range(n) for d in range(n) if s != d],
        )
    if name == "reduce_scatter":
        return (
            [[(f"x{r}[{i}]", r) for i in range(n)] for r in range(n)],
            [[(f"Σx[{r}]", -1)] for r in range(n)],
            [(s, d) for s in range(n) for d in range(n) if s != d],
        )
    raise ValueError(f"unknown collective {name!r}")


COLLECTIVES = (
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
)


def _cells(
    ax: plt.Axes, x0: float, y: float, cells: Sequence[tuple[str, int]], width: float
) -> None:
    for i, (label, owner) in enumerate(cells):
        color = "0.8" if owner < 0 else RANK_COLORS[owner % 10]
        ax.add_patch(
            Rectangle(
                (x0 + i * width, y - 0.35),
                width * 0.95,
                0.7,
                facecolor=color,
                alpha=0.55,
                edgecolor="0.3",
            )
        )
        ax.text(x0 + (i + 0.47) * width, y, label, ha="center", va="center", fontsize=7)


def collective_diagrams(names: Sequence[str] = COLLECTIVES, n: int = 4) -> plt.Figure:
    """One panel per collective: each rank's buffer before (left) and after (right),
    with an arrow for every message that crosses between ranks (the library may route
    them differently, e.g. round a ring, but this is who needs whose data)."""
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        before, after, messages = _collective(name, n)
        w = 0.55
        for r in range(n):
            y = n - 1 - r
            ax.text(-0.15, y, f"rank {r}", ha="right", va="center", fontsize=8)
            _cells(ax, 0.0, y, before[r], w)
            _cells(ax, 3.2, y, after[r], w)
        for s, d in messages:
            ax.add_patch(
                FancyArrowPatch(
                    (2.3, n - 1 - s),
                    (3.1, n - 1 - d),
                    arrowstyle="-|>",
                    mutation_scale=7,
                    lw=0.7,
                    color=RANK_COLORS[s % 10],
                    alpha=0.8,
                )
            )
        ax.text(1.0, n - 0.35, "before", ha="center", fontsize=8, color="0.3")
        ax.text(4.3, n - 0.35, "after", ha="center", fontsize=8, color="0.3")
        ax.set_title(name, fontsize=10)
        ax.set_xlim(-1.1, 3.2 + w * n + 0.1)
        ax.set_ylim(-0.6, n - 0.1)
        ax.axis("off")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------ ring
def ring_states(n: int) -> list[tuple[str, np.ndarray, list[tuple[int, int]]]]:
    """The ring all-reduce as bookkeeping: for each step, a title, the matrix
    ``count[rank, chunk]`` of contributions summed so far, and the sends
    ``(rank, chunk)`` of that step (each to rank + 1)."""
    count = np.ones((n, n), dtype=int)  # every rank holds its own data in every chunk
    states = [("start: each rank its own data", count.copy(), [])]
    for step in range(n - 1):
        sends = [(r, (r - step) % n) for r in range(n)]
        new = count.copy()
        for r, c in sends:
            new[(r + 1) % n, c] += count[r, c]
        count = new
        states.append((f"reduce-scatter {step + 1}/{n - 1}", count.copy(), sends))
    for step in range(n - 1):
        sends = [(r, (r + 1 - step) % n) for r in range(n)]
        new = count.copy()
        for r, c in sends:
            new[(r + 1) % n, c] = count[r, c]
        count = new
        states.append((f"all-gather {step + 1}/{n - 1}", count.copy(), sends))
    return states


def ring_steps(n: int = 4) -> plt.Figure:
    """Each step of the ring all-reduce: rows are ranks, columns chunks; the number in
    a cell is how many ranks' data it sums (``n`` = complete); arrows are the sends.
    Top row: reduce-scatter; bottom row: all-gather."""
    states = ring_states(n)
    fig, axes = plt.subplots(2, n, figsize=(2.4 * n, 5.0))
    panels = list(axes[0]) + list(axes[1][: n - 1])
    for ax, (title, count, sends) in zip(panels, states, strict=True):
        ax.imshow(count, cmap="Blues", vmin=0, vmax=n + 1)
        for r in range(n):
            for c in range(n):
                done = count[r, c] == n
                ax.text(
                    c - 0.15,
                    r,
                    str(count[r, c]),
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if done else "black",
                    fontweight="bold" if done else None,
                )
        for r, c in sends:
            dst = (r + 1) % n
            ax.annotate(
                "",
                xy=(c + 0.3, dst - 0.25 if dst > r else dst + 0.25),
                xytext=(c + 0.3, r + 0.25 if dst > r else r - 0.25),
                arrowprops={
                    "arrowstyle": "-|>",
                    "color": "crimson",
                    "lw": 1.0,
                    "connectionstyle": "arc3,rad=-0.4" if dst > r else "arc3,rad=0.25",
                },
            )
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(n), [str(c) for c in range(n)], fontsize=7)
        ax.set_xlabel("chunk", fontsize=8)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    legend = axes[1][n - 1]
    legend.axis("off")
    legend.text(
        0.0,
        0.5,
        "number: how many ranks' data\nthe chunk sums so far\n"
        f"({n} = complete)\n\nred arrow: a send this step,\nrank r → rank r+1 "
        f"(mod {n})",
        fontsize=9,
        va="center",
    )
    fig.tight_layout()
    return fig


def allreduce_times(
    records: Sequence[Mapping[str, Any]],
    fit: Mapping[str, float] | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Time per all-reduce vs message size, one line per algorithm (log–log), with the
    fitted α–β model ``fit = {"latency_s", "bandwidth", "world_size"}`` dashed."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    rows = metrics.events(records, "timing")
    for algo in dict.fromkeys(r["algo"] for r in rows):
        pts = sorted((r["nbytes"], r["seconds"]) for r in rows if r["algo"] == algo)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=algo)
    if fit and rows:
        from lab_utils.collectives import ring_time

        sizes = np.geomspace(min(r["nbytes"] for r in rows), max(r["nbytes"] for r in rows), 50)
        model = [
            ring_time(s, int(fit["world_size"]), fit["latency_s"], fit["bandwidth"]) * 1e3
            for s in sizes
        ]
        ax.plot(
            sizes,
            model,
            "k--",
            lw=1,
            label=f"2(N−1)α + 2(N−1)/N·S/B: α={fit['latency_s'] * 1e6:.0f} µs, "
            f"B={fit['bandwidth'] / 1e9:.2f} GB/s",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time per all-reduce (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def fit_ring_model(
    records: Sequence[Mapping[str, Any]], algo: str = "ring (ours)"
) -> dict[str, float]:
    """Least-squares α (latency) and B (bandwidth) of ``T = 2(N−1)α + 2(N−1)/N·S/B``
    from the timing records of one algorithm."""
    rows = metrics.events(records, "timing", algo=algo)
    if len(rows) < 2:
        raise ValueError(f"need at least two sizes timed for {algo!r}, got {len(rows)}")
    n = rows[0]["world_size"]
    steps = 2 * (n - 1)
    A = np.array([[steps, steps / n * r["nbytes"]] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows])
    # Relative errors matter across sizes spanning decades: weight each row by 1/t.
    (alpha, inv_b), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
    alpha, inv_b = max(alpha, 0.0), max(inv_b, 1e-15)
    return {"latency_s": float(alpha), "bandwidth": float(1.0 / inv_b), "world_size": n}


def traffic_by_n(
    ns: Sequence[int],
    ring_bytes: Sequence[float],
    server_bytes: Sequence[float],
    nbytes: float,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Bytes through the busiest process per all-reduce of ``nbytes``: ring vs server."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, np.asarray(server_bytes) / nbytes, "o-", label="parameter server (rank 0)")
    ax.plot(ns, np.asarray(ring_bytes) / nbytes, "s-", label="ring (every rank)")
    ax.plot(ns, [2 * (n - 1) for n in ns], "k:", lw=1, label="2(N−1)")
    ax.plot(ns, [4 * (n - 1) / n for n in ns], "k--", lw=1, label="4(N−1)/N → 4")
    ax.set_xlabel("processes N")
    ax.set_ylabel("bytes in + out of the busiest process\n(multiples of the tensor size S)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


# --------------------------------------------------------------------------- DDP
def param_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], *, label: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Largest absolute difference per parameter tensor of two state dicts (log scale)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    keys = [k for k in a if getattr(a[k], "is_floating_point", lambda: False)()]
    diffs = [max(float((a[k].double() - b[k].double()).abs().max()), 1e-16) for k in keys]
    ax.barh(range(len(keys)), diffs, color="tab:blue")
    ax.set_yticks(range(len(keys)), keys, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("largest |difference|")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    if label:
        ax.set_title(label, fontsize=10)
    return ax


def _bars_and_calls(
    ax: plt.Axes,
    labels: list[str],
    ms: list[float],
    calls: list[float],
    color: str,
    xlabel: str,
    per: str,
    title: str,
) -> None:
    """Milliseconds per ``per`` as bars, all-reduce calls per ``per`` as a red line."""
    x = np.arange(len(labels))
    ax.bar(x, ms, color=color, alpha=0.7)
    ax.set_xticks(x, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"ms per {per}", color=color)
    twin = ax.twinx()
    twin.plot(x, calls, "o-", color="tab:red")
    twin.set_ylabel(f"all-reduce calls per {per}", color="tab:red")
    twin.set_ylim(0, None)
    ax.set_title(title)


def ddp_knobs(records: Sequence[Mapping[str, Any]]) -> plt.Figure:
    """Bucket size (all-reduce calls and time per step) and no_sync accumulation
    (all-reduce calls and time per micro-batch), from ``ddp_bench.py``'s records."""
    buckets = sorted(metrics.events(records, "bucket"), key=lambda r: r["bucket_cap_mb"])
    accum = sorted(metrics.events(records, "accum"), key=lambda r: r["accum"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    _bars_and_calls(
        ax1,
        [f"{r['bucket_cap_mb']:g} MB" for r in buckets],
        [r["seconds_per_step"] * 1e3 for r in buckets],
        [r["allreduce_calls_per_step"] for r in buckets],
        "tab:blue",
        "bucket_cap_mb",
        "step",
        "gradient buckets",
    )
    _bars_and_calls(
        ax2,
        [str(r["accum"]) for r in accum],
        [r["seconds_per_micro_batch"] * 1e3 for r in accum],
        [r["allreduce_calls_per_micro_batch"] for r in accum],
        "tab:green",
        "micro-batches per optimiser step (no_sync on all but the last)",
        "micro-batch",
        "gradient accumulation with no_sync",
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- Horovod
def horovod_timeline(
    spans: Sequence[Span], *, max_tensors: int = 12, window: tuple[float, float] | None = None
) -> plt.Figure:
    """Gantt chart of a Horovod timeline: one row per tensor, one colour per activity;
    phases nested in another (e.g. GLOO_ALLREDUCE inside ALLREDUCE) are drawn thinner."""
    tensors = list(dict.fromkeys(s.tensor for s in spans))[:max_tensors]
    activities = list(dict.fromkeys(s.activity for s in spans if s.tensor in tensors))
    colors = {a: plt.get_cmap("tab20").colors[i % 20] for i, a in enumerate(activities)}
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(tensors) + 1.5))
    for row, t in enumerate(tensors):
        mine = sorted((s for s in spans if s.tensor == t), key=lambda s: s.start - s.end)
        for s in mine:  # longest first, so the phases nested inside stay visible on top
            inside = any(
                o is not s
                and o.start <= s.start
                and s.end <= o.end
                and o.end - o.start > s.end - s.start
                for o in mine
            )
            ax.barh(
                row,
                max(s.end - s.start, 1e-5) * 1e3,
                left=s.start * 1e3,
                height=0.35 if inside else 0.75,
                color=colors[s.activity],
            )
    ax.set_yticks(range(len(tensors)), [_short(t) for t in tensors], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if window is not None:
        ax.set_xlim(window[0] * 1e3, window[1] * 1e3)
    handles = [Rectangle((0, 0), 1, 1, color=colors[a]) for a in activities]
    ax.legend(handles, activities, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _short(name: str, limit: int = 40) -> str:
    return name if len(name) <= limit else "…" + name[-limit + 1 :]


# ----------------------------------------------------------------------- scaling
def scaling(
    throughput: Mapping[int, float], efficiency: Mapping[int, float], *, cores: int | None = None
) -> plt.Figure:
    """Throughput (with the ideal linear line) and scaling efficiency per process count;
    counts beyond ``cores`` are shaded as oversubscribed."""
    ns = sorted(throughput)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.bar(
        [str(n) for n in ns],
        [throughput[n] for n in ns],
        color="tab:blue",
        alpha=0.75,
        label="measured",
    )
    ax1.plot(
        [str(n) for n in ns],
        [throughput[ns[0]] * n / ns[0] for n in ns],
        "k--",
        marker="o",
        label="ideal (linear)",
    )
    if cores is not None and any(n > cores for n in ns):
        ax1.plot(
            [str(n) for n in ns],
            [throughput[ns[0]] * min(n, cores) / ns[0] for n in ns],
            ":",
            color="crimson",
            marker="s",
            label=f"at best, on {cores} cores",
        )
    ax1.set_xlabel("processes")
    ax1.set_ylabel("samples / s")
    ax1.legend(fontsize=8)
    ax2.bar([str(n) for n in ns], [efficiency[n] * 100 for n in ns], color="tab:green", alpha=0.75)
    ax2.axhline(100, color="k", ls="--", lw=1)
    ax2.set_xlabel("processes")
    ax2.set_ylabel("scaling efficiency (%)")
    for ax in (ax1, ax2):
        ax.grid(True, axis="y", alpha=0.3)
        if cores is not None:
            over = [i for i, n in enumerate(ns) if n > cores]
            if over:
                ax.axvspan(over[0] - 0.5, len(ns) - 0.5, color="0.85", zorder=0)
                ax.text(
                    over[0],
                    ax.get_ylim()[1] * 0.55,
                    f"> {cores} cores:\noversubscribed",
                    ha="center",
                    va="top",
                    fontsize=8,
                )
    fig.tight_layout()
    return fig


def compare_bars(values: Mapping[str, Mapping[str, float]], *, title: str = "") -> plt.Figure:
    """Side-by-side bars: ``values[metric][label]``, one panel per metric."""
    fig, axes = plt.subplots(1, len(values), figsize=(4 * len(values), 3.2), squeeze=False)
    for ax, (metric, row) in zip(axes.flat, values.items(), strict=True):
        ax.bar(list(row), list(row.values()), color=RANK_COLORS[: len(row)], alpha=0.8)
        ax.set_title(metric, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def accuracy_vs_time(
    evals: Mapping[int, Sequence[Mapping[str, float]]],
    target: float,
    reached: Mapping[int, float | None],
    *,
    cores: int | None = None,
) -> plt.Figure:
    """Test accuracy against seconds of training for each process count (left), and the
    time each took to reach ``target`` (right; counts beyond ``cores`` hatched: they took
    turns on the cores, so their time says little)."""
    ns = sorted(evals)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for n in ns:
        ax1.plot(
            [e["seconds"] for e in evals[n]],
            [100 * e["val_acc"] for e in evals[n]],
            marker="o",
            ms=3,
            label=f"N = {n}",
        )
    ax1.axhline(100 * target, color="k", ls="--", lw=1, label=f"target {target:.1%}")
    ax1.set_xlabel("seconds of training (evaluations left out)")
    ax1.set_ylabel("test accuracy (%)")
    ax1.legend(fontsize=8)
    labels = [str(n) for n in ns]
    heights = [reached[n] if reached[n] is not None else 0.0 for n in ns]
    bars = ax2.bar(labels, heights, color="tab:purple", alpha=0.75)
    for bar, n in zip(bars, ns):
        if cores is not None and n > cores:
            bar.set_hatch("//")
        if reached[n] is None:
            ax2.text(
                bar.get_x() + bar.get_width() / 2,
                0,
                "not\nreached",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax2.set_xlabel("processes" + (f" (hatched: more than {cores} cores)" if cores else ""))
    ax2.set_ylabel("seconds to the target")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
