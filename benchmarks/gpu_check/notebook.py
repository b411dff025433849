"""Run one notebook top to bottom in a fresh kernel: ``python -m benchmarks.gpu_check.notebook PATH``.

A path's own process (so its timeout and teardown are the harness's), executing the
notebook as ``make test`` does (``benchmarks.notebooks.execute``: nbclient, cells tagged
``nbval-skip`` left out, from the notebook's folder) with this process's environment:
the profile, the solutions, ``LABS_BACKEND`` and the bundle's ``PYTHONPATH`` reach the
kernel and every process the notebook launches. A failing cell ends this process with
status 1 after printing nbclient's whole report of it (the cell, what it printed, its
traceback); the seconds are emitted as a metric.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from lab_utils import metrics


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.gpu_check.notebook PATH.ipynb", file=sys.stderr)
        return 2
    from benchmarks.notebooks import execute  # nbclient: imported only where it runs

    path = Path(args[0]).resolve()
    try:
        seconds = execute(path, dict(os.environ), cell_timeout=600)
    except Exception as e:  # CellExecutionError carries the cell's traceback as text
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # no terminal colours
        # All of it: nbclient puts what the cell printed (a launched job's ranks write
        # there) above the traceback, and the known limits must see a rank's own error,
        # which the launcher's summary at the end does not repeat.
        print(text, file=sys.stderr)
        print(
            f"NotebookError: {type(e).__name__}: {text.splitlines()[-1] if text else ''}",
            file=sys.stderr,
        )
        return 1
    metrics.emit({"event": "notebook", "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
