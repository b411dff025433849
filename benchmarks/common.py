"""What every benchmark shares: settings, result rows, timing helpers, the machine.

Timing rules, applied by every benchmark:

* warm-up first (allocations, oneDNN kernel selection, file caches), never timed;
* each figure is the median of several timed runs;
* a ratio compares two things measured side by side, in alternating order
  (A B B A A B ...), so drift in the machine's load hits both the same way; it is
  the median of the per-round ratios, not a ratio of two separate medians.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


class Skip(Exception):
    """Raised by a benchmark that cannot run here (e.g. Horovod is not installed)."""


@dataclass(frozen=True)
class Settings:
    """How hard to measure.

    ``quick``: tiny sizes and a single timed round; checks that the harness works,
    its figures mean nothing. ``repeats``: timed rounds per figure (``None``: each
    benchmark's own default).
    """

    quick: bool = False
    repeats: int | None = None

    @property
    def threads(self) -> int:
        """Intra-op threads of single-process runs: every core; 1 in quick mode, which
        often runs beside other work (the test suite), where 2 threads would wait
        for each other."""
        return 1 if self.quick else (os.cpu_count() or 1)

    def rounds(self, full: int, quick: int = 1) -> int:
        """Timed rounds: ``quick`` in quick mode, else ``repeats`` or ``full``."""
        if self.quick:
            return quick
        return self.repeats if self.repeats is not None else full


@dataclass
class Row:
    """One measured figure of a benchmark, as printed in the table."""

    metric: str
    value: float | None
    unit: str = ""
    target: str = ""  # e.g. "<= 3 %"; empty when there is none
    met: bool | None = None  # None: no target, or not measurable
    note: str = ""

    def formatted_value(self) -> str:
        if self.value is None:
            return "n/a"
        v = self.value
        if abs(v) >= 100 or v == int(v):
            text = f"{v:,.0f}"
        elif abs(v) >= 10:
            text = f"{v:.1f}"
        elif abs(v) >= 0.01:
            text = f"{v:.3g}"
        else:
            text = f"{v:.2g}"
        return f"{text} {self.unit}".strip()

    @property
    def status(self) -> str:
        return {True: "met", False: "MISSED", None: ""}[self.met]


@dataclass
class Report:
    """What one benchmark returns: its rows plus the raw samples behind them."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""  # why it did not run
    error: str = ""  # why it failed

    def add(
        self,
        metric: str,
        value: float | None,
        unit: str = "",
        *,
        target: str = "",
        met: bool | None = None,
        note: str = "",
    ) -> Row:
        row = Row(metric, value, unit, target, met, note)
        self.rows.append(row)
        return row

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Report:
        """The inverse of :meth:`to_json`."""
        return cls(**{**doc, "rows": [Row(**row) for row in doc.get("rows", [])]})


# ----------------------------------------------------------------------------- timing
def median(values: Iterable[float]) -> float:
    """The median of a non-empty sequence."""
    values = list(values)
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def spread(values: Iterable[float]) -> tuple[float, float]:
    """``(min, max)``, to show how noisy a figure was."""
    values = list(values)
    return min(values), max(values)


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU does not)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def alternate(
    contenders: Mapping[str, Callable[[], float | None]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every contender once per round, in alternating order, and collect its times.

    Each callable either returns the seconds it measured itself (e.g. excluding its
    own set-up) or ``None``, in which case the whole call is timed. Round ``i`` runs
    the contenders forwards when ``i`` is even and backwards when odd (A B, B A, ...),
    so a slow drift of the machine's load does not favour either. ``warmup`` rounds
    come first and are discarded.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + rounds):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            own = contenders[name]()
            seconds = own if own is not None else time.perf_counter() - start
            if i >= warmup:
                times[name].append(seconds)
    return times


def paired_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Per-round ratios of two contenders timed by :func:`alternate`."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("paired_ratios needs two equally long, non-empty lists")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


# ----------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_features() -> str:
    """The instruction sets torch uses here, e.g. ``AVX512 + AVX512-BF16``."""
    import torch

    features = [torch.backends.cpu.get_cpu_capability()]
    for name, label in (
        ("_is_avx512_bf16_supported", "AVX512-BF16"),
        ("_is_amx_tile_supported", "AMX"),
    ):
        if getattr(torch.cpu, name, lambda: False)():
            features.append(label)
    return " + ".join(features)


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _horovod_version() -> str:
    try:
        import horovod
    except Exception:  # not installed, or installed but broken: either way not usable
        return ""
    return getattr(horovod, "__version__", "?")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages (``None`` where the OS has none)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """The machine and software the figures were measured on."""
    import psutil
    import torch

    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)} x{torch.cuda.device_count()})"
    return {
        "date": utc_now(),
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "device": device,
        "torch": torch.__version__,
        "horovod": _horovod_version(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "commit": _git_commit(),
        "load_average_start": load_average(),
    }


def describe(m: Mapping[str, Any]) -> str:
    """One line naming the machine, for the table's header."""
    cores = f"{m['physical_cores']} cores / {m['logical_cpus']} threads"
    hvd = f", Horovod {m['horovod']}" if m.get("horovod") else ", no Horovod"
    return (
        f"{m['cpu']} ({cores}, {m.get('cpu_features') or '?'}, {m['memory_gib']} GiB), "
        f"torch {m['torch']} "
        f"with {m['torch_threads']} intra-op threads, device {m['device']}{hvd}, "
        f"Python {m['python']}, {m['os']}"
    )


@functools.cache
def horovod_problem() -> str:
    """Why Horovod cannot be used here, or ``""`` when its PyTorch support works.

    Works means: ``horovodrun`` is installed and ``horovod.torch`` (its compiled
    extension) imports, in a process of its own. That is what ``horovodrun
    --check-build`` reports as "[X] PyTorch", for a quarter of its cost (it also tries
    every other framework). Asked once per run.
    """
    import sys

    from lab_utils import launch

    try:
        launch._bin("horovodrun")
    except launch.LaunchError as e:
        return str(e)
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import horovod.torch"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"importing horovod.torch failed: {e}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"Horovod with PyTorch support does not import here: {last}"
    return ""
