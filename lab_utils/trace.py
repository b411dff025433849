"""Read a torch.profiler Chrome trace into compute and communication intervals.

``torch.profiler.profile(...).export_chrome_trace(path)`` writes one JSON file per rank
(open it in Perfetto or chrome://tracing). This module turns such a file into two lists
of ``(start, end)`` intervals in microseconds, measured from the first recorded step:

- **communication**: the collectives themselves, where the backend runs them (Gloo's
  worker threads record ``gloo:all_reduce``; on a GPU, NCCL's kernels ``nccl…``);
- **compute**: the operators that do the model's arithmetic (``aten::`` operators on the
  CPU, every other GPU kernel on a GPU).

    t = trace.load("runs/lab6/traces/ddp_b25_rank0.json")
    trace.overlap_fraction(t.compute, t.comm)   # share of communication time hidden by compute

A Gloo collective's interval runs from when its worker thread picks it up to when it
completes, so it includes waiting for the slower rank as well as the transfer itself.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

COMM_PREFIXES = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel", "mpi:")
STEP_PREFIX = "ProfilerStep#"


@dataclass(frozen=True)
class Trace:
    """One rank's trace: its recorded steps, compute and communication intervals (µs
    from the start of the first recorded step), each list sorted and merged."""

    steps: list[Interval]
    compute: list[Interval]
    comm: list[Interval]
    comm_ops: dict[str, int]  # collectives that started in the recorded steps, by name

    @property
    def span(self) -> Interval:
        """From the start of the first step to the end of the last."""
        return (self.steps[0][0], self.steps[-1][1]) if self.steps else (0.0, 0.0)


def is_comm(event: dict[str, Any]) -> bool:
    """A collective run by the backend (Gloo's thread, an NCCL kernel)."""
    return str(event.get("name", "")).startswith(COMM_PREFIXES)


def is_compute(event: dict[str, Any], main_tids: set) -> bool:
    """An operator doing arithmetic: an ``aten::`` operator on a thread that runs the
    training loop or autograd's backward, or any GPU kernel that is not NCCL's."""
    name, cat = str(event.get("name", "")), event.get("cat")
    if cat == "kernel":
        return not name.startswith(COMM_PREFIXES)
    return cat == "cpu_op" and name.startswith("aten::") and event.get("tid") in main_tids


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total(intervals: Sequence[Interval]) -> float:
    """Time covered by already merged intervals."""
    return sum(e - s for s, e in intervals)


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Time covered by both of two merged interval lists (a two-pointer sweep)."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        both += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def overlap_fraction(compute: Sequence[Interval], comm: Sequence[Interval]) -> float:
    """Share of the communication time during which compute also ran (0 when nothing
    was communicated): 1 means every collective was hidden behind arithmetic."""
    c = total(comm)
    return intersection(compute, comm) / c if c > 0 else 0.0


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of ``intervals`` inside ``window``."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def from_events(events: Iterable[dict[str, Any]]) -> Trace:
    """Build a :class:`Trace` from Chrome-trace events (complete events, ``ph == "X"``).

    The training loop's thread is the one that records the ``ProfilerStep#`` spans;
    autograd's backward runs there on a CPU (and in its own thread on a GPU, whose
    operators only launch kernels). Everything is clipped to the recorded steps. The GPU
    timeline's copies of CPU annotations (``gpu_user_annotation``) are left out."""
    # With CUDA the profiler also draws every record_function span (ProfilerStep#N,
    # gloo:all_reduce, ...) again on the GPU's timeline as "gpu_user_annotation": copies of
    # CPU spans, not more steps or collectives (seen on an H200: 2 steps read as 4).
    xs = [
        e
        for e in events
        if e.get("ph") == "X" and "dur" in e and e.get("cat") != "gpu_user_annotation"
    ]
    step_events = sorted(
        (e for e in xs if str(e.get("name", "")).startswith(STEP_PREFIX)),
        key=lambda e: float(e["ts"]),
    )
    if not step_events:
        raise ValueError(
            "no ProfilerStep# spans: record with a torch.profiler schedule "
            "and call prof.step() after each training step"
        )
    t0 = float(step_events[0]["ts"])

    def span(e: dict[str, Any]) -> Interval:
        return float(e["ts"]) - t0, float(e["ts"]) + float(e["dur"]) - t0

    main_tids = {e.get("tid") for e in step_events}
    main_tids |= {e.get("tid") for e in xs if str(e.get("name", "")).startswith("autograd::engine")}
    steps = [span(e) for e in step_events]
    window = (steps[0][0], steps[-1][1])
    comm_events = [e for e in xs if is_comm(e)]
    compute = merge(clip((span(e) for e in xs if is_compute(e, main_tids)), window))
    comm = merge(clip((span(e) for e in comm_events), window))
    ops = Counter(str(e["name"]) for e in comm_events if window[0] <= span(e)[0] < window[1])
    return Trace(steps=steps, compute=compute, comm=comm, comm_ops=dict(ops))


def load(path: str | Path) -> Trace:
    """Read the Chrome trace ``path`` written by ``export_chrome_trace``."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return from_events(events)


def summary(t: Trace) -> dict[str, float]:
    """Per-step averages in milliseconds and the overlap fraction of one rank's trace."""
    n = max(1, len(t.steps))
    comm, both = total(t.comm), intersection(t.compute, t.comm)
    return {
        "step_ms": total(t.steps) / n / 1e3,
        "compute_ms": total(t.compute) / n / 1e3,
        "comm_ms": comm / n / 1e3,
        "exposed_comm_ms": (comm - both) / n / 1e3,
        "overlap": overlap_fraction(t.compute, t.comm),
    }


def per_step(t: Trace, kind: str = "all_reduce") -> float:
    """Collectives of ``kind`` per recorded step (``gloo:all_reduce``, ``nccl:all_reduce``)."""
    found = sum(c for name, c in t.comm_ops.items() if name.split(":")[-1] == kind)
    return found / max(1, len(t.steps))
