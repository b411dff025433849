"""Hostile submission: floods its output (100 MB of long lines per rank, no pause), then
saves an untrained model."""

import sys

import torch

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
line = "x" * 1999 + "\n"
lines = 0
for _ in range(50_000 // 50):
    sys.stdout.write(line * 50)
    lines += 50
sys.stdout.flush()
print(f"FLOODED {lines} lines of {len(line)} bytes", flush=True)
if info.is_main:
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
