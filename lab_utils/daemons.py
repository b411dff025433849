"""What the test clusters (``spark_cluster``, ``slurm_cluster``) do alike with the daemons
they start: each in a session of its own with its output in a log, waited for until it is
ready, read back from its log when it fails, and terminated (then killed) on the way out."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil


def start_logged(args: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen:
    """Start ``args`` with its output in ``log``, in a session of its own: Ctrl-C reaches
    the caller, which stops the daemons in order, not the daemons half-way through a job."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            list(args),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,
        )


def wait_for(
    ready: Callable[[], bool],
    timeout: float,
    *,
    check: Callable[[], None] = lambda: None,
    poll_s: float = 0.3,
) -> bool:
    """Poll ``ready()`` until it is true (``True``) or ``timeout`` passes (``False``);
    ``check()`` runs first each time and raises if waiting is pointless (a daemon died).
    Errors of ``ready`` (a port not open yet, a command that fails) count as not ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            if ready():
                return True
        time.sleep(poll_s)
    return False


def tail_logs(logs: Sequence[Path], lines: int) -> str:
    """The last ``lines`` of each log, headed by its name (logs not written yet are left out)."""
    out = []
    for log in logs:
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(out)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def terminate(procs: Sequence[psutil.Process], grace_s: float) -> None:
    """SIGTERM, ``grace_s`` to leave, then SIGKILL for those still there."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=grace_s)


def terminate_tree(top: psutil.Process, grace_s: float) -> None:
    """:func:`terminate` ``top`` and all its descendants."""
    try:
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    terminate(procs, grace_s)
