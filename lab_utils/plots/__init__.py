"""Figures used by the notebooks: common helpers here, one module per lab beside it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import matplotlib.pyplot as plt


def curves(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Draw several labelled (x, y) curves on one axes, with labelled axes and a legend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for label, (x, y) in series.items():
        ax.plot(list(x), list(y), marker="o" if len(list(x)) < 20 else None, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()
    return ax


def history(epochs: Iterable[Mapping[str, float]], *, title: str = "") -> plt.Figure:
    """Loss and accuracy per epoch from a :class:`lab_utils.train.History`'s ``epochs``."""
    rows = list(epochs)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    x = [r["epoch"] for r in rows]
    for key, ax in (("loss", ax_loss), ("acc", ax_acc)):
        for split in ("train", "val"):
            ys = [r.get(f"{split}_{key}") for r in rows]
            if any(v is not None for v in ys):
                ax.plot(x, ys, marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel("accuracy" if key == "acc" else "loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
