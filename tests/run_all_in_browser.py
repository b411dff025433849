"""Run All in JupyterLab, in headless Chromium, as a student on a busy laptop would.

For each notebook: open it in a JupyterLab started like ``make lab``, Run All Cells,
wait until every cell has run, and report the wall time and any error output; a
screenshot of the whole notebook is saved per notebook. ``--busy N`` keeps N CPU-bound
processes running for the whole session (a browser, a build, another program), which is
when a check that rests on wall-clock luck fails. The profile is the environment's, as
for a student (``LABS_PROFILE``; default ``cpu`` on a machine without CUDA); exercises use
the reference solutions unless ``--own-solutions``.

    .venv/bin/python tests/run_all_in_browser.py --busy 2 labs/lab4_model_parallel/*.ipynb

Exit status 1 when a notebook shows an error or does not finish. Slow by nature (the
``cpu`` profile runs for minutes per notebook), so it is a tool for instructors and
maintainers, not part of ``make test``; the quick-profile browser tests are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import (
    REPO,
    browser_page,
    error_outputs,
    jupyter_lab,
    menu,
    open_notebook,
    wait_all_run,
    wait_kernel_idle,
)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes that each keep one core busy until the block ends."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def code_cells(notebook: Path) -> int:
    nb = json.loads(notebook.read_text())
    return sum(c["cell_type"] == "code" and "".join(c["source"]).strip() != "" for c in nb["cells"])


def run_notebook(notebook: Path, shots: Path, timeout: float) -> dict:
    """Run All in one notebook, in a JupyterLab of its own (a fresh server, browser and
    kernel, as when a student opens the course); its wall time, errors and screenshot."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    rel = notebook.resolve().relative_to(REPO / "labs").as_posix()
    with (
        tempfile.TemporaryDirectory() as tmp,
        jupyter_lab(Path(tmp)) as lab,
        browser_page(lab, Path(tmp)) as page,
    ):
        open_notebook(page, lab, rel)
        start = time.monotonic()
        menu(page, "Run", "Run All Cells")
        try:
            wait_all_run(page, code_cells(notebook), timeout)
            wait_kernel_idle(page, 120)
            finished, errors = True, []
        except (AssertionError, PlaywrightTimeout) as e:  # reported; the next notebook runs
            finished, errors = False, [f"did not finish: {e}"]
        seconds = time.monotonic() - start
        if finished:
            errors = error_outputs(page)
        shot = shots / (rel.replace("/", "__") + ".png")
        page.screenshot(path=shot, full_page=True)
    return {
        "notebook": rel,
        "seconds": round(seconds, 1),
        "finished": finished,
        "errors": [e[:500] for e in errors],
        "screenshot": str(shot),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per notebook")
    p.add_argument(
        "--own-solutions",
        action="store_true",
        help="do not set LABS_SOLUTIONS=1 (the exercises must be written)",
    )
    p.add_argument("--out", type=Path, default=REPO / "runs" / "run-all-in-browser")
    args = p.parse_args(argv)
    if not args.own_solutions:
        os.environ["LABS_SOLUTIONS"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    profile = os.environ.get("LABS_PROFILE", "(default)")
    print(f"profile {profile}, {args.busy} busy processes, screenshots in {args.out}", flush=True)
    results = []
    with busy(args.busy):
        for nb in args.notebooks:
            r = run_notebook(nb, args.out, args.timeout)
            results.append(r)
            verdict = "ok" if r["finished"] and not r["errors"] else "FAILED"
            print(f"{verdict:6} {r['seconds']:7.1f} s  {r['notebook']}", flush=True)
            for e in r["errors"]:
                print(f"       {e}", flush=True)
    (args.out / "results.json").write_text(
        json.dumps({"profile": profile, "busy": args.busy, "results": results}, indent=1)
    )
    return 0 if all(r["finished"] and not r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
