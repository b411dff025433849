"""Bad submission: writes the checkpoint outside its working directory and leaves
a symbolic link to it as checkpoint.pt."""

import os
from pathlib import Path

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    elsewhere = Path.cwd().parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    models.save(elsewhere / "checkpoint.pt", models.build("resnet_cifar", width=8))
    os.symlink(elsewhere / "checkpoint.pt", "checkpoint.pt")
dist.shutdown()
