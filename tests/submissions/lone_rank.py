"""Not data-parallel: rank 0 trains alone with two threads while rank 1 exits at
once; together they look like two busy cores, but one rank did all the work."""

import os

# Rank 1 leaves before it imports torch: its CPU time is that of a bare interpreter, so
# one epoch of rank 0 (the steps of good_linear.py) is far above the quarter of the
# busiest rank under which the grader calls a rank idle, at any load.
if int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
    import torch
    import torch.nn.functional as F

    from lab_utils import data, models

    torch.set_num_threads(2)
    torch.manual_seed(0)
    ds = data.load("fashion-mnist").holdout(0.05)
    x = (ds.x_train[:24000].float() / 255 - ds.mean[0]) / ds.std[0]
    model = models.build("linear", in_channels=1, image_size=28)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(0, len(x), 100):
        loss = F.cross_entropy(model(x[i : i + 100]), ds.y_train[i : i + 100])
        opt.zero_grad()
        loss.backward()
        opt.step()
    models.save("checkpoint.pt", model)
