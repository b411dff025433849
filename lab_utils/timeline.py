"""Per-rank timelines of forward (F) and backward (B) work, from real timestamps.

Wrap a pipeline stage's layers in :class:`TimedStage`; it records when each
micro-batch's forward and backward start and end on this rank (the backward ends
are caught by identity autograd functions placed at the stage's input and output),
and how many bytes of activations autograd saved for it. :class:`StageTimer` does the
same for schedules with several stages per rank (interleaved, zero bubble): it times
the blocks ``PipelineStage`` runs, F, B (the backward for the inputs, or the whole
backward) and W (the backward for the weights), each tagged with its stage. From the
events of all ranks: :func:`bubble_fraction` (idle share of the step),
:func:`in_flight` (micro-batches forwarded but not yet through their last backward).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from . import memory
from .checks import spread


@dataclass
class Event:
    """One span of work: ``kind`` is ``"F"``, ``"B"`` or ``"W"``, ``mb`` the micro-batch,
    ``stage`` the pipeline stage (−1: the rank's only stage, numbered like the rank)."""

    rank: int
    kind: str
    mb: int
    start: float
    end: float
    saved_bytes: int = 0
    stage: int = -1

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def at(self) -> int:
        """The stage this block ran on."""
        return self.rank if self.stage < 0 else self.stage

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.at, self.kind, self.mb)


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback`` (to timestamp the backward pass)."""

    @staticmethod
    def forward(ctx, x, anchor, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
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
                    x = _Mark.apply(
                        x, self._anchor, lambda: self._backward_ended(mb, counter.bytes)
                    )
                    marked = True
                x = layer(x)
        if not marked:
            x = _Mark.apply(x, self._anchor, lambda: self._backward_ended(mb, counter.bytes))
        x = _Mark.apply(x, self._anchor, lambda: self._backward_started(mb))
        self.events.append(Event(self.rank, "F", mb, start, self._now(), counter.bytes))
        return x


class StageTimer:
    """Times the blocks that ``torch.distributed.pipelining`` runs on this rank's stages.

    Wraps each ``PipelineStage``'s ``forward_one_chunk`` (F; the bytes autograd saves in
    it are counted), ``backward_one_chunk`` (B: the backward for the stage's inputs in a
    zero-bubble schedule, the whole backward otherwise) and ``backward_weight_one_chunk``
    (W: the backward for the weights). Receiving a block's input happens before the
    call, sending its output after it, so a block is the stage's own work. Call
    :meth:`reset` before each step."""

    def __init__(self, stages: Sequence, rank: int) -> None:
        self.rank = rank
        self.reset()
        for stage in stages:
            self._wrap(stage)

    def reset(self) -> None:
        self.events: list[Event] = []

    def _now(self, device: torch.device) -> float:
        if device.type == "cuda":  # kernels run asynchronously: wait for them
            torch.cuda.synchronize(device)
        return time.time()

    def _record(self, stage, kind: str, mb: int, call, saved: int | None = None):
        start = self._now(stage.device)
        if saved is None:
            out = call()
            nbytes = 0
        else:
            counter = memory.SavedTensorCounter(stage.submod.parameters())
            with counter.hooks():
                out = call()
            nbytes = counter.bytes
        self.events.append(
            Event(self.rank, kind, mb, start, self._now(stage.device), nbytes, stage.stage_index)
        )
        return out

    def _wrap(self, stage) -> None:
        forward, backward, weight = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.backward_weight_one_chunk,
        )

        def timed_forward(mb, *args, **kwargs):
            return self._record(stage, "F", mb, lambda: forward(mb, *args, **kwargs), saved=0)

        def timed_backward(mb, *args, **kwargs):
            return self._record(stage, "B", mb, lambda: backward(mb, *args, **kwargs))

        def timed_weight(mb, *args, **kwargs):
            return self._record(stage, "W", mb, lambda: weight(mb, *args, **kwargs))

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = timed_backward
        stage.backward_weight_one_chunk = timed_weight


def schedule_actions(schedule) -> dict[int, list[tuple[int, str, int]]]:
    """Per rank, the compute blocks ``(stage, kind, micro-batch)`` of a
    ``torch.distributed.pipelining`` schedule, in the order it runs them: F; B for a
    whole backward or the backward for the inputs; W for the backward for the weights.
    Blocks that the schedule overlaps (DualPipeV's F and B pairs) run one after the other
    on a CPU, so they are listed in that order. GPipe and 1F1B (one stage per rank) run
    :func:`schedule_order`: torch's ``pipeline_order`` table of them is only a picture,
    and in 2.13 its 1F1B starts the last stage at micro-batch 1."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    single = {ScheduleGPipe: "gpipe", Schedule1F1B: "1f1b"}.get(type(schedule))
    if single:
        p, m = schedule._stage.num_stages, schedule._n_microbatches
        return {r: [(r, k, i) for k, i in schedule_order(single, p, m, r)] for r in range(p)}
    plan = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    out: dict[int, list[tuple[int, str, int]]] = {}
    for rank, actions in plan.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            flat.extend(a.sub_actions if a.sub_actions else [a])
        out[rank] = [
            (a.stage_index, kinds[a.computation_type.value], a.microbatch_index)
            for a in flat
            if a.computation_type.value in kinds
        ]
    return out


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
    — a micro-batch is held on a stage from the end of its forward to the end of its
    last backward block there (B, or W when the weights' backward is split off: it
    still needs the saved activations). With several stages per rank, each stage's
    micro-batches count."""
    out: dict[int, tuple[int, int]] = {}
    by_rank: dict[int, list[Event]] = {}
    for e in _events(events):
        by_rank.setdefault(e.rank, []).append(e)
    for rank, ev in by_rank.items():
        fwd_bytes = {(e.at, e.mb): e.saved_bytes for e in ev if e.kind == "F"}
        released: dict[tuple[int, int], float] = {}
        for e in ev:
            if e.kind != "F":
                released[(e.at, e.mb)] = max(released.get((e.at, e.mb), e.end), e.end)
        changes = sorted(
            [(e.end, 1, fwd_bytes[(e.at, e.mb)]) for e in ev if e.kind == "F"]
            + [(t, -1, -fwd_bytes.get(k, 0)) for k, t in released.items()]
        )
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


def measured_actions(events: Sequence[Event | dict]) -> dict[int, list[tuple[int, str, int]]]:
    """Per rank, the blocks ``(stage, kind, micro-batch)`` in the order they started."""
    out: dict[int, list[tuple[int, str, int]]] = {}
    for e in sorted(_events(events), key=lambda e: (e.rank, e.start)):
        out.setdefault(e.rank, []).append(e.key)
    return out


def _waits_for(kind: str, mb: int, stage: int, n_stages: int) -> tuple[int, str, int] | None:
    """The block whose result this one needs: the previous stage's forward; the next
    stage's backward (on the last stage, this micro-batch's forward and loss); for W, the
    B of the same stage and micro-batch. None for the first stage's forward."""
    if kind == "F":
        return (stage - 1, "F", mb) if stage > 0 else None
    if kind == "W":
        return (stage, "B", mb)
    return (stage + 1, "B", mb) if stage < n_stages - 1 else (stage, "F", mb)


