"""A supervisor that owns a launched job's whole process tree.

``python -m lab_utils.reaper -- CMD ...`` runs CMD and makes itself the Linux
"child subreaper", so every process CMD starts stays its descendant even when the
launcher in between exits or moves its workers into a session of their own (as
``horovodrun`` does). When CMD ends, or the supervisor is told to stop (SIGTERM,
SIGINT, its parent dying), it terminates what is left of the tree, waits a grace
period, kills the rest, and exits with CMD's status. Launching through it is how
:mod:`lab_utils.launch` and the autograder guarantee that no process outlives a job.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = float(os.environ.get("LABS_REAPER_GRACE", "3"))


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the tree walk still works
        return False


def descendants() -> list[psutil.Process]:
    """Every live process below this one."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(grace_s: float = GRACE_S) -> int:
    """SIGTERM every descendant, wait up to ``grace_s``, SIGKILL the rest.

    Returns how many processes had to be stopped.
    """
    procs = descendants()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Workers may have started children of their own meanwhile: take them too.
    for p in alive + descendants():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    _reap_zombies()
    return len(procs)


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m lab_utils.reaper -- CMD [ARGS...]", file=sys.stderr)
        return 2
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # our parent died: clean up, don't linger

    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        print(f"reaper: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    while child.poll() is None and not stop["signal"]:
        time.sleep(0.05)
    if stop["signal"]:
        kill_tree()
        child.wait()
        return 128 + stop["signal"]
    left = kill_tree()
    if left:
        print(
            f"reaper: stopped {left} process(es) left behind by the job",
            file=sys.stderr,
            flush=True,
        )
    rc = child.returncode
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
