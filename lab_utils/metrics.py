"""JSON-lines metrics, written by rank 0 only.

A record goes to an explicit file and, when a launcher asked for it through
``$LABS_METRICS_FILE``, to that file too, so ``lab_utils.launch.run`` can hand the
metrics back to the notebook without parsing printed text.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

ENV_VAR = "LABS_METRICS_FILE"


RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_PROCID")


def env_rank() -> int:
    """The global rank a launcher put in the environment (0 when none did)."""
    return next((int(os.environ[v]) for v in RANK_VARS if os.environ.get(v, "") != ""), 0)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    return value


def emit(record: dict[str, Any], path: str | os.PathLike | None = None) -> None:
    """Append ``record`` as one JSON line to ``path`` and ``$LABS_METRICS_FILE`` (rank 0)."""
    if env_rank() != 0:
        return
    line = json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"
    targets = {Path(p) for p in (path, os.environ.get(ENV_VAR)) if p}
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8") as f:
            f.write(line)


def events(records: list[dict[str, Any]], name: str, **fields: Any) -> list[dict[str, Any]]:
    """The records of event ``name``, in order; ``fields`` keeps those whose fields have
    these values (``algo="ring"``). ``launch.LaunchResult.events`` is this on a job's
    records."""
    return [
        r
        for r in records
        if r.get("event") == name and all(k in r and r[k] == v for k, v in fields.items())
    ]


def read(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON-lines file back; a missing file gives an empty list."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
    return out
