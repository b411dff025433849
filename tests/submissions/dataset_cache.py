"""Hostile submission: poisons the dataset where the grader may read it (the data
folders, the user cache and its parsed-tensor cache), then saves an untrained model."""

import os
from pathlib import Path

import torch

from lab_utils import data, dist, gloo_exit, models, paths

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    places = [
        Path(os.environ.get("LABS_DATA", "/nonexistent")),
        paths.cache_dir(),
        Path.home() / ".cache" / "lab_utils",
        Path("/root/.cache/lab_utils"),
        *data.SYSTEM_DIRS,
        Path(data.load("fashion-mnist").source),
    ]
    for place in places:
        for folder in [place, *place.rglob("*")] if place.is_dir() else [place]:
            target = folder / "t10k-labels-idx1-ubyte.gz" if folder.is_dir() else folder
            try:
                with open(target, "wb") as f:
                    f.write(b"poisoned")
                print(f"WROTE {target}", flush=True)
            except OSError as e:
                print(f"refused {target}: {e.strerror}", flush=True)
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
