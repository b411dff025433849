"""Horovod's timeline (``HOROVOD_TIMELINE``, Chrome trace JSON) read into spans: which
tensor did what, when. Notebook 3 draws them (``lab2_plots.horovod_timeline``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Span:
    """One activity of one tensor in a Horovod timeline (seconds from the start)."""

    tensor: str
    activity: str
    start: float
    end: float


def read_timeline(path: str | Path) -> list[Span]:
    """Parse a Horovod timeline (Chrome trace JSON, written by ``HOROVOD_TIMELINE``).

    Horovod writes one process per tensor (``M`` metadata events name it) and ``B``/
    ``E`` event pairs per activity; a file whose job was killed may lack the closing
    bracket, which is tolerated.
    """
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"{path} is empty: did the job run with HOROVOD_TIMELINE set?")
    text = text.rstrip(",")
    if not text.endswith("]"):
        text += "]"
    events = json.loads(text)
    names: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[e["pid"]] = e["args"]["name"]
    open_: dict[tuple[int, int], list[tuple[str, float]]] = {}
    spans: list[Span] = []
    for e in events:
        key = (e.get("pid", 0), e.get("tid", 0))
        if e.get("ph") == "B":
            open_.setdefault(key, []).append((e.get("name", "?"), e["ts"] / 1e6))
        elif e.get("ph") == "E" and open_.get(key):
            activity, start = open_[key].pop()
            spans.append(Span(names.get(key[0], str(key[0])), activity, start, e["ts"] / 1e6))
    if spans:
        t0 = min(s.start for s in spans)
        spans = [Span(s.tensor, s.activity, s.start - t0, s.end - t0) for s in spans]
    return spans
