"""A character-level text corpus that every machine already has: the Python
standard library's own ``.py`` source files (name: ``python-stdlib-chars``).

It is real text (code written by people), needs no download, and is large enough
for a small language model. Characters outside printable ASCII become ``?`` so the
vocabulary is fixed (``VOCAB`` = 96 symbols) on every Python version.

    corpus = text.load(n_chars=200_000)
    x, y = corpus.batch(batch_size=16, seq_len=64, step=0)   # next-character targets
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

NAME = "python-stdlib-chars"
# '\n' and the 95 printable ASCII characters; anything else is read as '?'.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
_UNKNOWN = _INDEX["?"]


def stdlib_dir() -> Path:
    """Folder of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def encode(s: str) -> torch.Tensor:
    """Characters to int64 ids (unknown characters to ``?``)."""
    return torch.tensor([_INDEX.get(c, _UNKNOWN) for c in s], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Ids back to text."""
    return "".join(ALPHABET[int(i)] for i in ids)


@dataclass
class Corpus:
    """Encoded characters plus a deterministic batch sampler."""

    ids: torch.Tensor
    files: int

    def batch(
        self, batch_size: int, seq_len: int, step: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(B, T)`` and next-character targets; the same on every rank for
        the same ``step`` and ``seed``, so split and unsplit runs see equal data."""
        if len(self.ids) <= seq_len + 1:
            raise ValueError(
                f"corpus of {len(self.ids)} characters is too short for seq_len={seq_len}"
            )
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        start = torch.randint(0, len(self.ids) - seq_len - 1, (batch_size,), generator=g)
        rows = start[:, None] + torch.arange(seq_len + 1)
        chunk = self.ids[rows]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def load(n_chars: int = 500_000, root: str | Path | None = None) -> Corpus:
    """Read the first ``n_chars`` characters of the standard library's ``.py`` files,
    in sorted path order (``root`` overrides the folder)."""
    root = Path(root) if root is not None else stdlib_dir()
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: cannot build the {NAME} corpus")
    parts, total, used = [], 0, 0
    for path in files:
        s = path.read_text(encoding="utf-8", errors="replace")
        parts.append(s)
        total += len(s)
        used += 1
        if total >= n_chars:
            break
    return Corpus(encode("".join(parts)[:n_chars]), used)
