"""Bad submission: a checkpoint far larger than the target allows (here also not a
torch file at all, so a size check that came after loading would say otherwise)."""

from lab_utils import dist, gloo_exit

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    with open("checkpoint.pt", "wb") as f:
        f.truncate(64 * 2**20)
dist.shutdown()
