"""Figures for Lab 6: the roofline with the course's operations on it, gradient
magnitudes against fp16's range, and saved activation bytes per recomputation policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np


# --------------------------------------------------------------------- 01–03
def roofline(
    peak_flops: float,
    bandwidth: float,
    points: Mapping[str, tuple[float, float]],
    *,
    lines: Mapping[str, float] | None = None,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
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
        ax.scatter(
            intensity, achieved / 1e9, s=45, zorder=3, marker=markers[i % len(markers)], label=name
        )
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


# log2 of the largest magnitude a cast to fp16 rounds to zero (underflows): half of the
# smallest subnormal 2⁻²⁴ (= 2⁻¹⁴ · 2⁻¹⁰), where round-to-nearest-even picks 0 over 2⁻²⁴.
FP16_UNDERFLOW_LOG2 = -25


def gradient_magnitudes(
    grads: np.ndarray, *, scale: float, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Histogram of log2|g| of the non-zero gradients, before and after the loss scale,
    with fp16's limits marked: a cast to fp16 rounds |g| ≤ 2⁻²⁵ (half the smallest
    subnormal, 2⁻²⁴; the tie at 2⁻²⁵ goes to the even neighbour, 0) to zero, and
    |g| ≥ 65520 (its largest value 65504 plus half a step there) to inf."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    g = np.abs(np.asarray(grads, dtype=np.float64))
    g = g[g > 0]
    bins = np.arange(np.floor(np.log2(g.min())) - 1, np.ceil(np.log2(g.max() * scale)) + 2)
    ax.hist(np.log2(g), bins=bins, alpha=0.6, label="fp32 gradients")
    ax.hist(np.log2(g * scale), bins=bins, alpha=0.6, label=f"× scale 2^{np.log2(scale):.0f}")
    ax.axvline(FP16_UNDERFLOW_LOG2, color="tab:red", ls="--", lw=1)
    ax.axvline(np.log2(65504), color="tab:red", ls="--", lw=1)
    ax.annotate(
        "fp16: |g| ≤ 2⁻²⁵ → 0",
        (FP16_UNDERFLOW_LOG2, 1),
        textcoords="offset points",
        xytext=(-105, 4),
        fontsize=8,
        color="tab:red",
        bbox={"fc": "white", "ec": "none", "alpha": 0.8},
    )
    ax.annotate(
        "65504, fp16's largest:\n|g| ≥ 65520 → inf",
        (np.log2(65504), 1),
        textcoords="offset points",
        xytext=(-95, 4),
        fontsize=8,
        color="tab:red",
        bbox={"fc": "white", "ec": "none", "alpha": 0.8},  # it lies over the scaled bars
    )
    ax.set_yscale("log")  # the few elements fp16 rounds to zero sit in the tail
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("elements (log scale)")
    ax.set_title(title or "gradient magnitudes against fp16's range", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def precision_losses(
    losses: Mapping[str, Sequence[float]], *, reference: str = "fp32", title: str = ""
) -> plt.Figure:
    """Training losses of runs in several precisions over the same steps, ``reference``
    drawn last (black, dashed) so that a curve it lies on stays visible, and below them
    each other run's loss minus the reference's, step by step: what coincides to the eye
    in the upper panel is resolved in the lower one."""
    fig, (ax, diff) = plt.subplots(
        2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": (2, 1)}
    )
    ref = np.asarray(losses[reference], dtype=float)
    steps = np.arange(1, len(ref) + 1)
    marker = "o" if len(ref) < 30 else None
    others = [(name, values) for name, values in losses.items() if name != reference]
    for i, (name, values) in enumerate(others):
        color = f"C{i + 1}"
        ax.plot(steps, values, color=color, lw=4, alpha=0.5, label=name)
        diff.plot(
            steps,
            np.asarray(values, dtype=float) - ref,
            color=color,
            marker=marker,
            label=f"{name} − {reference}",
        )
    ax.plot(steps, ref, color="black", ls="--", lw=1.5, marker=marker, ms=3, label=reference)
    diff.axhline(0.0, color="black", ls="--", lw=1)
    ax.set_ylabel("training loss")
    ax.set_title(title or "training loss by precision", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    diff.set_xlabel("step")
    diff.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    diff.set_ylabel(f"loss − {reference} loss")
    diff.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))  # differences are small
    diff.grid(True, alpha=0.3)
    diff.legend(fontsize=8)
    fig.tight_layout()
    return fig


def accumulation(
    sums: Mapping[str, Sequence[float]],
    exact: Sequence[float],
    *,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
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


def saved_bytes_bars(
    saved: Mapping[str, int], *, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """One bar per recomputation policy: MiB saved for backward, labelled with the
    share of the no-recomputation bytes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    names = list(saved)
    mib = [saved[n] / 2**20 for n in names]
    base = saved[names[0]]
    bars = ax.bar(names, mib, color="#4c72b0")
    for bar, n in zip(bars, names):
        ax.annotate(
            f"{saved[n] / base:.1%}",  # selective differs from none by under 1 %
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("MiB saved for backward")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)  # policy names are long
    ax.set_title(title or "activations kept for backward, by recomputation policy", fontsize=10)
    return ax


