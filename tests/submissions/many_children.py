"""Hostile submission: starts processes until the system refuses (a fork bomb held
back), reports how many it got, and saves an untrained model. (The bomb runs once
both ranks have joined, and its children are then ended, so that the verdict does
not depend on which rank met the limit first.)"""

import subprocess
import sys

import torch

from lab_utils import dist, gloo_exit, models

BOMB = """
import os, signal, time
children = []
for _ in range(2000):
    try:
        pid = os.fork()
    except OSError as e:
        print(f"fork refused: {e.strerror}", flush=True)
        break
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    children.append(pid)
print(f"STARTED {len(children)} children", flush=True)
for pid in children:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    subprocess.run([sys.executable, "-c", BOMB], check=False, timeout=120)
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