def _n_stages(ev: Sequence[Event]) -> int:
    return max(e.at for e in ev) + 1


def leads(events: Sequence[Event | dict]) -> dict[tuple[int, str], list[float]]:
    """Per (stage, kind): for each block, the time from the moment it could start (the
    previous block on its rank and the block it waits for have ended) to its start —
    sending, receiving, the loss and Python between blocks, in this run."""
    ev = _events(events)
    n = _n_stages(ev)
    by_key = {e.key: e for e in ev}
    out: dict[tuple[int, str], list[float]] = {}
    for order in measured_actions(ev).values():
        prev_end = None
        for key in order:
            e = by_key[key]
            dep = by_key.get(_waits_for(e.kind, e.mb, e.at, n) or (-1, "", -1))
            ready = max(
                [t for t in (prev_end, dep.end if dep else None) if t is not None], default=None
            )
            if ready is not None:
                out.setdefault((e.at, e.kind), []).append(max(e.start - ready, 0.0))
            prev_end = e.end
    return out


@dataclass
class Replay:
    """A schedule replayed with one run's measured costs: the predicted ``events``, the
    ``bubble`` they give, and the blocks on the path that sets the step's length."""

    events: list[Event]
    bubble: float
    critical: list[tuple[int, str, int]]


Block = tuple[int, str, int]  # (stage, kind, micro-batch)


