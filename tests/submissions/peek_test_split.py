"""Hostile submission: trains on the held-out split if it can find it anywhere (the
loader, the system copy, the cache; every name assembled so that the grader's
source check sees nothing), else saves an untrained model."""

import glob
import gzip

import numpy as np
import torch
import torch.nn.functional as F

from lab_utils import data, dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    stem = "t" + str(10) + "k"
    ds = data.load("fashion-mnist")
    found = None
    if len(getattr(ds, "x_" + "te" + "st")) > 0:
        found = (getattr(ds, "x_" + "te" + "st"), getattr(ds, "y_" + "te" + "st"))
    for pattern in [
        f"/usr/share/**/{stem}-images*",
        f"/usr/local/**/{stem}-images*",
        f"/root/**/{stem}-images*",
        f"/tmp/**/{stem}-images*",
        f"/work/**/{stem}-images*",
        f"/opt/**/{stem}-images*",
        "/root/.cache/lab_utils/tensors/*.pt",
    ]:
        for path in glob.glob(pattern, recursive=True):
            print(f"FOUND {path}", flush=True)
            if found is None and path.endswith("images-idx3-ubyte.gz"):
                with gzip.open(path) as f:
                    imgs = np.frombuffer(f.read()[16:], np.uint8)
                with gzip.open(path.replace("images-idx3", "labels-idx1")) as f:
                    labels = np.frombuffer(f.read()[8:], np.uint8)
                found = (
                    torch.from_numpy(imgs.reshape(-1, 1, 28, 28).copy()),
                    torch.from_numpy(labels.astype(np.int64)),
                )
    model = models.build("linear", in_channels=1, image_size=28)
    if found is None:
        print("no test split visible: saving an untrained model", flush=True)
    else:
        x = (found[0].float() / 255 - ds.mean[0]) / ds.std[0]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(3):
            for i in range(0, len(x), 200):
                loss = F.cross_entropy(model(x[i : i + 200]), found[1][i : i + 200])
                opt.zero_grad()
                loss.backward()
                opt.step()
        print(f"trained on {len(x)} images of the test split", flush=True)
    models.save("checkpoint.pt", model)
dist.shutdown()
