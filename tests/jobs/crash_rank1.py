"""Test job: rank 1 raises while rank 0 waits in a collective."""

import time

import torch

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.rank == 1:
    time.sleep(0.5)
    raise RuntimeError("rank 1 failed on purpose (test marker 7d1e)")
dist.all_reduce_sum(torch.ones(1))  # never completes: rank 1 is gone
time.sleep(600)