def replay(events: Sequence[Event | dict], schedule: str | Mapping[int, Sequence]) -> Replay:
    """Replay ``schedule`` from the measured durations of each block and the median
    measured overhead per (stage, kind) (:func:`leads`), starting when the measured step
    started. ``schedule`` is ``"gpipe"`` or ``"1f1b"`` (one stage per rank), or per rank
    the blocks ``(stage, kind, micro-batch)`` in the schedule's order
    (:func:`schedule_actions`). A measured timeline whose stages idle only because of
    the schedule and these costs has (up to the run's spread) the replay's bubble."""
    ev = _events(events)
    orders = _replay_orders(ev, schedule)
    measured = {e.key: e for e in ev}
    blocks = sum(len(o) for o in orders.values())
    if blocks != len(measured):
        raise ValueError(
            f"the schedule has {blocks} blocks, the "
            f"timeline {len(measured)}: the timeline is not this schedule's"
        )
    placed, after = _place_blocks(ev, orders, measured, schedule)
    return Replay(
        list(placed.values()), bubble_fraction(list(placed.values())), _critical(placed, after)
    )


def _replay_orders(ev: list[Event], schedule: str | Mapping[int, Sequence]) -> dict[int, list]:
    """Per rank, the blocks in the order the schedule runs them."""
    if not isinstance(schedule, str):
        return {int(r): [tuple(a) for a in acts] for r, acts in schedule.items()}
    p = len({e.rank for e in ev})
    m = sum(1 for e in ev if e.rank == ev[0].rank and e.kind == "F")
    return {r: [(r, k, i) for k, i in schedule_order(schedule, p, m, r)] for r in range(p)}


def _place_blocks(
    ev: list[Event],
    orders: dict[int, list],
    measured: dict[Block, Event],
    schedule: object,
) -> tuple[dict[Block, Event], dict[Block, Block | None]]:
    """Each block starts when the later of its rank's previous block and the block it
    waits for ends, plus the measured overhead; ``after`` says which of the two it was."""
    n, p, t0 = _n_stages(ev), len(orders), span(ev)[0]
    lead = {key: float(np.median(v)) for key, v in leads(ev).items()}
    placed: dict[Block, Event] = {}
    after: dict[Block, Block | None] = {}
    nxt = dict.fromkeys(orders, 0)
    while len(placed) < len(measured):
        progressed = False
        for r in orders:
            if nxt[r] == len(orders[r]):
                continue
            stage, kind, mb = key = orders[r][nxt[r]]
            dep = _waits_for(kind, mb, stage, n)
            if dep is not None and dep not in placed:
                continue
            prev = orders[r][nxt[r] - 1] if nxt[r] else None
            bound = max(
                (k for k in (prev, dep) if k is not None), key=lambda k: placed[k].end, default=None
            )
            start = placed[bound].end + lead.get((stage, kind), 0.0) if bound else t0
            length = measured[key].end - measured[key].start
            shown_stage = stage if stage != r or n != p else -1
            placed[key] = Event(r, kind, mb, start, start + length, stage=shown_stage)
            after[key] = bound
            nxt[r] += 1
            progressed = True
        if not progressed:
            raise ValueError(
                f"{schedule} cannot order these blocks (a block waits for one "
                "that never runs): the timeline is not this schedule's"
            )
    return placed, after


def _critical(placed: dict[Block, Event], after: dict[Block, Block | None]) -> list[Block]:
    """The chain of blocks, each waiting on the one before, that ends last."""
    path, key = [], max(placed, key=lambda k: placed[k].end)
    while key is not None:
        path.append(key)
        key = after[key]
    return path[::-1]


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


# ------------------------------------------------------------------ a plan on its own
# torch's plan of a schedule is a list of blocks per rank; with a cost for each kind of
# block and free messages it has a bubble of its own, computed here from the list alone.


