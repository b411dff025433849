"""Test job: rank 1 raises while rank 0 waits in a collective."""

import time

import torch

from lab_utils import dist

info = dist.init()
if info.rank == 1:
    time.sleep(0.5)
    raise RuntimeError("rank 1 failed on purpose (test marker 7d1e)")
dist.all_reduce_sum(torch.ones(1))  # never completes: rank 1 is gone
time.sleep(600)
