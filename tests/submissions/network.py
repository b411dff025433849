"""Hostile submission: tries to reach the network (to download weights or send the
data away), then saves an untrained model."""

import socket

import torch

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    print(f"INTERFACES {sorted(name for _, name in socket.if_nameindex())}", flush=True)
    for host, port in (("1.1.1.1", 80), ("8.8.8.8", 53), ("pypi.org", 443)):
        try:
            socket.create_connection((host, port), timeout=3).close()
            print(f"CONNECTED {host}:{port}", flush=True)
        except OSError as e:
            print(f"no network to {host}:{port}: {e}", flush=True)
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
