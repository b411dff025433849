"""Hostile submission: copies a trained checkpoint from elsewhere on the machine
(the path it was told, then any checkpoint.pt it can find) instead of training."""

import glob
import os
import shutil

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    candidates = [os.environ.get("FIXTURE_STOLEN_CHECKPOINT", "/nonexistent")]
    for pattern in (
        "/tmp/**/checkpoint*.pt",
        "/tmp/**/stolen*.pt",
        "/root/**/checkpoint*.pt",
        "/work/**/checkpoint*.pt",
        "/home/**/checkpoint*.pt",
    ):
        candidates += glob.glob(pattern, recursive=True)
    for path in candidates:
        if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath("checkpoint.pt"):
            shutil.copyfile(path, "checkpoint.pt")
            print(f"COPIED {path}", flush=True)
            break
    else:
        print("no checkpoint to copy", flush=True)
dist.shutdown()
