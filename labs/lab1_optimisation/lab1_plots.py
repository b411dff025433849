"""Figures for Lab 1: loss surfaces with optimiser paths, power laws, autograd graphs,
and the two pictures of parallelism that lead into Lab 2."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyBboxPatch, Rectangle
from matplotlib.ticker import NullFormatter


def _log_levels(L: np.ndarray, n: int = 18) -> np.ndarray:
    lo = max(float(np.min(L)), 1e-12)
    hi = float(np.max(L))
    return np.geomspace(lo * 1.05, hi, n) if hi > lo * 1.05 else np.linspace(lo, hi + 1, n)


def loss_contour(
    W: np.ndarray,
    B: np.ndarray,
    L: np.ndarray,
    paths: Mapping[str, np.ndarray] | None = None,
    optimum: Sequence[float] | None = None,
    ax: plt.Axes | None = None,
    title: str = "",
    markers: bool = True,
    linewidth: float = 1.2,
) -> plt.Axes:
    """Contours of the loss over (w, b) (log-spaced levels) with optimiser paths on top.

    Each path is an array of iterates ``(k, 2)``; it is clipped to the plotted window,
    so a diverging path runs off the edge instead of rescaling the picture.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 4.5))
    cs = ax.contour(W, B, L, levels=_log_levels(L), cmap="viridis", linewidths=0.8)
    ax.clabel(cs, cs.levels[::4], fmt="%.2g", fontsize=7)
    for label, path in (paths or {}).items():
        path = np.asarray(path, dtype=np.float64)
        (line,) = ax.plot(
            path[:, 0],
            path[:, 1],
            lw=linewidth,
            label=label,
            marker="." if markers and len(path) <= 200 else None,
            ms=3,
        )
        ax.plot(path[0, 0], path[0, 1], "o", color=line.get_color(), ms=5)
    if optimum is not None:
        ax.plot(optimum[0], optimum[1], "*", color="crimson", ms=12, label="minimum")
    ax.set_xlim(W.min(), W.max())
    ax.set_ylim(B.min(), B.max())
    ax.set_xlabel("weight w")
    ax.set_ylabel("bias b")
    if title:
        ax.set_title(title)
    if paths or optimum is not None:
        ax.legend(fontsize=8, loc="upper right")
    return ax


def loss_surface_3d(
    W: np.ndarray,
    B: np.ndarray,
    L: np.ndarray,
    path: np.ndarray | None = None,
    path_losses: np.ndarray | None = None,
    ax=None,
    title: str = "",
):
    """The loss as a 3-D surface over (w, b), optionally with a path lying on it."""
    if ax is None:
        fig = plt.figure(figsize=(6, 4.5))
        ax = fig.add_subplot(projection="3d")
    ax.plot_surface(W, B, L, cmap="viridis", alpha=0.6, linewidth=0, antialiased=True)
    if path is not None and path_losses is not None:
        ax.plot(
            path[:, 0], path[:, 1], path_losses, "r.-", lw=1.5, ms=4, label="GD path", zorder=10
        )
        ax.legend(fontsize=8)
    ax.set_xlabel("weight w")
    ax.set_ylabel("bias b")
    ax.set_zlabel("MSE loss")
    ax.view_init(elev=35, azim=-60)
    if title:
        ax.set_title(title)
    return ax


