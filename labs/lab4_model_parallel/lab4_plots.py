"""Figures for Lab 4: F/B schedule grids from measured timestamps, bubble vs
micro-batches, memory per rank, and bars of the training-state breakdown."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from lab_utils import timeline

KIND_COLORS = {"F": "#4c72b0", "B": "#55a868"}


def _rank_rows(
    events: Sequence[Mapping],
    ax: plt.Axes,
    colors: Mapping[str, str],
    label: Callable[[Mapping], str],
    *,
    narrowest: int,
    fontsize: int,
    row: str,
    alpha: Callable[[Mapping], float | None] = lambda e: None,
) -> None:
    """One row per rank, one box per block at its measured start and length (ms since the
    step began), labelled where it is wider than 1/``narrowest`` of the step."""
    t0, t1 = timeline.span(events)
    ranks = sorted({e["rank"] for e in events})
    for e in events:
        x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.broken_barh(
            [(x, w)],
            (e["rank"] - 0.4, 0.8),
            facecolors=colors[e["kind"]],
            alpha=alpha(e),
            edgecolors="white",
            linewidth=0.5,
        )
        if w > (t1 - t0) * 1e3 / narrowest:
            ax.text(
                x + w / 2,
                e["rank"],
                label(e),
                ha="center",
                va="center",
                color="white",
                fontsize=fontsize,
            )
    ax.set_yticks(ranks, [f"{row} {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, -0.6)
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_xlabel("ms since the step began")


def schedule_grid(
    events: Sequence[Mapping], ax: plt.Axes | None = None, title: str = ""
) -> plt.Axes:
    """One row per rank, one box per forward (blue) or backward (green) of a
    micro-batch, at its measured start and length; white space is idle time."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.6))
    label = lambda e: f"{e['kind']}{e['mb']}"
    _rank_rows(events, ax, KIND_COLORS, label, narrowest=60, fontsize=7, row="stage")
    ax.set_title(title or f"bubble {timeline.bubble_fraction(events):.0%}", fontsize=9, loc="left")
    return ax


