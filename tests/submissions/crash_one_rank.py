"""Bad submission: rank 1 raises while rank 0 waits for it in a collective."""

import time

import torch

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.rank == 1:
    time.sleep(1)
    raise RuntimeError("rank 1 lost its data shard (fixture crash_one_rank)")
dist.all_reduce_sum(torch.ones(1))  # never completes: rank 1 is gone
time.sleep(3600)
