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
    ax.semilogx(r, np.asarray(predicted_naive) * 1e3, "k--", lw=1, label="naive, predicted")
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
