"""Hostile submission: a daemon that keeps re-forking away from its parent, in a
session of its own, with a clean environment (no grader tag) and a command line that
names neither the job nor its folder; the job then exits without a checkpoint."""

import os
import sys

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    marker = os.environ.get("FIXTURE_DAEMON_MARKER", "lab-grade-fixture-daemon")
    code = f"""
import os, time
os.setsid()
while True:  # {marker}
    if os.fork():
        os._exit(0)  # the parent leaves; the child carries on, re-parented
    time.sleep(0.2)
"""
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c", code], {})
    print("daemon started", flush=True)
dist.shutdown()
