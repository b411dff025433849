"""Figures of Lab 3: scaling rules, schedules, loss per update, accuracy against the
batch size and the number of updates, per-layer trust ratios, batch growth."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from lab_utils import optim


def scaling_rules(base_lr: float, base_batch: int, batches: Sequence[int]) -> plt.Figure:
    """The learning rate each scaling rule gives as the batch grows (log-log)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for rule, style in (("linear", "-o"), ("sqrt", "-s"), ("none", "--")):
        ax.plot(
            batches,
            [optim.scale_lr(base_lr, base_batch, b, rule) for b in batches],
            style,
            label=rule,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("learning rate")
    ax.set_title(f"Scaling rules from lr={base_lr:g} at batch {base_batch}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def schedules(
    factors: Mapping[str, Callable[[int], float]], steps: int, ax: plt.Axes | None = None
) -> plt.Axes:
    """Learning-rate factors per optimiser step (e.g. warm-up then decay)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(steps)
    for (label, f), style in zip(
        factors.items(), itertools.cycle(("-", "--", ":", "-.")), strict=False
    ):
        ax.plot(x, [f(int(s)) for s in x], style, label=label, lw=2)
    ax.set_xlabel("optimiser step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("LR factor")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot, off the warm-up ramp
    return ax


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    return np.convolve(y, kernel, mode="valid")


def _counted_axes(ax: plt.Axes, *, xlabel: str, ylabel: str, title: str) -> plt.Axes:
    """Labels, a grid and a small legend for runs drawn against a count (samples, steps,
    epochs, updates): whole numbers on the x axis."""
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def loss_per_step(
    results: Sequence[Any],
    *,
    x: str = "samples",
    smooth: int = 1,
    logy: bool = True,
    title: str = "",
    max_steps: int | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Training loss per update of several runs (``Result`` objects from the lab).

    ``x="samples"`` puts runs with different batches on the same axis (epochs of
    data seen); ``x="steps"`` shows the updates themselves.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        steps = r.steps[:max_steps] if max_steps else r.steps
        loss = np.array([s["loss"] for s in steps], dtype=float)
        if not len(loss):
            continue
        loss = np.where(np.isfinite(loss), loss, np.nan)
        y = _smooth(loss, smooth)
        xs = np.arange(len(loss))[len(loss) - len(y) :] + 1
        if x == "samples":
            xs = xs * r.run.batch
        ax.plot(xs, y, label=r.run.label + (" (diverged)" if r.diverged else ""))
    if logy:
        ax.set_yscale("log")
    return _counted_axes(
        ax,
        xlabel="training samples seen" if x == "samples" else "optimiser step",
        ylabel="training loss",
        title=title,
    )


def accuracy_bars(
    results: Sequence[Any],
    *,
    title: str = "",
    baseline: float | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Test accuracy of each run as a bar, labelled with its number of updates.

    The axis is zoomed on the runs that trained; a diverged run is drawn as a red
    stub marked "diverged" instead of stretching the axis down to chance level.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(max(5, 1.3 * len(results)), 3.8))
    acc = [100 * r.test_acc for r in results]
    ok = [a for a, r in zip(acc, results, strict=True) if not r.diverged] or acc
    lo, hi = max(0.0, min(ok) - 8), min(100.0, max(ok) + 8)
    heights = [
        a if not r.diverged else lo + 0.04 * (hi - lo) for a, r in zip(acc, results, strict=True)
    ]
    bars = ax.bar(
        range(len(results)), heights, color=["C3" if r.diverged else "C0" for r in results]
    )
    for bar, a, r in zip(bars, acc, results, strict=True):
        text = "diverged" if r.diverged else f"{a:.1f}%\n{r.updates} upd."
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="small",
        )
    if baseline is not None:
        ax.axhline(100 * baseline, color="k", ls="--", lw=1, label="baseline")
        ax.legend(loc="upper right")
    ax.set_xticks(range(len(results)), [r.run.label for r in results], rotation=20, ha="right")
    ax.set_ylim(lo, hi)
    ax.set_ylabel("test accuracy (%)")
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def accuracy_per_epoch(
    results: Sequence[Any], *, key: str = "val_acc", title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Validation accuracy after each epoch of several runs."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ep = [row["epoch"] for row in r.epochs if key in row]
        ax.plot(
            ep, [100 * row[key] for row in r.epochs if key in row], marker="o", label=r.run.label
        )
    return _counted_axes(
        ax,
        xlabel="epoch",
        ylabel="validation accuracy (%)" if key == "val_acc" else key,
        title=title,
    )


def accuracy_vs_updates(
    results: Sequence[Any], *, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Validation accuracy against the number of optimiser updates so far."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        rows = [row for row in r.epochs if "val_acc" in row]
        ax.plot(
            [row["step"] for row in rows],
            [100 * row["val_acc"] for row in rows],
            marker="o",
            label=f"{r.run.label} ({r.updates} updates)",
        )
    return _counted_axes(
        ax, xlabel="optimiser updates", ylabel="validation accuracy (%)", title=title
    )


def trust_ratios(
    records: Sequence[Mapping[str, float]],
    *,
    title: str = "",
    skip_constant: bool = True,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Per-layer trust ratios over training (from ``optim.TrustRatioRecorder``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    if not records:
        raise ValueError(
            "no trust ratios recorded: train with LARS or LAMB and a TrustRatioRecorder callback"
        )
    names = [k for k in records[0] if k != "step"]
    steps = [r["step"] for r in records]
    for name in names:
        y = np.array([r.get(name, np.nan) for r in records], dtype=float)
        if skip_constant and np.allclose(y, 1.0):
            continue  # excluded biases: always 1
        ax.plot(steps, y, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("trust ratio")
    ax.set_title(title or "Per-layer trust ratio")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def layer_norms(
    names: Sequence[str], w_norms: Sequence[float], g_norms: Sequence[float]
) -> plt.Figure:
    """‖w‖, ‖g‖ and their ratio for each layer: why one learning rate cannot suit all."""
    fig, (ax_n, ax_r) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = np.arange(len(names))
    ax_n.bar(x - 0.2, w_norms, 0.4, label="‖w‖")
    ax_n.bar(x + 0.2, g_norms, 0.4, label="‖∇w‖")
    ax_n.set_yscale("log")
    ax_n.set_xticks(x, names, rotation=30, ha="right")
    ax_n.legend()
    ax_n.set_title("norms per layer")
    ratio = np.asarray(w_norms) / np.maximum(np.asarray(g_norms), 1e-30)
    ax_r.bar(x, ratio, color="C2")
    ax_r.set_yscale("log")
    ax_r.set_xticks(x, names, rotation=30, ha="right")
    ax_r.set_title("‖w‖ / ‖∇w‖")
    for ax in (ax_n, ax_r):
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def batch_growth(
    growth: optim.BatchGrowth, base_lr: float, epochs: int, gamma: float
) -> plt.Figure:
    """Batch size and learning rate per epoch: decay the LR or grow the batch."""
    e = np.arange(epochs + 1)  # the last value drawn to the end of training
    during = [min(int(x), epochs - 1) for x in e]
    decay = [base_lr * gamma ** sum(x >= m for m in growth.milestones) for x in during]
    fig, (ax_lr, ax_b) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_lr.step(e, decay, where="post", label="LR decay")
    ax_lr.step(
        e,
        [base_lr * growth.lr_factor(x) for x in during],
        where="post",
        label="batch growth",
        ls="--",
    )
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_yscale("log")
    ax_b.step(e, [growth.base_batch] * len(e), where="post", label="LR decay")
    ax_b.step(
        e, [growth.batch_size(x) for x in during], where="post", label="batch growth", ls="--"
    )
    ax_b.set_ylabel("batch size")
    ax_b.set_yscale("log", base=2)
    for ax in (ax_lr, ax_b):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Same noise scale lr·N/B, two ways: shrink lr or grow B")
    fig.tight_layout()
    return fig
