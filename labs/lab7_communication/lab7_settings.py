"""Lab 7's sizes by profile, written once: what each notebook and the defaults of the
scripts it launches run.

The scripts' model options default to :data:`lab_utils.parallel.MODEL`; notebook 1 runs
a smaller character transformer on the slow link (its step must be short next to the
link's time), so its sizes are here; the notebook names them and passes them to the script with
``lab_utils.settings.options(...)``."""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_slow_link: scripts/allreduce_sweep.py inside lab_utils.slow_link.
SLOW_LINK = Settings(
    # Link rates (Mbit/s) measured one after the other in one job; None: the same
    # loopback unshaped
    rates=By(quick=[50, None], cpu=[50, 200, 800, None], gpu=[50, 200, 800, None]),
    # float32 payload of each all-reduce
    sizes_kb=By(  # quick: three sizes of at least 4 bursts on the link at 50 Mbit/s, to fit
        quick=[16, 64, 128, 192, 256],
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

# 04_diloco: scripts/diloco.py (DDP with AdamW, DiLoCo and Streaming DiLoCo, and the
# outer-lr-1 = local SGD check, in one job). Every --periods H must divide --steps.
DILOCO = Settings(
    steps=By(quick=8, cpu=96, gpu=256),  # inner steps of every run, the same batches
    periods=By(quick=[1, 4], cpu=[1, 8, 32], gpu=[1, 8, 32]),  # DiLoCo's H
    fragments=By(quick=2, cpu=4, gpu=4),  # Streaming DiLoCo's fragments (for H ≥ this)
    check_period=By(quick=4, cpu=8, gpu=8),  # the H of the outer-lr-1 = local SGD check
    # torchft's train_diloco.py (lines 165-170): AdamW lr 4e-4 inside, SGD(lr=0.7,
    # momentum=0.9, nesterov=True) outside; the inner lr here is the course's Adam lr
    inner_lr=1e-3,
    outer_lr=0.7,
    outer_momentum=0.9,
    # the character transformer (smaller in quick: the job runs 8 trainings)
    d_model=By(quick=32, cpu=64, gpu=256),
    layers=By(quick=2, cpu=4, gpu=4),
)

# 05_what_to_use_when: scripts/compare_methods.py inside lab_utils.slow_link, every
# method at every rate in one job (their defaults, too).
COMPARE = Settings(
    # Link rates (Mbit/s) run one after the other in one job; None: the same loopback unshaped
    rates=By(quick=[10, None], cpu=[20, 100, None], gpu=[20, 100, None]),
    # the character transformer: small enough that a step's computation is short next to
    # its all-reduce on the slow rates
    d_model=By(quick=32, cpu=64, gpu=64),
    layers=By(quick=2, cpu=4, gpu=4),
    heads=4,
    seq_len=32,
    batch_size=16,
    n_chars=200000,
    steps=By(quick=8, cpu=32, gpu=32),  # training steps of every method, the same batches
    period=By(quick=4, cpu=8, gpu=8),  # H of local SGD and DiLoCo
)

# 02_compressed_gradients: scripts/compressed_ddp.py inside lab_utils.slow_link, every
# hook unshaped and at one slow rate in one job; the model is parallel.MODEL's.
HOOKS = Settings(
    hooks=["none", "fp16", "bf16", "powersgd"],
    steps=6,  # training steps of each hook, the same batches
    start_iter=2,  # PowerSGD's first compressed step (the steps before it: in full)
    rank=1,  # PowerSGD's matrix approximation rank r
    # Link rates (Mbit/s) one after the other; None: the same loopback unshaped. The slow
    # one puts an uncompressed step's all-reduce well above its computation.
    rates=By(quick=[None, 100], cpu=[None, 100], gpu=[None, 1000]),
)

# 03_local_sgd: scripts/local_sgd.py inside lab_utils.slow_link, DDP and local SGD for
# each H, unshaped and at one slow rate in one job.
LOCAL_SGD = Settings(
    steps=16,  # training steps of each run, the same batches
    periods=[1, 4],  # the H of local SGD
    lr=0.2,  # plain SGD's learning rate (no momentum), for DDP and local SGD alike
    rates=By(quick=[None, 20], cpu=[None, 50], gpu=[None, 50]),
    # the character transformer: smaller than parallel.MODEL's, so that on the slow rate
    # an average's all-reduce, not the step's computation, sets the time
    d_model=By(quick=32, cpu=64, gpu=64),
    layers=By(quick=2, cpu=4, gpu=4),
)
