"""Test job: every rank contributes rank+1; rank 0 reports the all-reduced sum."""

import sys

import torch

from lab_utils import dist, metrics

info = dist.init()
value = dist.all_reduce_sum(torch.tensor([float(info.rank + 1)]))
print(
    f"rank {info.rank}/{info.world_size} launcher={info.launcher} sum={value.item():g}", flush=True
)
metrics.emit({"sum": value.item(), "world_size": info.world_size, "launcher": info.launcher})
dist.shutdown()
sys.exit(0)