def loglog(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    guides: Sequence[float] = (),
    anchor: str = "first",
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Curves on log-log axes with reference lines of the given slopes.

    A guide of slope ``s`` passes through the ``anchor`` (``"first"`` or ``"last"``)
    point of the first series, so a power law ``y ∝ x^s`` shows up as a curve parallel
    to it. Anchor at the end where the power law holds (e.g. ``"last"`` for timings,
    whose small sizes are dominated by fixed overheads).
    """
    if anchor not in ("first", "last"):
        raise ValueError(f"anchor must be 'first' or 'last', got {anchor!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    first = None
    for label, (x, y) in series.items():
        x, y = np.asarray(x, float), np.asarray(y, float)
        ax.plot(x, y, marker="o", ms=4, label=label)
        if first is None and len(x):
            first = (x, y)
    if first is not None:
        x, y = first
        ok = np.isfinite(y) & (y > 0)
        if ok.any():
            k = 0 if anchor == "first" else -1
            x0, y0 = x[ok][k], y[ok][k]
            span = np.geomspace(x[ok].min(), x[ok].max(), 20)
            for s, style in zip(guides, ("--", ":", "-.", (0, (5, 5))), strict=False):
                ax.plot(
                    span,
                    y0 * (span / x0) ** s,
                    color="k",
                    ls=style,
                    lw=0.9,
                    alpha=0.6,
                    label=f"slope {s:g}",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    if first is not None and len(first[0]) <= 12 and np.all(first[0] == np.round(first[0])):
        # A few whole-number x values (batch sizes, widths): label exactly those.
        ax.set_xticks(first[0], [f"{int(v):,}" for v in first[0]])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.25)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def _loss_curves(
    ax: plt.Axes,
    losses: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    fontsize: int = 8,
) -> None:
    """Each run's loss along its updates on a log scale; a diverged value (inf, NaN)
    leaves a gap."""
    for label, loss in losses.items():
        loss = np.asarray(loss, dtype=np.float64)
        ax.plot(np.arange(len(loss)), np.where(np.isfinite(loss), loss, np.nan), label=label)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=fontsize)


def paths_and_losses(
    W: np.ndarray,
    B: np.ndarray,
    L: np.ndarray,
    paths: Mapping[str, np.ndarray],
    losses: Mapping[str, Sequence[float]],
    *,
    optimum: Sequence[float] | None = None,
    xlabel: str = "update",
    title: str = "",
) -> plt.Figure:
    """Paths on the loss contour (left) and the loss of each along its updates (right)."""
    fig, (ax_path, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    loss_contour(W, B, L, paths, optimum=optimum, ax=ax_path)
    _loss_curves(ax_loss, losses, xlabel=xlabel, ylabel="MSE loss (full data, log scale)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _graph_nodes(root, names: Mapping[int, str]):
    """Walk autograd's ``grad_fn`` graph from ``root``: labels, depth and edges."""
    labels, depth, edges = {}, {}, []
    stack = [(root, 0)]
    while stack:
        fn, d = stack.pop()
        key = id(fn)
        if key in depth and depth[key] >= d:
            continue
        depth[key] = d
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf that requires grad
            var = fn.variable
            shape = "×".join(map(str, var.shape)) or "scalar"
            labels[key] = f"{names.get(id(var), 'param')} ({shape})\nAccumulateGrad"
        else:
            labels[key] = type(fn).__name__.replace("Backward0", "").replace("Backward1", "")
        for child, _ in fn.next_functions:
            if child is not None:
                if (id(child), key) not in edges:
                    edges.append((id(child), key))
                stack.append((child, d + 1))
    return labels, depth, edges


def autograd_graph(
    tensor, names: Mapping[str, object] | None = None, ax: plt.Axes | None = None, title: str = ""
) -> plt.Axes:
    """Draw the computational graph autograd recorded for ``tensor``.

    Leaves (parameters) sit on the left, the output on the right; each box is one
    operation whose backward function autograd will call. ``names`` maps a label to a
    parameter tensor so leaves show readable names.
    """
    if tensor.grad_fn is None:
        raise ValueError("this tensor has no graph: build it from tensors with requires_grad=True")
    by_id = {id(t): label for label, t in (names or {}).items()}
    labels, depth, edges = _graph_nodes(tensor.grad_fn, by_id)
    max_depth = max(depth.values())
    columns: dict[int, list[int]] = {}
    for key, d in sorted(depth.items(), key=lambda kv: kv[1]):
        columns.setdefault(max_depth - d, []).append(key)
    pos = {}
    for col, keys in columns.items():
        for i, key in enumerate(keys):
            pos[key] = (col, (len(keys) - 1) / 2 - i)
    if ax is None:
        height = max(len(k) for k in columns.values())
        _, ax = plt.subplots(figsize=(1.9 * (max_depth + 1) + 1, 1.2 * height + 1.2))
    half_width = 0.4
    for src, dst in edges:
        (xs, ys), (xd, yd) = pos[src], pos[dst]
        ax.annotate(
            "",
            xy=(xd - half_width, yd),
            xytext=(xs + half_width, ys),
            arrowprops=dict(arrowstyle="-|>", color="0.4", shrinkA=0, shrinkB=0),
        )
    root = id(tensor.grad_fn)
    for key, (x, y) in pos.items():
        leaf = labels[key].endswith("AccumulateGrad")
        text = labels[key] + ("\n(output)" if key == root else "")
        ax.add_patch(
            FancyBboxPatch(
                (x - half_width, y - 0.22),
                2 * half_width,
                0.44,
                boxstyle="round,pad=0.02",
                fc="#cde4f7" if leaf else "#f7e3c4",
                ec="0.3",
            )
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.6, max_depth + 0.6)
    ys = [p[1] for p in pos.values()]
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax.axis("off")
    ax.set_title(title or "forward: left to right · backward: right to left", fontsize=9)
    return ax


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="0.3"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


_WORKER_COLORS = ["#cde4f7", "#d7f0d2", "#f7e3c4", "#eedcf5"]


def parallelism_diagrams(workers: int = 3) -> plt.Figure:
    """Data parallelism (a replica per worker, gradients all-reduced) beside model
    parallelism (the layers split across workers, activations passed along)."""
    fig, (ax_d, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    _data_parallel_diagram(ax_d, workers)
    _model_parallel_diagram(ax_m, workers)
    for ax in (ax_d, ax_m):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 4.3)
        ax.axis("off")
    fig.tight_layout()
    return fig


def _data_parallel_diagram(ax: plt.Axes, workers: int) -> None:
    """The global batch is split; every worker holds the whole model."""
    banner = f"global batch of N·b samples, split into {workers} shards"
    _box(ax, 0.2, 3.55, 9.6, 0.6, banner, "0.92", 9)
    for k in range(workers):
        x = 0.4 + k * 3.2
        arrow = dict(arrowstyle="-|>", color="0.4")
        ax.annotate("", xy=(x + 1.3, 2.85), xytext=(x + 1.3, 3.5), arrowprops=arrow)
        ax.add_patch(Rectangle((x - 0.1, 0.95), 2.8, 1.95, fc="none", ec="0.5", ls=":"))
        ax.text(x + 1.3, 2.75, f"worker {k}", ha="center", va="top", fontsize=8)
        for j in range(3):
            _box(ax, x + 0.2, 2.15 - j * 0.38, 2.2, 0.3, f"layer {j + 1}", _WORKER_COLORS[j % 4], 7)
        shard = f"shard {k}: b samples\n→ gradient g{k}"
        ax.text(x + 1.3, 1.05, shard, ha="center", va="bottom", fontsize=7)
    total = " + ".join(f"g{k}" for k in range(workers))
    reduce = f"all-reduce: every worker gets ({total}) / {workers}, then takes the same step"
    _box(ax, 0.2, 0.1, 9.6, 0.6, reduce, "#fde2e2", 9)
    for k in range(workers):
        x = 0.4 + k * 3.2 + 1.3
        arrow = dict(arrowstyle="<|-|>", color="crimson")
        ax.annotate("", xy=(x, 0.72), xytext=(x, 0.98), arrowprops=arrow)
    ax.set_title("Data parallelism: copy the model, split the batch (Lab 2)")


def _model_parallel_diagram(ax: plt.Axes, workers: int) -> None:
    """One batch flows through layers that live on different workers."""
    for k in range(workers):
        x = 0.3 + k * 3.3
        ax.add_patch(Rectangle((x - 0.1, 0.9), 2.9, 2.4, fc="none", ec="0.5", ls=":"))
        ax.text(x + 1.35, 3.2, f"worker {k}", ha="center", va="top", fontsize=8)
        layers = f"layers {2 * k + 1}–{2 * k + 2}"
        _box(ax, x + 0.25, 1.6, 2.2, 0.9, layers, _WORKER_COLORS[k % 4], 8)
        if k < workers - 1:
            forward = dict(arrowstyle="-|>", color="0.2")
            backward = dict(arrowstyle="-|>", color="crimson")
            ax.annotate("", xy=(x + 3.45, 2.2), xytext=(x + 2.5, 2.2), arrowprops=forward)
            ax.annotate("", xy=(x + 2.5, 1.85), xytext=(x + 3.45, 1.85), arrowprops=backward)
    ax.text(5.0, 2.75, "activations →", ha="center", fontsize=8)
    ax.text(5.0, 1.2, "← gradients of activations", ha="center", fontsize=8, color="crimson")
    _box(ax, 0.2, 3.55, 9.6, 0.6, "one batch of b samples", "0.92", 9)
    own = "each worker stores and updates only its own layers"
    _box(ax, 0.2, 0.1, 9.6, 0.6, own, "#fde2e2", 9)
    ax.set_title("Model parallelism: split the model, pass activations")


def optimiser_race(
    W: np.ndarray,
    B: np.ndarray,
    L: np.ndarray,
    runs: Mapping[str, Mapping[str, object]],
    optimum: Sequence[float] | None = None,
) -> plt.Figure:
    """Paths of several optimisers on the contour, and their loss per update, per epoch
    and per second.

    ``runs`` maps a label to ``{"path", "losses", "updates_per_epoch", "seconds"}``; the
    time axis spreads each run's measured wall-clock time evenly over its updates.
    """
    # a 2 × 2 grid: four panels in a row are unreadable at a notebook's normal width
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax_path, ax_upd, ax_epoch, ax_sec = axes.flat
    loss_contour(
        W,
        B,
        L,
        {k: np.asarray(r["path"]) for k, r in runs.items()},
        optimum=optimum,
        ax=ax_path,
        markers=False,
    )
    for label, run in runs.items():
        losses = np.asarray(run["losses"], dtype=np.float64)
        updates = np.arange(len(losses))
        ax_upd.plot(updates, losses, label=label)
        ax_epoch.plot(updates / float(run["updates_per_epoch"]), losses, label=label)
        seconds = np.linspace(0.0, float(run["seconds"]), len(losses))
        ax_sec.plot(seconds[1:], losses[1:], label=label)  # log axis: from the first update
    ax_upd.set_xscale("symlog", linthresh=1)
    ax_sec.set_xscale("log")
    for ax, xlabel in (
        (ax_upd, "updates (log scale)"),
        (ax_epoch, "epochs (passes over the data)"),
        (ax_sec, "seconds (log scale)"),
    ):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MSE loss (full data)")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=8)
    ax_path.set_title("paths")
    ax_upd.set_title("loss per update")
    ax_epoch.set_title("loss per epoch")
    ax_sec.set_title("loss per second")
    fig.tight_layout()
    return fig


def gradient_clouds(
    samples: Mapping[str, np.ndarray], full: Sequence[float], ax: plt.Axes | None = None
) -> plt.Axes:
    """Mini-batch gradients (one dot each) around the full-batch gradient (a cross)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4.5))
    for label, g in samples.items():
        g = np.asarray(g, dtype=np.float64)
        ax.scatter(g[:, 0], g[:, 1], s=6, alpha=0.4, label=label)
    ax.plot(full[0], full[1], "k+", ms=16, mew=2, label="full-batch gradient")
    ax.set_xlabel("∂L/∂w")
    ax.set_ylabel("∂L/∂b")
    ax.set_title("mini-batch gradients scatter around the full one")
    legend = ax.legend(fontsize=8)
    for handle in legend.legend_handles[: len(samples)]:
        handle.set_sizes([30])
    return ax


def learning_rate_gallery(
    W: np.ndarray,
    B: np.ndarray,
    L: np.ndarray,
    paths: Mapping[str, np.ndarray],
    losses: Mapping[str, Sequence[float]],
    *,
    optimum: Sequence[float] | None = None,
    shown: int = 30,
    xlabel: str = "gradient descent step",
) -> plt.Figure:
    """One contour panel per learning rate (its first ``shown`` steps), and all their
    loss curves together below, on a log scale."""
    fig = plt.figure(figsize=(4 * len(paths), 7.5))
    grid = fig.add_gridspec(2, len(paths), height_ratios=(1.1, 1))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, path) in enumerate(paths.items()):
        ax = fig.add_subplot(grid[0, k])
        ax.contour(W, B, L, levels=_log_levels(L), cmap="viridis", linewidths=0.6)
        path = np.asarray(path, dtype=np.float64)[: shown + 1]
        ax.plot(path[:, 0], path[:, 1], ".-", color=colors[k % len(colors)], lw=1, ms=4)
        ax.plot(path[0, 0], path[0, 1], "o", color=colors[k % len(colors)])
        if optimum is not None:
            ax.plot(optimum[0], optimum[1], "*", color="crimson", ms=11)
        ax.set_xlim(W.min(), W.max())
        ax.set_ylim(B.min(), B.max())
        ax.set_xlabel("weight w")
        ax.set_ylabel("bias b")
        ax.set_title(label, fontsize=10)
    # a fresh axes starts the same colour cycle: each curve has its panel's colour
    _loss_curves(
        fig.add_subplot(grid[1, :]),
        losses,
        xlabel=xlabel,
        ylabel="MSE loss (log scale)",
        fontsize=9,
    )
    fig.suptitle(f"paths: the first {shown} steps of each learning rate")
    fig.tight_layout()
    return fig


def batch_axis(ax: plt.Axes, batches: Sequence[int], label: str = "batch size B") -> plt.Axes:
    """A log₂ x axis labelled with the batch sizes themselves (8, 16, ... not 2³, 2⁴)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batches), [f"{int(b):,}" for b in batches])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)
    return ax
