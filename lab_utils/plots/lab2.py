"""Figures for Lab 2: who sends what in each collective, the ring step by step, timings
and traffic, DDP knobs, Horovod's timeline, scaling, and script diffs by step."""

from __future__ import annotations

import difflib
import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from lab_utils.source import render

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
    rows = [r for r in records if r.get("event") == "timing"]
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
    rows = [r for r in records if r.get("event") == "timing" and r["algo"] == algo]
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
    buckets = sorted(
        (r for r in records if r.get("event") == "bucket"), key=lambda r: r["bucket_cap_mb"]
    )
    accum = sorted((r for r in records if r.get("event") == "accum"), key=lambda r: r["accum"])
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
@dataclass(frozen=True)
class Span:
    """One activity of one tensor in a Horovod timeline (seconds from the start)."""

    tensor: str
    activity: str
    start: float
    end: float


def read_timeline(path: str | Path) -> list[Span]:
    """Parse a Horovod timeline (Chrome trace JSON, written by ``HOROVOD_TIMELINE``).

    Horovod writes one process per tensor (``M`` metadata events name it) and ``B``/
    ``E`` event pairs per activity; a file whose job was killed may lack the closing
    bracket, which is tolerated.
    """
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"{path} is empty: did the job run with HOROVOD_TIMELINE set?")
    text = text.rstrip(",")
    if not text.endswith("]"):
        text += "]"
    events = json.loads(text)
    names: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[e["pid"]] = e["args"]["name"]
    open_: dict[tuple[int, int], list[tuple[str, float]]] = {}
    spans: list[Span] = []
    for e in events:
        key = (e.get("pid", 0), e.get("tid", 0))
        if e.get("ph") == "B":
            open_.setdefault(key, []).append((e.get("name", "?"), e["ts"] / 1e6))
        elif e.get("ph") == "E" and open_.get(key):
            activity, start = open_[key].pop()
            spans.append(Span(names.get(key[0], str(key[0])), activity, start, e["ts"] / 1e6))
    if spans:
        t0 = min(s.start for s in spans)
        spans = [Span(s.tensor, s.activity, s.start - t0, s.end - t0) for s in spans]
    return spans


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


# ---------------------------------------------------------------- script diffs
_STEP_TAG = re.compile(r"#.*?\[(\d+)\]")


@dataclass(frozen=True)
class DiffStep:
    """The changed lines of one numbered step of a script conversion."""

    step: int
    hunks: tuple[tuple[tuple[str, str], ...], ...]  # each line as (kind "+"/"-"/" ", text)

    @property
    def added(self) -> int:
        return sum(kind == "+" for hunk in self.hunks for kind, _ in hunk)

    @property
    def removed(self) -> int:
        return sum(kind == "-" for hunk in self.hunks for kind, _ in hunk)


def diff_steps(old: str, new: str) -> list[DiffStep]:
    """Group the differences between two scripts by the step tags ``# ... [k]`` on the
    new script's lines.

    Within each changed block, an untagged added line belongs to the step of the tagged
    line above it (or, at the top of the block, below it); a removed line goes to the
    segment of the added line most like it. Blocks without any tag (e.g. the docstring)
    are step 0. Each segment is shown with one unchanged line of context on either side.
    """
    a, b = old.splitlines(), new.splitlines()
    steps: dict[int, list] = {}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        tags = [int(m.group(1)) if (m := _STEP_TAG.search(t)) else None for t in b[j1:j2]]
        for k in range(1, len(tags)):  # untagged lines continue the step above them ...
            tags[k] = tags[k] if tags[k] is not None else tags[k - 1]
        for k in range(len(tags) - 2, -1, -1):  # ... or, at the top, the one below
            tags[k] = tags[k] if tags[k] is not None else tags[k + 1]
        segments: list[tuple[int, int, list[str]]] = []  # (tag, first b index, removed)
        for k, tag in enumerate(tags):
            if k == 0 or tag != tags[k - 1]:
                segments.append((tag or 0, j1 + k, []))
        if not segments:  # a pure deletion: tagged by what it deleted, else step 0
            m = next((_STEP_TAG.search(t) for t in a[i1:i2] if _STEP_TAG.search(t)), None)
            segments.append((int(m.group(1)) if m else 0, j1, []))
        bounds = [s[1] for s in segments[1:]] + [j2]
        for line in a[i1:i2]:
            best = max(
                range(len(segments)),
                key=lambda k: max(
                    (_likeness(line, t) for t in b[segments[k][1] : bounds[k]]), default=(0, 0.0)
                ),
            )
            segments[best][2].append(line)
        for (tag, start, removed), stop in zip(segments, bounds, strict=True):
            before = [(" ", b[start - 1])] if start > 0 else []
            after = [(" ", b[stop])] if stop < len(b) else []
            lines = before + [("-", t) for t in removed] + [("+", t) for t in b[start:stop]] + after
            steps.setdefault(tag, []).append(tuple(lines))
    return [DiffStep(k, tuple(v)) for k, v in sorted(steps.items())]


def _likeness(a: str, b: str) -> tuple[int, float]:
    """How alike two lines are: common prefix length first (an edited line keeps its
    start), then difflib's similarity ratio."""
    a, b = a.strip(), b.strip()
    return len(os.path.commonprefix([a, b])), difflib.SequenceMatcher(None, a, b).ratio()


def diff_html(step: DiffStep, title: str = "") -> str:
    """One step's hunks as coloured HTML (green added, red removed)."""
    style = {
        "+": "background:#e6ffec;color:#1a7f37",
        "-": "background:#ffebe9;color:#cf222e",
        " ": "color:#57606a",
    }
    parts = [
        f"<div style='font-weight:bold;margin-top:0.6em'>{html.escape(title)}</div>"
        if title
        else ""
    ]
    for hunk in step.hunks:
        rows = "".join(
            f"<div style='{style[k]}'>{html.escape(k + ' ' + t) or '&nbsp;'}</div>" for k, t in hunk
        )
        parts.append(
            "<pre style='font-size:11px;line-height:1.25;margin:0.3em 0;padding:0.3em;"
            f"border:1px solid #d0d7de'>{rows}</pre>"
        )
    return "".join(parts)


def show_diff(
    old_path: str | Path,
    new_path: str | Path,
    names: Mapping[int, str] | None = None,
    only: Sequence[int] | None = None,
) -> list[DiffStep]:
    """Display the conversion of ``old_path`` into ``new_path`` step by step (HTML in a
    notebook, plain text elsewhere), or only the steps ``only``; return all steps."""
    steps = diff_steps(Path(old_path).read_text(), Path(new_path).read_text())
    names = names or {}
    shown = [s for s in steps if only is None or s.step in only]
    titles = [f"[{s.step}] {names.get(s.step, '')} (+{s.added} −{s.removed} lines)" for s in shown]
    pairs = list(zip(shown, titles, strict=True))
    plain = "\n".join(
        "\n".join([t, *(k + " " + line for hunk in s.hunks for k, line in hunk)]) for s, t in pairs
    )
    render("".join(diff_html(s, t) for s, t in pairs), plain)
    return steps


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
