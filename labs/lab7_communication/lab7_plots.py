"""Figures of Lab 7 (training over a slow network)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter, ScalarFormatter


def sweep_fit(
    points: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    fits: Mapping[str, tuple[float, float]],
    *,
    burst_bytes: int,
    fitted_from: float,
) -> plt.Figure:
    """All-reduce time against the bytes it put on the link, one colour per link (log-log),
    with each shaped link's fitted t = α + β·(bytes − burst); below, the residuals
    measured / fitted − 1 of the points the fit used (bytes ≥ ``fitted_from`` bursts)."""
    fig, (ax, res) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    for k, (label, (x, t)) in enumerate(points.items()):
        color = f"C{k}"
        x, t = np.asarray(x, float), np.asarray(t, float)
        ax.loglog(x, t * 1e3, "o", color=color, label=label)
        if label in fits:
            alpha, beta = fits[label]
            grid = np.geomspace(max(x.min(), 1.05 * burst_bytes), x.max(), 60)
            ax.loglog(grid, (alpha + beta * (grid - burst_bytes)) * 1e3, "-", color=color, lw=1)
            used = x >= fitted_from * burst_bytes
            fitted = alpha + beta * (x[used] - burst_bytes)
            res.semilogx(x[used], (t[used] / fitted - 1) * 100, "o-", color=color, label=label)
    ax.axvline(burst_bytes, color="grey", ls=":", lw=1)
    ax.text(burst_bytes, ax.get_ylim()[1], " burst", va="top", fontsize=8, color="grey")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_ylabel("ms per all-reduce (median)")
    ax.set_title("lines: t = α + β·(bytes − burst), fitted per link")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3, which="both")
    res.axhline(0, color="grey", lw=0.8)
    res.set_ylabel("residual (%)")
    res.set_xlabel("bytes on the link per all-reduce (counted by the qdisc)")
    res.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def ddp_against_rate(
    rates_mbit: Sequence[float],
    measured: Mapping[str, Sequence[float]],
    predicted_naive: Sequence[float],
    *,
    crossover_mbit: float | None,
    unshaped: Mapping[str, float] | None = None,
) -> plt.Axes:
    """Median step time of each variant against the link's rate (log x), the predicted
    naive step (compute + communication over the link) and the predicted crossover;
    the unshaped loopback's steps as dotted horizontal lines."""
    _, ax = plt.subplots(figsize=(7, 4.2))
    r = np.asarray(rates_mbit, float)
    for k, (name, ys) in enumerate(measured.items()):
        ax.semilogx(r, np.asarray(ys) * 1e3, "o-", color=f"C{k}", label=name)
        if unshaped and name in unshaped:
            ax.axhline(unshaped[name] * 1e3, color=f"C{k}", ls=":", lw=1)
    ax.semilogx(  # a marker too: with one rate there is no line to draw
        r, np.asarray(predicted_naive) * 1e3, "kx--", lw=1, ms=8, label="naive, predicted"
    )
    if crossover_mbit:
        ax.axvline(crossover_mbit, color="grey", ls="-.", lw=1)
        ax.text(crossover_mbit, ax.get_ylim()[1], " predicted crossover", va="top", fontsize=8)
    ax.set_xticks(r)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("DDP step against link rate (dotted: the unshaped loopback)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def _before(per_step: Sequence[float]) -> np.ndarray:
    """The running total *before* each step: 0, then the cumulative sum less the last."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(per_step, float))[:-1]])


def loss_against_time_and_bytes(
    runs: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
) -> plt.Figure:
    """The training loss of each method against the training time before it, one panel
    per link (``runs[link label][method]``, each with per-step ``losses``, ``seconds`` and
    ``bytes_by_step``), and, in the last panel, against the all-reduce bytes sent before
    it (MiB, one rank; from the first link's runs: the bytes are the same at every rate).
    A step's loss is measured in its forward, before its update (``steps.run_steps``): it
    is charged the steps before it, not its own time and bytes (as notebook 4's plot)."""
    n = len(runs) + 1
    cols = 2
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.6 * rows), squeeze=False)
    axes = axes.ravel()
    for ax, (label, at_rate) in zip(axes, runs.items()):
        for k, (method, run) in enumerate(at_rate.items()):
            ax.plot(_before(run["seconds"]), run["losses"], ".-", color=f"C{k}", label=method)
        ax.set_title(f"{label}: loss against time")
        ax.set_xlabel("training time before the step (s, the steps' own)")
        ax.set_ylabel("training loss (mean over ranks)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    by_bytes = axes[n - 1]
    for k, (method, run) in enumerate(next(iter(runs.values())).items()):
        mib = _before(run["bytes_by_step"]) / 2**20
        by_bytes.plot(mib, run["losses"], ".-", color=f"C{k}", label=method)
    by_bytes.set_xscale("symlog", linthresh=0.1)
    by_bytes.set_title("every link: loss against bytes")
    by_bytes.set_xlabel("MiB all-reduced before the step (one rank; linear below 0.1)")
    by_bytes.set_ylabel("training loss (mean over ranks)")
    by_bytes.grid(True, alpha=0.3, which="both")
    by_bytes.legend(fontsize=8)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def diloco_losses(runs: Mapping[str, Mapping]) -> plt.Figure:
    """Each run's training loss (mean over ranks) against the step — the same tokens — and
    against the all-reduce bytes sent before it (symlog x: linear from 0 up to the
    smallest amount any run sent, log above): one point per amount sent, the last loss
    measured with that much sent (a run's steps before its first sync: one point at 0).
    A step's loss is measured before its update, so it is charged the bytes before it."""
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    smallest = min(b for run in runs.values() for b in run["bytes_by_step"] if b) / 2**20
    for k, (label, run) in enumerate(runs.items()):
        losses = np.asarray(run["losses"], float)
        by_step.plot(range(1, len(losses) + 1), losses, color=f"C{k}", lw=1.2, label=label)
        before = _before(run["bytes_by_step"]) / 2**20
        last = np.append(before[1:] != before[:-1], True)
        by_bytes.plot(before[last], losses[last], "o-", ms=3, color=f"C{k}", lw=1.2, label=label)
    by_step.set_xlabel("step (the same global batches: equal tokens)")
    by_step.set_ylabel("training loss (mean over ranks)")
    by_step.set_title("at equal tokens")
    by_step.legend(fontsize=8)
    # symlog, as notebook 5's: a short run's amounts may lie within one decade, where a
    # log axis has no labelled tick; linear below the smallest sync keeps 0 on the axis
    by_bytes.set_xscale("symlog", linthresh=smallest)
    by_bytes.xaxis.set_major_formatter(ScalarFormatter())
    by_bytes.set_xlabel(f"MiB all-reduced before the step (one rank; linear below {smallest:.2g})")
    by_bytes.set_title("at equal bytes")
    by_bytes.legend(fontsize=8)
    for ax in (by_step, by_bytes):
        ax.grid(True, alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def bytes_per_step(runs: Mapping[str, Mapping]) -> plt.Axes:
    """The all-reduce bytes of every step of each run, side by side: DiLoCo's syncs send
    the whole model at once, Streaming DiLoCo's one fragment at a time, more often."""
    _, ax = plt.subplots(figsize=(9, 3.2))
    width = 0.8 / max(1, len(runs))
    for k, (label, run) in enumerate(runs.items()):
        sent = np.asarray(run["bytes_by_step"], float) / 1024
        steps = np.arange(1, len(sent) + 1) + (k - (len(runs) - 1) / 2) * width
        ax.bar(steps, sent, width=width, color=f"C{k}", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("KiB all-reduced (one rank)")
    ax.set_title("bytes of each step: one spike per sync")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


# ------------------------------------------ notebooks 2 and 3: the fast and the slow link
def step_times_by_rate(
    times: Mapping[str, Mapping[str, Sequence[float]]], *, title: str
) -> plt.Axes:
    """Step time of each method (``times[link label][method]``: the seconds of its
    steps) side by side for each link: a bar at the median, a dot per step."""
    _, ax = plt.subplots(figsize=(7, 3.8))
    links = list(times)
    methods = list(dict.fromkeys(m for at in times.values() for m in at))
    width = 0.8 / len(links)
    for k, link in enumerate(links):
        for i, m in enumerate(methods):
            if m not in times[link]:
                continue
            ys = np.asarray(times[link][m], float) * 1e3
            x = i - 0.4 + width * (k + 0.5)
            ax.bar(x, np.median(ys), width * 0.9, color=f"C{k}", label=link if i == 0 else None)
            ax.plot(np.full(ys.size, x), ys, "k.", ms=3)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("ms per step (bar: median; dots: each step)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def loss_against_tokens_bytes_time(
    runs: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    tokens_per_step: int,
    link_label: str,
) -> plt.Figure:
    """The training loss of each method (``runs[method]``: per-step ``losses``,
    ``bytes_by_step``, ``seconds``) against the tokens trained on, the all-reduce bytes
    sent (MiB, one rank) and the seconds spent, on one link. A step's loss is measured in
    its forward, before its update (``steps.run_steps``): each is plotted at what the
    steps BEFORE it took (the first at 0), as notebook 5's plots."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    by_tokens, by_bytes, by_time = axes
    for k, (name, run) in enumerate(runs.items()):
        color = f"C{k}"
        tokens = tokens_per_step * np.arange(len(run["losses"]))
        mib = _before(run["bytes_by_step"]) / 2**20
        t = _before(run["seconds"])
        by_tokens.plot(tokens, run["losses"], ".-", color=color, label=name)
        by_bytes.plot(mib, run["losses"], ".-", color=color, label=name)
        by_time.plot(t, run["losses"], ".-", color=color, label=name)
    by_tokens.set_xlabel("tokens trained on before the step (all ranks)")
    by_tokens.set_ylabel("training loss (mean over ranks)")
    by_bytes.set_xlabel("MiB all-reduced before the step (one rank)")
    by_time.set_xlabel("seconds before the step")
    by_tokens.set_title("per token")
    by_bytes.set_title("per byte")
    by_time.set_title(f"per second on {link_label}")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    by_time.legend(fontsize=8)
    fig.tight_layout()
    return fig
