"""6. Wall time of every lab notebook in the ``quick`` profile, and of the whole suite.

Finds ``labs/**/*.ipynb`` and executes each in a fresh kernel of this interpreter
with the environment CI uses (``LABS_PROFILE=quick LABS_SOLUTIONS=1``, runs written
to a temporary folder), from the notebook's folder, as ``pytest --nbval-lax`` does
(cells tagged ``nbval-skip`` are left out; any error fails the benchmark). A
notebook's time includes its kernel's start. The suite's time is the sum over the
notebooks of one pass, run one after another; the first pass (cold caches) is
reported on its own and the others give the medians.

``--quick`` executes a two-cell notebook written on the fly instead, which tests
this runner without the minutes the real notebooks take.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from .common import REPO_ROOT, Report, Settings, alternate, median
from .kernels import AsyncUnixSocketKernelManager

NAME = "notebooks"
TITLE = "Lab notebooks in the quick profile"
LABS = REPO_ROOT / "labs"
TARGET_SUITE_SECONDS = 300.0
SKIP_TAGS = {"nbval-skip", "skip-execution"}


def discover(root: Path = LABS) -> list[Path]:
    """Every notebook under ``root``, sorted (Jupyter's checkpoint copies excluded)."""
    return sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def execute(path: Path, env: dict[str, str], cell_timeout: float = 600) -> float:
    """Run the notebook at ``path`` top to bottom in a new kernel; return the seconds."""
    return run_notebook(path, env, cell_timeout)[1]


def run_notebook(
    path: Path, env: dict[str, str], cell_timeout: float = 600
) -> tuple[nbformat.NotebookNode, float]:
    """Run the notebook at ``path`` top to bottom in a new kernel, from its folder, as
    ``make test`` does; return it with its outputs, and the seconds its cells took."""
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if not SKIP_TAGS & set(c.get("metadata", {}).get("tags", []))]
    # The kernel's own warnings would bury the table; errors still show.
    client = NotebookClient(
        nb,
        timeout=cell_timeout,
        kernel_name="python3",
        kernel_manager_class=AsyncUnixSocketKernelManager,  # benchmarks/kernels.py: why
        extra_arguments=["--log-level=ERROR"],
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute(env=env)
    return nb, time.perf_counter() - start


def _label(path: Path) -> str:
    return str(path.relative_to(LABS)) if path.is_relative_to(LABS) else path.name


def quick_notebook(folder: Path) -> Path:
    """A two-cell notebook that reads the profile the way the labs do."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from lab_utils import profile\nP = profile.current()",
            metadata={"tags": ["parameters"]},
        ),
        nbformat.v4.new_code_cell("assert P.name == 'quick', P\nprint(P)"),
    ]
    path = folder / "harness_check.ipynb"
    nbformat.write(nb, path)
    return path


def first_pass(contenders: dict) -> tuple[dict[str, float], dict[str, str]]:
    """Run every notebook once: ``(seconds, why failed)`` by name. A notebook that
    fails is removed from ``contenders``, so the timed passes leave it out."""
    cold, failed = {}, {}
    for name, fn in list(contenders.items()):
        try:
            cold[name] = fn()
        except Exception as e:  # CellExecutionError, a dead kernel, a timeout
            failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
            del contenders[name]
    return cold, failed


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    found = discover()
    with tempfile.TemporaryDirectory(prefix="bench-notebooks-") as tmp:
        env = {
            **os.environ,
            "LABS_PROFILE": "quick",
            "LABS_SOLUTIONS": "1",
            "LABS_RUNS": str(Path(tmp) / "runs"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        notebooks = [quick_notebook(Path(tmp))] if settings.quick else found
        if not notebooks:
            report.skipped = f"no notebooks under {LABS.relative_to(REPO_ROOT)}"
            return report
        if settings.quick:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        contenders = {_label(p): (lambda p=p: execute(p, env)) for p in notebooks}
        # The first pass (cold caches) is kept apart; quick mode makes only that one.
        cold, failed = first_pass(contenders)
        rounds = settings.rounds(full=2)
        times = {name: [t] for name, t in cold.items()}
        if not settings.quick and contenders:
            times = alternate(contenders, rounds=rounds, warmup=0)
    for name, secs in times.items():
        report.add(name, median(secs), "s", note=f"first run {cold[name]:.1f} s")
    for name, why in failed.items():
        report.add(name, None, "s", note=f"failed: {why}")
    if failed:
        report.error = f"{len(failed)} notebook(s) failed: {', '.join(failed)}"
        return report
    passes = [sum(t[i] for t in times.values()) for i in range(rounds)]
    suite = median(passes)
    label = (
        "the two-cell check notebook (quick mode)"
        if settings.quick
        else f"whole suite, {len(notebooks)} notebooks one after another"
    )
    report.add(
        label,
        suite,
        "s",
        target=f"<= {TARGET_SUITE_SECONDS:g} s",
        met=suite <= TARGET_SUITE_SECONDS,
        note=f"first run {sum(cold.values()):.0f} s",
    )
    report.details = {
        "found": [str(p.relative_to(REPO_ROOT)) for p in found],
        "rounds": rounds,
        "cold_seconds": cold,
        "seconds": times,
    }
    report.notes.append(
        f"{len(found)} notebooks found under labs/; LABS_PROFILE=quick "
        f"LABS_SOLUTIONS=1; median of {rounds} passes after a first (cold) pass."
    )
    return report
