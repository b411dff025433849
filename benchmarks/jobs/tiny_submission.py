"""A submission that trains for a second or two: what the grading benchmark's quick mode
grades, to prove the grading path without the minutes a reference solution takes.

Data-parallel logistic regression: a fixed number of DistributedDataParallel steps on
each rank's shard of the training split (enough all-reduces for the grader's
data-parallel check), then rank 0 saves ``checkpoint.pt``. Its run time does not
depend on the ``--budget`` the grader passes.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import data, gloo_exit, models
from lab_utils import dist as labdist
from lab_utils.loader import TensorLoader
from lab_utils.profile import script_parser

STEPS = 60  # all-reduces per rank: the grader needs 4
# The grader reads each rank's socket counters every 0.5 s while the job runs, and they
# vanish with the connection: 60 steps take a fraction of a second, so the connections
# stay open this long after them, for several readings to see every byte exchanged.
HOLD_S = 2.0
BATCH = 64


def main() -> None:
    p = script_parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic-cifar10", help="the target's dataset")
    p.add_argument("--budget", type=float, default=None, help="given by the grader; unused")
    args = p.parse_args()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    torch.manual_seed(0)
    ds = data.load(args.dataset)
    channels, size = ds.x_train.shape[1], ds.x_train.shape[-1]
    model = models.build(
        "linear", in_channels=channels, image_size=size, num_classes=len(ds.classes)
    )
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loader = TensorLoader.from_dataset(
        ds, "train", BATCH, shuffle=True, rank=info.rank, world_size=info.world_size
    )
    steps = 0
    while steps < STEPS:  # the same number of steps on every rank
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if steps == STEPS:
                break
    if info.is_main:
        models.save("checkpoint.pt", model)
    labdist.print0(f"{steps} steps, last loss {loss.item():.3f}")
    time.sleep(HOLD_S)
    labdist.shutdown()


if __name__ == "__main__":
    main()
