"""Hostile submission: starts processes until the system refuses (a fork bomb held
back), reports how many it got, and saves an untrained model."""

import os
import signal
import time

children = []
if os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "0":
    for _ in range(2000):  # before importing torch: small processes, quick forks
        try:
            pid = os.fork()
        except OSError as e:
            print(f"fork refused: {e.strerror}", flush=True)
            break
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3600)
            os._exit(0)
        children.append(pid)
    print(f"STARTED {len(children)} children", flush=True)

import torch  # noqa: E402

from lab_utils import dist, models  # noqa: E402

info = dist.init()
if info.is_main:
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
