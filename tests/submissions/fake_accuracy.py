"""Bad submission: claims a great accuracy (printed and as a metric) but saves an
untrained model."""

import torch

from lab_utils import dist, gloo_exit, metrics, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
dist.print0("epoch 1/1  loss 0.0100  acc 99.90%")
dist.print0("test accuracy 99.90% on 10000 images")
metrics.emit({"event": "final", "test_acc": 0.999})
if info.is_main:
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("resnet_cifar", width=8))
dist.shutdown()
