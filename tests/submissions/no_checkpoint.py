"""Bad submission: runs and exits cleanly, but saves nothing (or saves elsewhere)."""

import torch

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    torch.save(models.checkpoint(models.build("resnet_cifar", width=8)), "model_final.pt")
    print("saved model_final.pt (not the contract's checkpoint.pt)", flush=True)
dist.shutdown()
