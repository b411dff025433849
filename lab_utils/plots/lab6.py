"""Figures for Lab 6: the roofline with the course's operations on it, gradient
magnitudes against fp16's range, and saved activation bytes per recomputation policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np


# --------------------------------------------------------------------- 01–03
def roofline(peak_flops: float, bandwidth: float, points: Mapping[str, tuple[float, float]],
             *, lines: Mapping[str, float] | None = None, title: str = "",
             ax: plt.Axes | None = None) -> plt.Axes:
    """The roofline min(peak, intensity × bandwidth) on log axes, each operation at
    (intensity in FLOP/byte, achieved FLOP/s); ``lines`` marks intensities without a
    measured rate (vertical dashes)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    intensities = [i for i, _ in points.values()] + list((lines or {}).values())
    ridge = peak_flops / bandwidth
    lo = min([*intensities, ridge]) / 4
    hi = max([*intensities, ridge]) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(peak_flops, x * bandwidth) / 1e9, color="black", lw=2, label="roofline")
    ax.axvline(ridge, color="grey", ls=":", lw=1, label=f"ridge point {ridge:.3g} FLOP/byte")
    markers = "osD^vP*Xh"
    for i, (name, (intensity, achieved)) in enumerate(points.items()):
        ax.scatter(intensity, achieved / 1e9, s=45, zorder=3, marker=markers[i % len(markers)],
                   label=name)
    for name, intensity in (lines or {}).items():
        ax.axvline(intensity, color="tab:red", ls="--", lw=1, label=f"{name} (intensity only)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or "roofline from the measured peak and bandwidth", fontsize=10)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def gradient_magnitudes(grads: np.ndarray, *, scale: float, title: str = "",
                        ax: plt.Axes | None = None) -> plt.Axes:
    """Histogram of log2|g| of the non-zero gradients, with fp16's smallest subnormal
    (2⁻²⁴) and its largest value (65504) marked, before and after the loss scale."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    g = np.abs(np.asarray(grads, dtype=np.float64))
    g = g[g > 0]
    bins = np.arange(np.floor(np.log2(g.min())) - 1, np.ceil(np.log2(g.max() * scale)) + 2)
    ax.hist(np.log2(g), bins=bins, alpha=0.6, label="fp32 gradients")
    ax.hist(np.log2(g * scale), bins=bins, alpha=0.6, label=f"× scale 2^{np.log2(scale):.0f}")
    ax.axvline(-24, color="tab:red", ls="--", lw=1)
    ax.axvline(np.log2(65504), color="tab:red", ls="--", lw=1)
    ax.annotate("fp16: below 2⁻²⁴ → 0", (-24, 0), textcoords="offset points", xytext=(-110, 20),
                fontsize=8, color="tab:red")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("elements")
    ax.set_title(title or "gradient magnitudes against fp16's range", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def accumulation(sums: Mapping[str, Sequence[float]], exact: Sequence[float], *,
                 title: str = "", ax: plt.Axes | None = None) -> plt.Axes:
    """Running sums of many small additions in several accumulator dtypes vs the exact sum."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(exact) + 1), exact, color="black", lw=2, label="exact")
    for name, values in sums.items():
        ax.plot(range(1, len(values) + 1), values, label=name)
    ax.set_xlabel("additions")
    ax.set_ylabel("running sum")
    ax.set_title(title or "many small additions", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def saved_bytes_bars(saved: Mapping[str, int], *, title: str = "",
                     ax: plt.Axes | None = None) -> plt.Axes:
    """One bar per recomputation policy: MiB saved for backward, labelled with the
    share of the no-recomputation bytes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    names = list(saved)
    mib = [saved[n] / 2**20 for n in names]
    base = saved[names[0]]
    bars = ax.bar(names, mib, color="#4c72b0")
    for bar, n in zip(bars, names):
        ax.annotate(f"{saved[n] / base:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MiB saved for backward")
    ax.set_title(title or "activations kept for backward, by recomputation policy", fontsize=10)
    return ax
