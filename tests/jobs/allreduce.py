"""Test job: every rank contributes rank+1; rank 0 reports the all-reduced sum."""

import sys

import torch

from lab_utils import dist, gloo_exit, metrics

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
value = dist.all_reduce_sum(torch.tensor([float(info.rank + 1)]))
print(
    f"rank {info.rank}/{info.world_size} launcher={info.launcher} sum={value.item():g}", flush=True
)
metrics.emit({"sum": value.item(), "world_size": info.world_size, "launcher": info.launcher})
dist.shutdown()
sys.exit(0)
