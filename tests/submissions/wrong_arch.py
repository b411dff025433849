"""Bad submission: a checkpoint of an architecture the target does not allow."""

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    models.save("checkpoint.pt", models.build("mlp", in_channels=3, image_size=32))
dist.shutdown()
