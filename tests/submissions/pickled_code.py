"""Bad submission: the checkpoint is a pickle that runs code when loaded unsafely.

Loading it without ``weights_only=True`` would create the file named by
``$FIXTURE_PWNED_MARKER``; the grader must refuse it without running anything.
"""

import os

import torch

from lab_utils import dist, gloo_exit, models

MARKER = os.environ.get("FIXTURE_PWNED_MARKER", os.path.join(os.getcwd(), "pwned"))


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    model = models.build("resnet_cifar", width=8)
    torch.save(
        {
            "arch": "resnet_cifar",
            "kwargs": model.arch_spec["kwargs"],
            "state_dict": model.state_dict(),
            "extra": Payload(),
        },
        "checkpoint.pt",
    )
dist.shutdown()
