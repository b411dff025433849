"""Bad submission: the loss diverges to NaN and the NaN weights are saved."""

import torch
import torch.nn.functional as F

from lab_utils import data, dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
ds = data.load("synthetic-cifar10")
torch.manual_seed(0)
model = models.build("resnet_cifar", width=8)
optimizer = torch.optim.SGD(model.parameters(), lr=float("inf"))  # diverges at once
x = ds.x_train[:32].float() / 255
y = ds.y_train[:32]
for step in range(3):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    dist.print0(f"step {step} loss {loss.item():.4f}")
if info.is_main:
    models.save("checkpoint.pt", model)
dist.shutdown()
