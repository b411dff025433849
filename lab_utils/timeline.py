"""Per-rank timelines of forward (F) and backward (B) work, from real timestamps.

Wrap a pipeline stage's layers in :class:`TimedStage`; it records when each
micro-batch's forward and backward start and end on this rank (the backward ends
are caught by identity autograd functions placed at the stage's input and output),
and how many bytes of activations autograd saved for it. From the events of all
ranks: :func:`bubble_fraction` (idle share of the step), :func:`in_flight`
(micro-batches forwarded but not yet backwarded).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import memory


@dataclass
class Event:
    """One span of work: ``kind`` is ``"F"`` or ``"B"``, ``mb`` the micro-batch."""

    rank: int
    kind: str
    mb: int
    start: float
    end: float
    saved_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback`` (to timestamp the backward pass)."""

    @staticmethod
    def forward(ctx, x, anchor, callback):  # noqa: ANN001
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        ctx.callback()
        return grad, None, None


class TimedStage(nn.Module):
    """Runs ``layers`` in order and records an :class:`Event` per forward and backward.

    Micro-batches are numbered in the order their forward (and their backward) runs,
    which is ascending in GPipe and 1F1B alike. Call :meth:`reset` before each step.
    """

    def __init__(self, layers: Sequence[nn.Module], rank: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.rank = rank
        # A leaf that requires grad, so the marks' backward runs even when the
        # stage's input does not (stage 0 takes integer ids).
        self._anchor = torch.zeros((), requires_grad=True)
        self._cuda = False
        self.reset()

    def reset(self) -> None:
        self.events: list[Event] = []
        self._fwd = 0
        self._bwd_start: dict[int, float] = {}

    def _now(self) -> float:
        # GPU kernels run asynchronously: wait for them, or the clock shows launch times.
        if self._cuda:
            torch.cuda.synchronize()
        return time.time()

    def _backward_started(self, mb: int) -> None:
        self._bwd_start[mb] = self._now()

    def _backward_ended(self, mb: int, saved: int) -> None:
        end = self._now()
        self.events.append(Event(self.rank, "B", mb, self._bwd_start.pop(mb, end), end, -saved))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._cuda = x.is_cuda
        mb, start = self._fwd, self._now()
        self._fwd += 1
        counter = memory.SavedTensorCounter(self.layers.parameters())
        marked = False
        with counter.hooks():
            for layer in self.layers:
                if not marked and x.is_floating_point():
                    x = _Mark.apply(x, self._anchor, lambda: self._backward_ended(mb, counter.bytes))
                    marked = True
                x = layer(x)
        if not marked:
            x = _Mark.apply(x, self._anchor, lambda: self._backward_ended(mb, counter.bytes))
        x = _Mark.apply(x, self._anchor, lambda: self._backward_started(mb))
        self.events.append(Event(self.rank, "F", mb, start, self._now(), counter.bytes))
        return x


def _events(events: Sequence[Event | dict]) -> list[Event]:
    return [e if isinstance(e, Event) else Event(**e) for e in events]


def span(events: Sequence[Event | dict]) -> tuple[float, float]:
    """First start and last end over all ranks."""
    ev = _events(events)
    if not ev:
        raise ValueError("no events")
    return min(e.start for e in ev), max(e.end for e in ev)


def busy(events: Sequence[Event | dict]) -> dict[int, float]:
    """Seconds of F and B work per rank."""
    out: dict[int, float] = {}
    for e in _events(events):
        out[e.rank] = out.get(e.rank, 0.0) + (e.end - e.start)
    return out


def bubble_fraction(events: Sequence[Event | dict]) -> float:
    """Share of the step's span that the ranks spend idle, averaged over ranks:
    ``1 − mean_r(busy_r) / span``. For p equal stages and m micro-batches GPipe's
    ideal is ``(p − 1) / (m + p − 1)``."""
    t0, t1 = span(events)
    b = busy(events)
    return 1.0 - sum(b.values()) / len(b) / max(t1 - t0, 1e-12)


def ideal_bubble(p: int, m: int) -> float:
    """The bubble of a synchronous pipeline with equal stages: ``(p−1)/(m+p−1)``."""
    return (p - 1) / (m + p - 1)


def in_flight(events: Sequence[Event | dict]) -> dict[int, tuple[int, int]]:
    """Per rank: (most micro-batches held at once, most activation bytes held at once)
    — a micro-batch is held from the end of its forward to the end of its backward."""
    out: dict[int, tuple[int, int]] = {}
    by_rank: dict[int, list[Event]] = {}
    for e in _events(events):
        by_rank.setdefault(e.rank, []).append(e)
    for rank, ev in by_rank.items():
        fwd_bytes = {e.mb: e.saved_bytes for e in ev if e.kind == "F"}
        changes = sorted([(e.end, 1, fwd_bytes[e.mb]) for e in ev if e.kind == "F"]
                         + [(e.end, -1, -fwd_bytes.get(e.mb, 0)) for e in ev if e.kind == "B"])
        n = b = peak_n = peak_b = 0
        for _, dn, db in changes:
            n, b = n + dn, b + db
            peak_n, peak_b = max(peak_n, n), max(peak_b, b)
        out[rank] = (peak_n, peak_b)
    return out
