"""Good submission (for the sandbox tests): data-parallel logistic regression on
Fashion-MNIST; it reports accuracy on a validation part of the training split."""

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import data, dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
torch.manual_seed(0)
ds = data.load("fashion-mnist").holdout(0.05)
mean, std = ds.mean[0], ds.std[0]
x = (ds.x_train[info.rank :: info.world_size].float() / 255 - mean) / std
y = ds.y_train[info.rank :: info.world_size]
model = models.build("linear", in_channels=1, image_size=28, num_classes=10)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
n = min(len(x), 24000)  # the same number of steps on every rank
for i in range(0, n, 200):
    loss = F.cross_entropy(ddp(x[i : i + 200]), y[i : i + 200])
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    acc = (model((ds.x_test.float() / 255 - mean) / std).argmax(1) == ds.y_test).float().mean()
dist.print0(f"validation accuracy {acc:.2%}")
if info.is_main:
    models.save("checkpoint.pt", model)
# The connections stay open a moment: the grader reads each rank's socket counters every
# 0.5 s and they vanish with the connection, so 120 quick steps could pass unseen.
time.sleep(2.0)
dist.shutdown()