def schedule_grids(runs: Sequence[Mapping], title: str = "") -> plt.Figure:
    """:func:`schedule_grid` for several pipeline runs, one panel each."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.3 * len(runs) + 0.8), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        schedule_grid(
            run["events"],
            ax,
            f"{run['schedule']}, m={run['microbatches']}: bubble "
            f"{run['bubble']:.0%} measured, {run['replay_bubble']:.0%} replayed, "
            f"{run['ideal_bubble']:.0%} formula",
        )
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    fig.suptitle(title or "per-stage timeline (blue F = forward, green B = backward)", fontsize=10)
    fig.tight_layout()
    return fig


def bubble_vs_microbatches(runs: Sequence[Mapping], p: int, ax: plt.Axes | None = None) -> plt.Axes:
    """Per schedule: the measured bubble (filled) and the bubble of the schedule replayed
    with the run's own block times (hollow), against (p−1)/(m+p−1), which assumes equal
    stages and free communication."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.4))
    ms = np.arange(1, max(r["microbatches"] for r in runs) + 1)
    ax.plot(ms, [timeline.ideal_bubble(p, m) for m in ms], "k--", label="(p−1)/(m+p−1)")
    for name, marker, color in (("gpipe", "o", "C0"), ("1f1b", "s", "C1")):
        mine = sorted((r for r in runs if r["schedule"] == name), key=lambda r: r["microbatches"])
        if not mine:
            continue
        m_of = [r["microbatches"] for r in mine]
        ax.plot(
            m_of, [r["bubble"] for r in mine], marker=marker, color=color, label=f"{name} measured"
        )
        ax.plot(
            m_of,
            [r["replay_bubble"] for r in mine],
            marker=marker,
            color=color,
            ls=":",
            mfc="none",
            label=f"{name} replayed",
        )
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{p} stages", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def stacked_bytes(
    rows: Mapping[str, Mapping[str, float]],
    ax: plt.Axes | None = None,
    unit: float = 2**20,
    unit_name: str = "MiB",
    title: str = "",
) -> plt.Axes:
    """Stacked bars: for each row (a strategy or a setting) its bytes per kind."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    labels = list(rows)
    kinds = list(next(iter(rows.values())))
    bottom = np.zeros(len(labels))
    for kind in kinds:
        vals = np.array([rows[k][kind] / unit for k in labels])
        ax.bar(labels, vals, bottom=bottom, label=kind)
        bottom += vals
    ax.set_ylabel(f"{unit_name} per rank")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


# ------------------------------------------------- interleaved and zero-bubble schedules
STAGE_KIND_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}


def stage_timeline(run: Mapping, ax: plt.Axes | None = None) -> plt.Axes:
    """One row per rank; each block (F forward blue, B backward for the inputs green, W
    backward for the weights orange) at its measured start and length, labelled
    ``stage·kind·micro-batch`` when it is wide enough; lighter shades for a rank's
    later stages. White space is idle time."""
    events = run["events"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.6))
    firsts: dict[int, int] = {}
    for e in events:
        firsts[e["rank"]] = min(e["stage"], firsts.get(e["rank"], e["stage"]))
    label = lambda e: f"{e['stage']}{e['kind']}{e['mb']}"
    shade = lambda e: 0.6 if e["stage"] != firsts[e["rank"]] else 1.0  # later stages paler
    _rank_rows(
        events, ax, STAGE_KIND_COLORS, label, narrowest=45, fontsize=6, row="rank", alpha=shade
    )
    formula = run.get("formula_ratio")
    ax.set_title(
        f"{run['schedule']} (v={run['virtual']}), m={run['microbatches']}: bubble "
        f"{run['bubble']:.0%} measured, {run['replay_bubble']:.0%} replayed"
        + (f", {formula / (1 + formula):.0%} formula" if formula is not None else ""),
        fontsize=9,
        loc="left",
    )
    return ax


def stage_timelines(runs: Sequence[Mapping]) -> plt.Figure:
    """:func:`stage_timeline` for several schedules, one panel each, on one time axis."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, 1.3 * len(runs) + 0.8), squeeze=False, sharex=True
    )
    for ax, run in zip(axes[:, 0], runs):
        stage_timeline(run, ax)
    # the longest step (the axes are shared: each panel's own limit set them all)
    right = max(np.subtract(*timeline.span(run["events"])[::-1]) * 1e3 for run in runs)
    for ax in axes[:, 0]:
        ax.set_xlim(0, right)
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    fig.suptitle(
        "per-rank timeline: blue F = forward, green B = backward (the whole backward for "
        "1F1B and interleaved, the inputs' part for zero bubble), orange W = backward "
        "(weights), pale = the rank's later stage",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def bubbles_by_schedule(runs: Sequence[Mapping], ax: plt.Axes | None = None) -> plt.Axes:
    """Per schedule and m: the measured bubble (bar), the replayed one (black tick) and
    the formula's (grey tick) where the schedule has one."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{r['schedule']}\nm={r['microbatches']}" for r in runs]
    xs = np.arange(len(runs))
    ax.bar(xs, [r["bubble"] for r in runs], color="#bbbbbb", label="measured")
    ax.scatter(
        xs,
        [r["replay_bubble"] for r in runs],
        marker="_",
        s=400,
        color="k",
        label="replayed (this run's block times)",
    )
    ratios = [
        (x, r["formula_ratio"]) for x, r in zip(xs, runs) if r.get("formula_ratio") is not None
    ]
    if ratios:
        ax.scatter(
            [x for x, _ in ratios],
            [q / (1 + q) for _, q in ratios],
            marker="_",
            s=400,
            color="C3",
            label="formula (equal F, B, W; free messages), first block on any rank\n"
            "to last on any rank: ZB-V's is (p−1)/(6m) so, 0 counted per rank",
        )
    ax.set_xticks(xs, labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("bubble (idle share)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    return ax


def tokens_per_expert(
    panels: Mapping[str, Sequence[int]], capacity: int | None = None, title: str = ""
) -> plt.Figure:
    """One bar chart per panel: the choices each expert received (before the capacity cut),
    with the capacity as a dashed line (what lies above it was dropped)."""
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.2 * len(panels), 2.8), sharey=True, squeeze=False
    )
    for ax, (name, counts) in zip(axes[0], panels.items()):
        ax.bar([str(e) for e in range(len(counts))], counts, color="#4c72b0")
        if capacity is not None:
            ax.axhline(capacity, color="k", ls="--", lw=1, label="capacity")
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("expert")
    axes[0, 0].set_ylabel("choices routed")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def activations_vs_seq_len(rows: Sequence[Mapping], ax: plt.Axes | None = None) -> plt.Axes:
    """Activation bytes autograd saved for attention, per rank of a ring (one line per
    rank) and on one process (dashed), against the sequence length."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.4))
    rows = sorted(rows, key=lambda r: r["seq_len"])
    ts = [r["seq_len"] for r in rows]
    ax.plot(ts, [r["one_process"] / 2**20 for r in rows], "k--o", label="one process")
    for rank in range(len(rows[0]["per_rank"])):
        ax.plot(
            ts, [r["per_rank"][rank] / 2**20 for r in rows], marker="s", label=f"ring, rank {rank}"
        )
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("activations saved (MiB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title(f"attention, {len(rows[0]['per_rank'])} ranks", fontsize=9)
    ax.legend(fontsize=7)
    return ax
