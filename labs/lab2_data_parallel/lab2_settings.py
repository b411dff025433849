"""Lab 2's sizes by profile, written once: what its notebooks, its scripts and their
tests run, by what they size.

:data:`TRAIN` is the training scripts' defaults (``scripts/common.py``: the options of
``train_serial.py``, ``train_ddp.py``, ``train_horovod.py`` and
``train_horovod_spark.py``), so ``torchrun train_ddp.py`` with no options runs the
profile's sizes; the others are what each notebook launches on top of them. Each
:class:`Settings` names its values as the script it launches names its options, so a
notebook builds the command line from the names its parameters cell reads them into
(``lab_utils.settings.options(steps=STEPS, ...)``) and a test with ``.args(...)``.
"""

from __future__ import annotations

from lab_utils.settings import By, Settings

# The training scripts' defaults: one process's run and its peak learning rate. The
# cpu profile's sizes are chosen so that the scaling rule holds up to 8 processes: 16
# samples per process keep an 8-process epoch at 156 steps (scripts/common.py says
# more; tests/test_lab2_scaling.py asserts it on these defaults).
TRAIN = Settings(
    dataset=By(quick="fashion-mnist", cpu="fashion-mnist", gpu="cifar10"),
    epochs=By(quick=1, cpu=2, gpu=10),
    batch_size=By(quick=32, cpu=16, gpu=256),  # per process
    lr=By(quick=0.02, cpu=0.02, gpu=0.1),  # peak rate of one process
    n_train=By(quick=2048, cpu=20000, gpu=0),  # 0: the whole training set
    n_test=By(quick=1024, cpu=5000, gpu=0),
    width=By(quick=16, cpu=16, gpu=64),  # channels of the first layer
)

# 01_collectives: the collectives demo and the timed ring all-reduce (scripts/ring_check.py).
COLLECTIVES = Settings(
    procs=4,  # ranks of the launched jobs
    sizes=By(  # float32 elements per all-reduce
        quick=[2**k for k in (8, 12, 16, 20)],
        cpu=[2**k for k in range(8, 23, 2)],
        gpu=[2**k for k in range(8, 25, 2)],
    ),
    repeats=By(quick=3, cpu=7, gpu=15),  # timed repeats per size (the median is kept)
    sim_max_ranks=By(quick=8, cpu=16, gpu=32),  # simulated ranks 2.. this for the traffic plot
)

# The CNN the short runs of notebooks 03 and 04 train, and the batch per process of
# notebooks 02 and 03 (04 weak-scales a larger one on GPUs).
_WIDTH = By(quick=16, cpu=32, gpu=64)
_BATCH = By(quick=32, cpu=64, gpu=128)

# 02_ddp: 2 processes × batch b against 1 process × batch 2b after max_steps steps
# (train_ddp.py, train_serial.py); N processes use N × lr.
EQUIVALENCE = Settings(
    dataset="fashion-mnist",
    n_train=By(quick=2048, cpu=8192, gpu=16384),
    max_steps=10,  # steps compared in the equivalence test
    batch_size=_BATCH,  # per process
    lr=0.05,  # per process
)

# 02_ddp: scripts/ddp_bench.py's defaults (bucket sizes and no_sync).
DDP_KNOBS = Settings(
    width=By(quick=32, cpu=32, gpu=64),
    batch_size=By(quick=32, cpu=64, gpu=256),
    steps=By(quick=6, cpu=20, gpu=50),  # timed steps per setting
)

# 03_horovod: train_horovod.py under horovodrun, with a timeline.
HOROVOD = Settings(
    max_steps=By(quick=8, cpu=60, gpu=200),
    batch_size=_BATCH,  # per process
    n_train=By(quick=1024, cpu=8192, gpu=16384),
    width=_WIDTH,
)

# 04_scaling: section 1's throughput (weak scaling, one thread per process) and section
# 2's accuracy against N (the scripts' TRAIN defaults, quick on fewer images).
SCALING = Settings(
    procs=By(quick=[1, 2], cpu=[1, 2, 4], gpu=[1, 2, 4]),  # process counts to compare
    max_steps=By(quick=12, cpu=60, gpu=200),  # timed training steps per run
    batch_size=By(quick=32, cpu=64, gpu=256),  # per process (weak scaling)
    width=_WIDTH,
    acc_procs=By(quick=[1, 2], cpu=[1, 2, 4, 8], gpu=[1, 2, 4, 8]),  # section 2's runs
    evals=By(quick=4, cpu=8, gpu=10),  # test-accuracy measurements per run
    acc_n_train=By(quick=1024, cpu=None, gpu=None),  # section 2's images (None: TRAIN's)
)

# 06_horovod_spark: train_horovod_spark.py, then train_horovod.py on the same data.
SPARK = Settings(
    n_train=By(quick=1024, cpu=20000, gpu=0),  # 0: the whole training set
    n_test=By(quick=512, cpu=5000, gpu=0),
    epochs=By(quick=1, cpu=2, gpu=3),
)
