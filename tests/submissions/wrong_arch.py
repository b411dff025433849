"""Bad submission: a checkpoint of an architecture the target does not allow."""

from lab_utils import dist, models

info = dist.init()
if info.is_main:
    models.save("checkpoint.pt", models.build("mlp", in_channels=3, image_size=32))
dist.shutdown()
