"""Figures of Lab 5: staleness, parameter-server throughput, Hogwild, EASGD, graphs,
and time lost to a failure. Each takes the records a job emitted and returns a figure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np

from lab_utils.plots import curves


def staleness_histogram(runs: Mapping[str, Sequence[int]], cap: int = 10) -> plt.Figure:
    """How many updates each applied gradient missed (versions between pull and apply);
    values of ``cap`` or more share the last bar, so a long tail stays visible."""
    fig, ax = plt.subplots(figsize=(7, 3.5 + 0.3 * len(runs)))
    width = 0.8 / max(1, len(runs))
    xs = np.arange(cap + 1)
    for i, (label, values) in enumerate(runs.items()):
        counts = Counter(min(int(s), cap) for s in values)
        share = np.array([counts.get(int(x), 0) for x in xs]) / max(1, len(values))
        ax.bar(
            xs + (i - (len(runs) - 1) / 2) * width,
            share,
            width=width,
            label=f"{label}: mean {np.mean(values):.2f}, max {max(values)}",
        )
    ax.set_xticks(xs, [str(x) for x in xs[:-1]] + [f"≥{cap}"])
    ax.set_yscale("log")
    ax.set_xlabel("staleness (updates applied between the worker's pull and its push)")
    ax.set_ylabel("share of applied gradients (log)")
    ax.set_title("measured staleness of every applied gradient")
    ax.grid(True, axis="y", alpha=0.3)
    # Under the axes, one run per line: inside, it would hide bars.
    fig.legend(loc="lower center", ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0.3 * len(runs) / (3.5 + 0.3 * len(runs)) + 0.02, 1, 1))
    return fig


def accuracy_vs_time(evals: Mapping[str, Sequence[Mapping[str, float]]]) -> plt.Axes:
    """Test accuracy of the server's own model at evenly spaced update counts against wall
    time, one curve per run, each ending at the run's final model."""
    series = {
        label: ([r["t"] for r in rows], [r["acc"] for r in rows]) for label, rows in evals.items()
    }
    return curves(
        series,
        xlabel="wall time (s)",
        ylabel="test accuracy",
        title="parameter server: accuracy against wall time",
    )


def throughput(rows: Sequence[Mapping[str, Any]]) -> plt.Figure:
    """Gradients per second and the servers' busy share, against the number of workers.
    Every point must come from runs of the same length (gradients per worker): rates of
    runs of different lengths differ by their start-up share alone."""
    lengths = sorted({r["steps"] for r in rows})
    if len(lengths) != 1:
        raise ValueError(f"runs of different lengths in one sweep: {lengths} gradients per worker")
    fig, (ax, ax_busy) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, shards in sorted({(r["mode"], r["shards"]) for r in rows}):
        sel = sorted(
            (r for r in rows if (r["mode"], r["shards"]) == (mode, shards)),
            key=lambda r: r["workers"],
        )
        name = f"{mode}, {shards} shard{'s' if shards > 1 else ''}"
        ax.plot(
            [r["workers"] for r in sel], [r["grads_per_s"] for r in sel], marker="o", label=name
        )
        ax_busy.plot(
            [r["workers"] for r in sel],
            [100 * max(r["server_busy"]) for r in sel],
            marker="o",
            label=name,
        )
    ax.set_ylabel("gradients applied per second")
    ax.set_title(f"throughput ({lengths[0]} gradients per worker)")
    ax_busy.set_ylabel("busiest server: % of wall time updating")
    ax_busy.set_title("server load")
    workers = sorted({r["workers"] for r in rows})
    for a in (ax, ax_busy):
        a.set_xlabel("workers")
        a.set_xticks(workers)  # whole workers only
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
    # One legend under both panels, where it hides no curve.
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def hogwild(records: Sequence[Mapping[str, Any]]) -> plt.Figure:
    """Updates per second, test accuracy and collided writes, lock vs no lock, per model."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    models = [m for m in ("dense", "sparse") if any(r["model"] == m for r in records)]
    x = np.arange(len(models))
    for j, (lock, name) in enumerate(((True, "lock"), (False, "no lock (Hogwild!)"))):
        rec = [
            next((r for r in records if r["model"] == m and r["lock"] == lock), None)
            for m in models
        ]
        for ax, key, scale in zip(
            axes, ("updates_per_s", "acc", "collided_when_overlapping"), (1, 1, 100), strict=True
        ):
            vals = [scale * r[key] if r else 0 for r in rec]
            ax.bar(x + (j - 0.5) * 0.38, vals, width=0.38, label=name)
    panels = (
        ("updates per second", "updates / s (both workers)"),
        ("test accuracy", "accuracy of the shared model"),
        (
            "overlapping writes: % of their weights\nthat the other write also wrote",
            "% of the weights written",
        ),
    )
    for ax, (title, ylabel) in zip(axes, panels, strict=True):
        ax.set_xticks(x, [f"{m} model" for m in models])
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2)  # above the panels, on no bar
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return fig


def easgd(records: Sequence[Mapping[str, Any]]) -> plt.Figure:
    """Test accuracy of the centre (EASGD) or the average (SGD) against communication rounds."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.5), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, method in zip(axes, methods, strict=True):
        series = {}
        for tau in sorted({r["tau"] for r in records if r["method"] == method}):
            rows = [r for r in records if r["method"] == method and r["tau"] == tau]
            series[f"τ = {tau}"] = ([r["round"] for r in rows], [r["acc"] for r in rows])
        curves(
            series,
            xlabel="rounds of communication (log)",
            ylabel="test accuracy",
            title=method,
            logx=True,
            ax=ax,
        )
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    fig.tight_layout()
    return fig


