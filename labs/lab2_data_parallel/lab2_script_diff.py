"""The differences between two scripts grouped by their numbered steps (``# ... [k]``):
how Lab 2 shows ``train_serial.py`` becoming ``train_ddp.py`` or ``train_horovod.py``,
one step at a time (HTML in a notebook, plain text elsewhere)."""

from __future__ import annotations

import difflib
import html
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lab_utils.source import render

_STEP_TAG = re.compile(r"#.*?\[(\d+)\]")


@dataclass(frozen=True)
class DiffStep:
    """The changed lines of one numbered step of a script conversion."""

    step: int
    hunks: tuple[tuple[tuple[str, str], ...], ...]  # each line as (kind "+"/"-"/" ", text)

    @property
    def added(self) -> int:
        return sum(kind == "+" for hunk in self.hunks for kind, _ in hunk)

    @property
    def removed(self) -> int:
        return sum(kind == "-" for hunk in self.hunks for kind, _ in hunk)


def diff_steps(old: str, new: str) -> list[DiffStep]:
    """Group the differences between two scripts by the step tags ``# ... [k]`` on the
    new script's lines.

    Within each changed block, an untagged added line belongs to the step of the tagged
    line above it (or, at the top of the block, below it); a removed line goes to the
    segment of the added line most like it. Blocks without any tag (e.g. the docstring)
    are step 0. Each segment is shown with one unchanged line of context on either side.
    """
    a, b = old.splitlines(), new.splitlines()
    steps: dict[int, list] = {}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        tags = [int(m.group(1)) if (m := _STEP_TAG.search(t)) else None for t in b[j1:j2]]
        for k in range(1, len(tags)):  # untagged lines continue the step above them ...
            tags[k] = tags[k] if tags[k] is not None else tags[k - 1]
        for k in range(len(tags) - 2, -1, -1):  # ... or, at the top, the one below
            tags[k] = tags[k] if tags[k] is not None else tags[k + 1]
        segments: list[tuple[int, int, list[str]]] = []  # (tag, first b index, removed)
        for k, tag in enumerate(tags):
            if k == 0 or tag != tags[k - 1]:
                segments.append((tag or 0, j1 + k, []))
        if not segments:  # a pure deletion: tagged by what it deleted, else step 0
            m = next((_STEP_TAG.search(t) for t in a[i1:i2] if _STEP_TAG.search(t)), None)
            segments.append((int(m.group(1)) if m else 0, j1, []))
        bounds = [s[1] for s in segments[1:]] + [j2]
        for line in a[i1:i2]:
            best = max(
                range(len(segments)),
                key=lambda k: max(
                    (_likeness(line, t) for t in b[segments[k][1] : bounds[k]]), default=(0, 0.0)
                ),
            )
            segments[best][2].append(line)
        for (tag, start, removed), stop in zip(segments, bounds, strict=True):
            before = [(" ", b[start - 1])] if start > 0 else []
            after = [(" ", b[stop])] if stop < len(b) else []
            lines = before + [("-", t) for t in removed] + [("+", t) for t in b[start:stop]] + after
            steps.setdefault(tag, []).append(tuple(lines))
    return [DiffStep(k, tuple(v)) for k, v in sorted(steps.items())]


def _likeness(a: str, b: str) -> tuple[int, float]:
    """How alike two lines are: common prefix length first (an edited line keeps its
    start), then difflib's similarity ratio."""
    a, b = a.strip(), b.strip()
    return len(os.path.commonprefix([a, b])), difflib.SequenceMatcher(None, a, b).ratio()


def diff_html(step: DiffStep, title: str = "") -> str:
    """One step's hunks as coloured HTML (green added, red removed)."""
    style = {
        "+": "background:#e6ffec;color:#1a7f37",
        "-": "background:#ffebe9;color:#cf222e",
        " ": "color:#57606a",
    }
    parts = [
        f"<div style='font-weight:bold;margin-top:0.6em'>{html.escape(title)}</div>"
        if title
        else ""
    ]
    for hunk in step.hunks:
        rows = "".join(
            f"<div style='{style[k]}'>{html.escape(k + ' ' + t) or '&nbsp;'}</div>" for k, t in hunk
        )
        parts.append(
            "<pre style='font-size:11px;line-height:1.25;margin:0.3em 0;padding:0.3em;"
            f"border:1px solid #d0d7de'>{rows}</pre>"
        )
    return "".join(parts)


def show_diff(
    old_path: str | Path,
    new_path: str | Path,
    names: Mapping[int, str] | None = None,
    only: Sequence[int] | None = None,
) -> list[DiffStep]:
    """Display the conversion of ``old_path`` into ``new_path`` step by step (HTML in a
    notebook, plain text elsewhere), or only the steps ``only``; return all steps."""
    steps = diff_steps(Path(old_path).read_text(), Path(new_path).read_text())
    names = names or {}
    shown = [s for s in steps if only is None or s.step in only]
    titles = [f"[{s.step}] {names.get(s.step, '')} (+{s.added} −{s.removed} lines)" for s in shown]
    pairs = list(zip(shown, titles, strict=True))
    plain = "\n".join(
        "\n".join([t, *(k + " " + line for hunk in s.hunks for k, line in hunk)]) for s, t in pairs
    )
    render("".join(diff_html(s, t) for s, t in pairs), plain)
    return steps