# --------------------------------------------------------------------- 04–06
def trace_timeline(
    traces: Mapping[int, object], *, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Per rank, two rows of intervals read from its profiler trace (``lab_utils.trace.Trace``):
    compute (operators) and communication (the backend's collectives), in ms."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.9 * len(traces)))
    rows, labels = 0, []
    for rank, t in sorted(traces.items()):
        for name, spans, color in (("compute", t.compute, "#4c72b0"), ("comm", t.comm, "#dd8452")):
            ax.broken_barh(
                [(s / 1e3, (e - s) / 1e3) for s, e in spans], (rows - 0.4, 0.8), color=color
            )
            labels.append(f"rank {rank} {name}")
            rows += 1
        for s, _ in t.steps:
            ax.axvline(s / 1e3, color="gray", lw=0.5, ls=":")
    ax.set_yticks(range(rows), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first recorded step (dotted: step starts)")
    ax.set_title(title or "compute and communication per rank, from the trace", fontsize=10)
    return ax


def overlap_by_bucket(
    caps: Sequence[float],
    overlap: Mapping[int, Sequence[float]],
    collectives: Sequence[float],
    *,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Overlap fraction per rank against DDP's bucket size, with all-reduces per step."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(caps))
    width = 0.8 / max(1, len(overlap))
    for i, (rank, values) in enumerate(sorted(overlap.items())):
        ax.bar(x + i * width, values, width, label=f"rank {rank}")
    for xi, c in zip(x, collectives):
        ax.annotate(
            f"{c:g} all-reduces per step", (xi + 0.4 - width / 2, 1.02), fontsize=8, ha="center"
        )
    ax.set_xticks(x + width * (len(overlap) - 1) / 2, [f"{c:g} MB" for c in caps])
    ax.set_ylim(0, 1.12)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("communication overlapped by compute")
    ax.legend(fontsize=8)
    return ax


def step_times(
    variants: Mapping[str, Sequence[float]], *, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Every timed step of each variant (ms), with its median as a bar."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for i, seconds in enumerate(variants.values()):
        ms = np.asarray(seconds) * 1e3
        ax.bar(i, np.median(ms), color="#dddddd", edgecolor="gray")
        ax.plot(np.full(len(ms), i), ms, "o", color="#4c72b0", ms=4)
    ax.set_xticks(range(len(variants)), list(variants))
    ax.set_ylabel("ms per step")
    ax.set_title(title or "step time (bars: median; dots: each step)", fontsize=10)
    return ax


def alpha_beta(
    sent: Sequence[float],
    seconds: Sequence[float],
    alpha: float,
    beta: float,
) -> plt.Figure:
    """Measured all-reduce times against the fitted t = α + β·(bytes each rank sends)
    (log-log), and below them the relative residuals measured / fitted − 1."""
    fig, (ax, res) = plt.subplots(
        2, 1, figsize=(6.5, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    x = np.asarray(sent, float)
    t = np.asarray(seconds, float)
    fitted = alpha + beta * x
    ax.loglog(x, t * 1e6, "o", label="measured (median)")
    grid = np.geomspace(x.min(), x.max(), 50)
    ax.loglog(
        grid,
        (alpha + beta * grid) * 1e6,
        "-",
        label=f"α + β·bytes: α = {alpha * 1e6:.0f} µs, "
        + (f"1/β = {1 / beta / 1e9:.2f} GB/s" if beta > 0 else "β = 0"),
    )
    ax.set_ylabel("µs per all-reduce")
    ax.legend(fontsize=8)
    res.semilogx(x, (t / fitted - 1) * 100, "o-")
    res.axhline(0, color="grey", lw=0.8)
    res.set_ylabel("residual (%)")
    res.set_xlabel("bytes each rank sends, 2(N−1)/N × bytes all-reduced")
    fig.tight_layout()
    return fig


def bucket_choice(
    caps_kb: Sequence[float],
    measured_s: Sequence[float],
    predicted: Mapping[str, Sequence[float]],
    *,
    no_comm_s: float | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Measured median step time per bucket size beside each replay's prediction, and the
    measured step without communication (a measured step below it is noise)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(caps_kb, np.asarray(measured_s) * 1e3, "o-", label="measured step (median)")
    for (name, values), marker in zip(predicted.items(), "s^dv", strict=False):
        ax.plot(caps_kb, np.asarray(values) * 1e3, marker + "--", label=name)
    if no_comm_s is not None:
        ax.axhline(no_comm_s * 1e3, color="gray", ls=":", label="step without communication")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (KiB)")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    return ax


def bytes_per_strategy(
    predicted: Mapping[str, float], counted: Mapping[str, float], *, ax: plt.Axes | None = None
) -> plt.Axes:
    """Predicted and counted bytes sent per rank per step, one pair of bars per strategy."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    names = list(counted)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [predicted.get(n, 0) / 2**20 for n in names], 0.4, label="your prediction")
    # The run records the sizes handed to each collective; the ring factors give the bytes.
    ax.bar(x + 0.2, [counted[n] / 2**20 for n in names], 0.4, label="derived from the run")
    ax.set_xticks(x, names)
    ax.set_ylabel("MiB sent per rank per step")
    ax.legend(fontsize=8)
    return ax
