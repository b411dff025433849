"""Lab 7's sizes by profile, written once: what each notebook and the defaults of the
scripts it launches run.

The scripts' model options default to :data:`lab_utils.parallel.MODEL`; notebook 1 runs
a smaller character transformer on the slow link (its step must be short next to the
link's time), so its sizes are here and reach the script with ``SLOW_LINK.args(...)``."""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_slow_link: scripts/allreduce_sweep.py inside lab_utils.slow_link.
SLOW_LINK = Settings(
    # Link rates (Mbit/s) measured one after the other in one job; None: the same
    # loopback unshaped
    rates=By(quick=[50, None], cpu=[50, 200, 800, None], gpu=[50, 200, 800, None]),
    # float32 payload of each all-reduce
    sizes_kb=By(
        quick=[16, 64, 128, 256],
        cpu=[4, 16, 64, 128, 256, 512, 1024, 2048, 4096],
        gpu=[4, 16, 64, 128, 256, 512, 1024, 2048, 4096],
    ),
    repeats=By(quick=3, cpu=5, gpu=5),  # timed rounds, the order alternating
    max_seconds=By(quick=0.1, cpu=0.3, gpu=0.3),  # sizes slower than this at a rate are left out
    # the character transformer of the DDP steps
    d_model=By(quick=32, cpu=64, gpu=64),
    layers=By(quick=2, cpu=4, gpu=4),
    heads=4,
    seq_len=32,
    batch_size=By(quick=16, cpu=32, gpu=32),
    n_chars=200000,
    bucket_kb=By(quick=32, cpu=256, gpu=256),  # DDP's bucket cap: a few buckets to overlap
)

# The defaults of scripts/allreduce_sweep.py run by hand (notebook 1 passes its own).
SWEEP = Settings(
    sizes_kb=By(
        quick=[4, 16, 64, 256, 512],
        cpu=[4, 16, 64, 128, 256, 512, 1024, 2048, 4096],
        gpu=[4, 16, 64, 256, 1024, 4096, 16384, 65536],
    ),
    repeats=By(quick=3, cpu=5, gpu=10),  # rounds timed
    max_seconds=By(quick=0.1, cpu=0.3, gpu=0.3),
)
