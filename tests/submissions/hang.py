"""Bad submission: every rank hangs, and each starts a detached child that tries to
outlive the job (its own session, a command line without the working directory)."""

import os
import subprocess
import sys
import time

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
# A child in a session of its own, outside the working directory.
subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(3600)"],
    start_new_session=True,
    cwd="/",
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
print(f"rank {info.rank}: started helper, pid {os.getpid()}; now waiting forever", flush=True)
while True:
    time.sleep(1)
