"""Hostile submission: starts a plain daemon in a new session (setsid), with a clean
environment and the root as its folder, and exits without a checkpoint."""

import os
import subprocess
import sys

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
marker = os.environ.get("FIXTURE_DAEMON_MARKER", "lab-grade-fixture-daemon")
subprocess.Popen(
    [sys.executable, "-c", f"import time  # {marker}\nwhile True: time.sleep(1)"],
    start_new_session=True,
    cwd="/",
    env={},
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
print(f"rank {info.rank}: daemon started", flush=True)
dist.shutdown()
