"""Drive JupyterLab in headless Chromium as a student would: the plumbing of test_browser.

The browser is Debian's ``chromium`` driven by Playwright (from PyPI) through
``executable_path``: Playwright never downloads a browser of its own here.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lab_utils.net import free_port

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# Root in a container: no sandbox; no GPU, network services or first-run questions.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def make_lab_command() -> list[str]:
    """The recipe of ``make lab`` read from the Makefile, with its variables filled in."""
    text = (REPO / "Makefile").read_text()
    m = re.search(r"^lab:.*\n\t(.+)$", text, re.M)
    if not m:
        raise AssertionError("the Makefile has no `lab:` recipe")
    line = m.group(1)
    root = "--allow-root" if os.geteuid() == 0 else ""
    line = (
        line.replace("$(VENV)", str(Path(sys.executable).parent.parent))
        .replace("$(ALLOW_ROOT)", root)
        .replace("$(LAB_ARGS)", "")
    )
    return shlex.split(line)


@dataclass
class Lab:
    url: str
    token: str
    proc: subprocess.Popen
    marker: str  # in the environment of every process the server starts
    log: Path
    console: list[str] = field(default_factory=list)

    def processes(self) -> list[psutil.Process]:
        """Every live process that carries this server's marker (its whole family)."""
        return marked_processes(self.marker)


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if p.environ().get("LABS_BROWSER_TEST") == marker:
                found.append(p)
        except psutil.Error:
            continue
    return found


@contextlib.contextmanager
def jupyter_lab(tmp: Path, timeout: float = 120) -> Iterator[Lab]:
    """JupyterLab started as ``make lab`` starts it, on its own port and token, with a
    fresh user folder (first start); stopped with all it started on the way out."""
    port, token, marker = free_port(), secrets.token_hex(16), secrets.token_hex(8)
    home = tmp / "home"
    home.mkdir()
    env = dict(
        os.environ,
        HOME=str(home),
        LABS_BROWSER_TEST=marker,
        JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "user-settings"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    # Running a notebook must not rewrite the course's copy: no autosave in this fresh
    # profile, and whatever was saved anyway is put back on the way out.
    plugin = home / "user-settings" / "@jupyterlab" / "docmanager-extension"
    plugin.mkdir(parents=True)
    (plugin / "plugin.jupyterlab-settings").write_text('{"autosave": false}')
    notebooks = {
        p: p.read_bytes()
        for p in (REPO / "labs").rglob("*.ipynb")
        if ".ipynb_checkpoints" not in p.parts
    }
    cmd = [
        *make_lab_command(),
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
    ]
    log = tmp / "jupyterlab.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    lab = Lab(f"http://127.0.0.1:{port}", token, proc, marker, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited ({proc.returncode}):\n{log.read_text()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{lab.url}/api/status?token={token}", timeout=5)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not answer in {timeout}s:\n{log.read_text()}")
            time.sleep(0.5)
        yield lab
    finally:
        stop_tree(proc)
        for path, content in notebooks.items():
            if path.read_bytes() != content:
                path.write_bytes(content)
        for p in marked_processes(marker):  # strays that left the server's tree
            with contextlib.suppress(psutil.Error):
                p.kill()


def stop_tree(proc: subprocess.Popen, grace_s: float = 15) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        top = psutil.Process(proc.pid)
        family = [top, *top.children(recursive=True)]
        top.terminate()  # the server shuts its kernels down on SIGTERM
        _, left = psutil.wait_procs(family, timeout=grace_s)
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    proc.wait(timeout=grace_s)


@contextlib.contextmanager
def screenshot_on_failure(page: Any, folder: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=folder / "failure.png", full_page=True)
        raise


@contextlib.contextmanager
def browser_page(lab: Lab, tmp: Path) -> Iterator[Any]:
    """A Chromium page with a fresh profile; console errors collect in ``lab.console``."""
    from playwright.sync_api import sync_playwright

    exe = chromium()
    assert exe, "no chromium"
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp))
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=exe,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("console", lambda m: m.type == "error" and lab.console.append(m.text))
            page.on("pageerror", lambda e: lab.console.append(f"page error: {e}"))
            page.set_default_timeout(60_000)
            yield page
        finally:
            context.close()


# ----------------------------------------------------------------------------- JupyterLab UI
def open_notebook(page: Any, lab: Lab, path: str) -> None:
    page.goto(f"{lab.url}/lab/tree/{path}?token={lab.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=120_000)
    wait_kernel_idle(page, 120)


def wait_kernel_idle(page: Any, timeout: float) -> None:
    """Wait for the status bar's "Python 3 (ipykernel) | Idle"."""
    page.wait_for_function(
        "() => { const s = document.querySelector('#jp-main-statusbar');"
        " return s && /ipykernel\\) \\| Idle/.test(s.textContent); }",
        timeout=timeout * 1000,
    )


def menu(page: Any, top: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()


def prompts(page: Any) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-CodeCell .jp-InputArea-prompt", "els => els.map(e => e.textContent.trim())"
    )


def wait_all_run(page: Any, n_code: int, timeout: float) -> list[str]:
    """Wait until every code cell has run (``[N]:``) and none is running (``[*]:``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = prompts(page)
        if len(p) >= n_code and all(re.fullmatch(r"\[\d+\]:", x) for x in p):
            return p
        time.sleep(1)
    raise AssertionError(f"cells not all run after {timeout}s: prompts {prompts(page)}")


def error_outputs(page: Any) -> list[str]:
    """Texts of the outputs that show an exception (a traceback or an error output)."""
    return page.eval_on_selector_all(
        ".jp-OutputArea-output",
        "els => els.filter(e => e.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr'"
        " && /Traceback|Error:/.test(e.textContent) || e.classList.contains('jp-mod-error'))"
        ".map(e => e.textContent.slice(0, 2000))",
    )
