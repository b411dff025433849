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

import numpy as np
import torch
from torch import nn

from . import memory
from .checks import spread


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


# ------------------------------------------------------------------ replay of a schedule
# The bubble a schedule must have, given this run's own costs: each block (F or B of a
# micro-batch on a stage) starts when the block before it on its stage has ended and the
# block it waits for on the neighbouring stage (its activations, or its gradient) has
# ended, plus the overhead this run measured for that kind of block on that stage
# (messages, the loss, Python); it then lasts as long as it was measured to last.

def schedule_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The blocks ``(kind, micro-batch)`` that ``rank`` runs, in the order of
    ``torch.distributed.pipelining``'s ``ScheduleGPipe`` or ``Schedule1F1B``."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: 'gpipe' or '1f1b'")
    warmup = min(m, p - rank)  # stage s keeps p − s micro-batches in flight
    order = [("F", i) for i in range(warmup)]
    for b in range(m):  # steady state: one backward, then the next forward
        order.append(("B", b))
        if warmup + b < m:
            order.append(("F", warmup + b))
    return order


def measured_order(events: Sequence[Event | dict]) -> dict[int, list[tuple[str, int]]]:
    """Per rank, the blocks in the order they started."""
    out: dict[int, list[tuple[str, int]]] = {}
    for e in sorted(_events(events), key=lambda e: (e.rank, e.start)):
        out.setdefault(e.rank, []).append((e.kind, e.mb))
    return out


def _waits_for(kind: str, mb: int, rank: int, p: int) -> tuple[int, str, int] | None:
    """The block on another stage whose result this one needs (None on the ends)."""
    if kind == "F":
        return (rank - 1, "F", mb) if rank > 0 else None
    return (rank + 1, "B", mb) if rank < p - 1 else None


def leads(events: Sequence[Event | dict]) -> dict[tuple[int, str], list[float]]:
    """Per (rank, kind): for each block, the time from the moment it could start (the
    previous block on its stage and the block it waits for have ended) to its start —
    sending, receiving, the loss and Python between blocks, in this run."""
    ev = _events(events)
    p = len({e.rank for e in ev})
    by_key = {(e.rank, e.kind, e.mb): e for e in ev}
    out: dict[tuple[int, str], list[float]] = {}
    for rank, order in measured_order(ev).items():
        prev_end = None
        for kind, mb in order:
            e = by_key[(rank, kind, mb)]
            dep = by_key.get(_waits_for(kind, mb, rank, p) or (-1, "", -1))
            ready = max([t for t in (prev_end, dep.end if dep else None) if t is not None],
                        default=None)
            if ready is not None:
                out.setdefault((rank, kind), []).append(max(e.start - ready, 0.0))
            prev_end = e.end
    return out


@dataclass
class Replay:
    """A schedule replayed with one run's measured costs: the predicted ``events``, the
    ``bubble`` they give, and the blocks on the path that sets the step's length."""

    events: list[Event]
    bubble: float
    critical: list[tuple[int, str, int]]


def replay(events: Sequence[Event | dict], schedule: str) -> Replay:
    """Replay ``schedule`` from the measured durations of each block and the median
    measured overhead per (stage, kind) (:func:`leads`), starting when the measured step
    started. A measured timeline whose stages idle only because of the schedule and
    these costs has (up to the run's spread) the replay's bubble."""
    ev = _events(events)
    p = len({e.rank for e in ev})
    m = sum(1 for e in ev if e.rank == ev[0].rank and e.kind == "F")
    measured = {(e.rank, e.kind, e.mb): e for e in ev}
    lead = {key: float(np.median(v)) for key, v in leads(ev).items()}
    orders = {r: schedule_order(schedule, p, m, r) for r in range(p)}
    t0 = span(ev)[0]
    placed: dict[tuple[int, str, int], Event] = {}
    after: dict[tuple[int, str, int], tuple[int, str, int] | None] = {}
    nxt = dict.fromkeys(range(p), 0)
    while len(placed) < len(measured):
        progressed = False
        for r in range(p):
            if nxt[r] == len(orders[r]):
                continue
            kind, mb = orders[r][nxt[r]]
            dep = _waits_for(kind, mb, r, p)
            if dep is not None and dep not in placed:
                continue
            prev = (r, *orders[r][nxt[r] - 1]) if nxt[r] else None
            bound = max((k for k in (prev, dep) if k is not None),
                        key=lambda k: placed[k].end, default=None)
            start = placed[bound].end + lead.get((r, kind), 0.0) if bound else t0
            key = (r, kind, mb)
            placed[key] = Event(r, kind, mb, start, start + measured[key].end - measured[key].start)
            after[key] = bound
            nxt[r] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"{schedule} cannot order these blocks (a block waits for one "
                             "that never runs): the timeline is not this schedule's")
    path, key = [], max(placed, key=lambda k: placed[k].end)
    while key is not None:
        path.append(key)
        key = after[key]
    return Replay(list(placed.values()), bubble_fraction(list(placed.values())), path[::-1])


def replay_noise(events: Sequence[Event | dict], result: Replay) -> float:
    """The run's own spread of the replayed bubble: the spread (:func:`lab_utils.checks.spread`)
    of the measured overheads of each stage and kind, summed along the critical path (a
    busy core delays neighbouring blocks together, so their deviations add up rather than
    cancel), converted from seconds of span to a share of the step."""
    sigma = {key: spread(v) for key, v in leads(events).items()}
    span_noise = sum(sigma.get((r, k), 0.0) for r, k, _ in result.critical)
    t0, t1 = span(events)
    per_rank = busy(events)
    mean_busy = sum(per_rank.values()) / len(per_rank)
    # bubble = 1 − mean_busy / span, so a change δ of the span moves it by mean_busy·δ / span²
    return mean_busy / max(t1 - t0, 1e-12) ** 2 * span_noise
