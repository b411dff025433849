"""Bad submission: a deadlock between ranks; each waits to receive from the other."""

import torch
import torch.distributed as tdist

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
other = 1 - info.rank
buf = torch.zeros(1)
print(f"rank {info.rank}: waiting for rank {other}", flush=True)
tdist.recv(buf, src=other)  # both ranks receive first: nobody ever sends
tdist.send(buf, dst=other)