def fx_graph(gm: Any, title: str = "") -> plt.Figure:
    """Draw a ``torch.fx.GraphModule``'s nodes top to bottom, with their data edges."""
    nodes = list(gm.graph.nodes)
    pos = {n: (0.0, -i) for i, n in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(6, 0.55 * len(nodes) + 0.5))
    colours = {
        "placeholder": "#cde",
        "call_module": "#fdb",
        "call_function": "#dfd",
        "call_method": "#dfd",
        "get_attr": "#eee",
        "output": "#cde",
    }
    for n in nodes:
        for inp in n.all_input_nodes:
            (x0, y0), (x1, y1) = pos[inp], pos[n]
            rad = 0.0 if y0 - y1 == 1 else 0.4
            ax.annotate(
                "",
                xy=(x1, y1 + 0.25),
                xytext=(x0, y0 - 0.25),
                arrowprops={"arrowstyle": "->", "connectionstyle": f"arc3,rad={rad}"},
            )
        target = (
            n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        )
        ax.text(
            0,
            pos[n][1],
            f"{n.op}: {target}",
            ha="center",
            va="center",
            fontsize=9,
            bbox={"boxstyle": "round", "fc": colours.get(n.op, "#fff")},
        )
    ax.set_xlim(-1.5, 1.5)
    ax.set_ylim(-len(nodes), 1)
    ax.axis("off")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


FAILURE_PARTS = (
    ("restart_s", "restart (detect, stop, start, rendezvous, load)"),
    ("redo_s", "steps redone × median step time"),
    ("ckpt_s", "writing the run's checkpoints"),
)


def time_lost(rows: Sequence[Mapping[str, Any]]) -> plt.Axes:
    """What one killed rank cost, per checkpoint interval: one stacked bar of its parts,
    each measured in that run (``restart_s``, ``redo_s``, ``ckpt_s``; ``redone`` steps)."""
    rows = sorted(rows, key=lambda r: r["interval"])
    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    xs = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, label in FAILURE_PARTS:
        vals = np.array([r[key] for r in rows], dtype=float)
        ax.bar(xs, vals, bottom=bottom, width=0.6, label=label)
        bottom += vals
    ax.set_xticks(xs, [f"every {r['interval']} steps\n({r['redone']} redone)" for r in rows])
    ax.set_xlabel("checkpoint interval")
    ax.set_ylabel("seconds")
    ax.set_title("cost of one failure, part by part")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside, never on a bar
    fig.tight_layout()
    return ax
