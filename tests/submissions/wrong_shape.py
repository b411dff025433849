"""Bad submission: the recorded kwargs do not match the weights (width 8 vs 16)."""

import torch

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    trained = models.build("resnet_cifar", width=16)
    torch.save(
        {"arch": "resnet_cifar", "kwargs": {"width": 8}, "state_dict": trained.state_dict()},
        "checkpoint.pt",
    )
dist.shutdown()
