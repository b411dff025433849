"""JupyterLab as a student uses it: started like `make lab`, driven in headless Chromium.

Screenshots land in $LABS_TEST_ARTIFACTS/browser (default runs/test-artifacts/browser);
each test prints the folder. Needs Debian's chromium and Playwright (`make setup`);
without them the tests are skipped with the command to run, except under CI=true,
where they must run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from browser import (
    REPO,
    browser_page,
    chromium,
    error_outputs,
    jupyter_lab,
    menu,
    open_notebook,
    screenshot_on_failure,
    wait_all_run,
    wait_kernel_idle,
)

MISSING = []
if chromium() is None:
    MISSING.append("chromium (as root: apt-get install -y chromium)")
try:
    import playwright.sync_api  # noqa: F401
except ImportError:
    MISSING.append("playwright (pip install 'lab-utils[browser]')")
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI must run the browser tests; missing: {', '.join(MISSING)}")
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)}; `make setup` installs them"
)

LAB1 = "lab1_optimisation/02_sgd_minibatches.ipynb"
LAB2 = "lab2_data_parallel/01_collectives.ipynb"
# Chromium reports failed requests as console errors: the kernel's websocket closing at
# shutdown and a missing favicon are not the student's problem.
BENIGN_CONSOLE = re.compile(r"favicon|WebSocket is already in CLOSING or CLOSED")


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    base = Path(os.environ.get("LABS_TEST_ARTIFACTS", REPO / "runs" / "test-artifacts"))
    folder = base / "browser" / request.node.name
    shutil.rmtree(folder, ignore_errors=True)  # only this run's screenshots
    folder.mkdir(parents=True)
    print(f"browser screenshots: {folder}")
    return folder


def code_cells(path: str) -> int:
    nb = json.loads((REPO / "labs" / path).read_text())
    return sum(c["cell_type"] == "code" and "".join(c["source"]).strip() != "" for c in nb["cells"])


def run_all(page, path: str, artifacts: Path, timeout: float) -> None:
    menu(page, "Run", "Run All Cells")
    wait_all_run(page, code_cells(path), timeout)
    wait_kernel_idle(page, 60)
    assert error_outputs(page) == []


def test_course_settings_installed():
    """`make setup` ships the course's JupyterLab settings into the environment."""
    import sys

    shipped = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    ours = json.loads((REPO / "scripts" / "jupyterlab-overrides.json").read_text())
    assert shipped.exists(), f"{shipped} missing: run `make setup`"
    assert json.loads(shipped.read_text()) == ours
    assert ours["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


@pytest.mark.slow
def test_lab1_explorer_in_browser(tmp_path, artifacts):
    with jupyter_lab(tmp_path) as lab:
        with browser_page(lab, tmp_path) as page, screenshot_on_failure(page, artifacts):
            open_notebook(page, lab, LAB1)
            page.screenshot(path=artifacts / "01-opened.png")
            # First start: no pop-up (news, updates, kernel choice) covers the notebook.
            assert page.locator(".jp-toast-message, .jp-Dialog").count() == 0
            run_all(page, LAB1, artifacts, timeout=240)
            page.screenshot(path=artifacts / "02-ran-all.png", full_page=True)

            # tqdm's progress bar is a widget, not text.
            bars = page.locator(".widget-hprogress")
            assert bars.count() >= 1, "no tqdm progress widget rendered"

            # The explorer: move the batch-size slider, the figure is redrawn.
            explorer = page.locator(".widget-interact").first
            explorer.scroll_into_view_if_needed()
            image = explorer.locator(".jp-OutputArea-output img").first
            before = image.get_attribute("src")
            explorer.screenshot(path=artifacts / "03-explorer-before.png")
            handle = explorer.locator(".widget-slider .noUi-handle, .slider .noUi-handle").first
            handle.focus()
            for _ in range(3):
                page.keyboard.press("ArrowRight")
            page.wait_for_function(
                "([el, before]) => { const i = el.querySelector('.jp-OutputArea-output img');"
                " return i && i.getAttribute('src') !== before; }",
                arg=[explorer.element_handle(), before],
                timeout=60_000,
            )
            wait_kernel_idle(page, 60)
            readout = explorer.locator(".widget-readout").first.inner_text().strip()
            assert readout != "16", "the batch-size slider did not move"
            # Each key press redraws: wait until the last figure stays (kernel idle, src stable).
            src, stable_since = image.get_attribute("src"), time.monotonic()
            while time.monotonic() - stable_since < 3:
                time.sleep(0.5)
                now = explorer.locator(".jp-OutputArea-output img").first.get_attribute("src")
                if now != src:
                    src, stable_since = now, time.monotonic()
            wait_kernel_idle(page, 60)
            explorer.screenshot(path=artifacts / "04-explorer-after.png")
            # Still no pop-up (JupyterLab asks about news a few seconds after start).
            assert page.locator(".jp-toast-message, .jp-Dialog").count() == 0
            assert error_outputs(page) == []
        errors = [m for m in lab.console if not BENIGN_CONSOLE.search(m)]
        assert errors == [], f"browser console errors: {errors}"
        server_family = lab.processes()
        assert server_family, "the marker did not reach the server's processes"
    assert lab.processes() == [], "processes left after the server stopped"


@pytest.mark.slow
def test_lab2_launch_and_interrupt_in_browser(tmp_path, artifacts):
    with jupyter_lab(tmp_path) as lab:
        with browser_page(lab, tmp_path) as page, screenshot_on_failure(page, artifacts):
            open_notebook(page, lab, LAB2)
            run_all(page, LAB2, artifacts, timeout=300)
            page.screenshot(path=artifacts / "01-ran-all.png", full_page=True)
            # (textContent: cells scrolled out of view have no innerText)
            text = page.eval_on_selector(".jp-NotebookPanel .jp-Notebook", "e => e.textContent")
            ranks = set(re.findall(r"\brank (\d+)[\]:]", text))
            assert ranks >= {"0", "1"}, "no rank-tagged output from both ranks in the notebook"
            tagged = page.locator(
                ".jp-OutputArea-output", has_text=re.compile(r"rank 1[\]:]")
            ).first
            tagged.scroll_into_view_if_needed()
            tagged.screenshot(path=artifacts / "02-rank-output.png")

            # A long job, started from a new cell like a student would, then interrupted.
            page.locator(".jp-Cell").last.click()
            page.keyboard.press("Escape")
            page.keyboard.press("b")
            page.keyboard.press("Enter")
            page.keyboard.insert_text(
                'job = launch.run("scripts/ring_check.py", ["--sizes", "1048576", '
                '"--repeats", "100000"], nprocs=2, timeout=300)'
            )
            page.keyboard.press("Shift+Enter")
            deadline = time.monotonic() + 120
            while not any(
                "ring_check.py" in " ".join(p.cmdline()) for p in lab.processes() if p.is_running()
            ):
                assert time.monotonic() < deadline, "the job never started"
                time.sleep(0.5)
            time.sleep(3)  # the ranks are at work
            page.screenshot(path=artifacts / "03-job-running.png")
            menu(page, "Kernel", "Interrupt Kernel")
            wait_kernel_idle(page, 60)
            page.screenshot(path=artifacts / "04-interrupted.png")
            # (Shift+Enter added an empty cell below the interrupted one)
            assert "KeyboardInterrupt" in page.eval_on_selector(
                ".jp-NotebookPanel .jp-Cell:nth-last-child(2)", "e => e.textContent"
            )
            # The check that found no error after Run All does see this traceback.
            assert any("KeyboardInterrupt" in e for e in error_outputs(page))
            deadline = time.monotonic() + 30
            left = [
                p
                for p in lab.processes()
                if p.is_running()
                and re.search(
                    r"ring_check|torch\.distributed\.run|lab_utils\.reaper", " ".join(p.cmdline())
                )
            ]
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = [p for p in left if p.is_running() and p.status() != "zombie"]
            assert left == [], f"the interrupted job left processes: {left}"
        errors = [m for m in lab.console if not BENIGN_CONSOLE.search(m)]
        assert errors == [], f"browser console errors: {errors}"
    assert lab.processes() == [], "processes left after the server stopped"
