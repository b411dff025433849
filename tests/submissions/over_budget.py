"""Bad submission: saves a valid checkpoint, but only after the time budget."""

import argparse
import os
import time

import psutil
import torch

from lab_utils import dist, gloo_exit, models

p = argparse.ArgumentParser()
p.add_argument("--budget", type=float, required=True)
args, _ = p.parse_known_args()
gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
# The launcher started just before us: finish 2 s past the budget, inside the grace.
launched = psutil.Process(os.getppid()).create_time()
time.sleep(max(0.0, launched + args.budget + 2 - time.time()))
if info.is_main:
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("resnet_cifar", width=8))
dist.shutdown()