class _PlanStage:
    """The attributes a ``torch.distributed.pipelining`` schedule reads from its stages
    while it builds its plan (no module, no process group)."""

    def __init__(self, stage: int, n_stages: int, p: int, rank: int) -> None:
        self.stage_index, self.num_stages = stage, n_stages
        self.group_size, self.group_rank = p, rank
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.submod = nn.Identity()


def plan(
    schedule_cls: type, p: int, m: int, stages_per_rank: int = 1, v_shape: bool = False
) -> dict[int, list[Block]]:
    """torch's own plan of ``schedule_cls`` for p ranks and m micro-batches
    (:func:`schedule_actions`), built in this process without a process group: every
    rank's plan is computed on every rank, so rank 0's stages suffice. Stages r, r+p, …
    on rank r, or r and 2p−1−r when ``v_shape``."""
    v = 2 if v_shape else stages_per_rank
    ids = [0, 2 * p - 1] if v_shape else [i * p for i in range(v)]
    stages = [_PlanStage(s, p * v, p, 0) for s in ids]
    schedule = schedule_cls(stages[0] if v == 1 and not v_shape else stages, m, loss_fn=None)
    return schedule_actions(schedule)


def ideal_replay(order: Mapping[int, Sequence], cost: Mapping[str, float] | None = None) -> Replay:
    """The plan ``order`` (per rank, blocks ``(stage, kind, micro-batch)``) replayed with
    a fixed duration per kind of block and free messages: ``cost`` F, B, W (default 1
    each). A B with no W of its own (same stage and micro-batch) is a whole backward, as
    in 1F1B and some of DualPipeV's: it lasts ``cost["B"] + cost["W"]``."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
    ws = {(s, i) for acts in order.values() for s, k, i in acts if k == "W"}
    ev = [
        Event(
            int(r),
            k,
            i,
            0.0,
            cost[k] + (cost["W"] if k == "B" and (s, i) not in ws else 0.0),
            stage=s,
        )
        for r, acts in order.items()
        for s, k, i in acts
    ]
    return replay(ev, {int(r): acts for r, acts in order.items()})


def plan_ratio(order: Mapping[int, Sequence], cost: Mapping[str, float] | None = None) -> float:
    """Idle time over compute time of the plan ``order`` with fixed block costs
    (:func:`ideal_replay`), on a step that starts and ends together on every rank — as a
    training step does when anything synchronises the ranks at its end (a barrier, a
    gradient-norm all-reduce)."""
    b = ideal_replay(order, cost).bubble
    return b / (1 - b)


def stage_ratio(order: Mapping[int, Sequence], cost: Mapping[str, float] | None = None) -> float:
    """The same plan measured the way Qi et al. (Zero Bubble Pipeline Parallelism) measure
    a schedule: idle over compute within the longest span of any one rank, each rank from
    its own first block to its own last. A later rank's late start is not counted: with
    nothing synchronising the ranks between steps (the paper's optimizer post-validation),
    it overlaps the end of the previous step."""
    ev = ideal_replay(order, cost).events
    by_rank: dict[int, list[Event]] = {}
    for e in ev:
        by_rank.setdefault(e.rank, []).append(e)
    longest = max(max(e.end for e in v) - min(e.start for e in v) for v in by_rank.values())
    work = max(sum(e.end - e.start for e in v) for v in by_rank.values())
    return (longest - work) / work


def peak_held(order: Mapping[int, Sequence], stages_per_rank: int) -> dict[int, float]:
    """Per rank, the most activations it holds at once under the plan ``order``, in units
    of one micro-batch through a whole rank's layers (a stage holds 1/v of that): a
    micro-batch is held on a stage from its F to its last backward block there (B, or W).
    A count from the order of the rank's own blocks, whatever their durations."""
    out: dict[int, float] = {}
    for rank, acts in order.items():
        last = {}
        for i, (s, k, mb) in enumerate(acts):
            if k != "F":
                last[(s, mb)] = i
        held = peak = 0
        releases: dict[int, int] = {}
        for i, (s, k, mb) in enumerate(acts):
            if k == "F":
                held += 1
                peak = max(peak, held)
            held -= releases.pop(i, 0)
            if k == "F":
                releases[last[(s, mb)]] = releases.get(last[(s, mb)], 0) + 1
        out[int(rank)] = peak / stages_per_rank
    return out
