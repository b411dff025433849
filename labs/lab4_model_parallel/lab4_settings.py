"""Lab 4's sizes by profile, written once: what its notebooks, its scripts and their
tests run, by the notebook (or script) they size.

The character transformer's own sizes (width, heads, blocks, sequence length, batch,
steps of Labs 4, 6 and 7) are :data:`lab_utils.parallel.MODEL`; what is here is what
Lab 4 chooses on top of it: process counts, the runs' steps and blocks, and a model
that differs from ``MODEL`` where a notebook needs another (the pipelines' batch must
cut into 8 micro-batches). Each :class:`Settings` names its values as the script it
launches names its options, so a notebook builds the command line from the names its parameters cell reads them into
(``lab_utils.settings.options(steps=STEPS, ...)``) and a test with ``.args(...)``.
"""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_what_fits: the model whose state and activations are measured (MODEL's width and
# sequence length), deeper on a bigger machine, and the batches it is measured at.
WHAT_FITS = Settings(
    layers=By(quick=2, cpu=4, gpu=8),
    batches=By(quick=[2, 4, 8], cpu=[4, 8, 16, 32], gpu=[8, 16, 32, 64]),
)

# 02_pipelines, scripts/pipeline.py: MODEL's 4 blocks, a batch that m=8 cuts into 16
# sequences each in cpu/gpu.
PIPELINE = Settings(
    stages=By(quick=[2], cpu=[2, 4], gpu=[2, 4]),  # processes = pipeline stages
    microbatches=[1, 2, 4, 8],
    d_model=By(quick=96, cpu=128, gpu=512),
    seq_len=By(quick=64, cpu=64, gpu=256),
    batch_size=By(quick=32, cpu=128, gpu=128),
    repeats=3,  # timed (one process, pipeline) pairs, A B B A ...
)

# 03_tensor_parallel, scripts/tensor_parallel.py; and the timed GEMM's size.
TENSOR_PARALLEL = Settings(
    procs=2,
    layers=2,
    steps=By(quick=3, cpu=10, gpu=20),
    gemm_size=By(quick=512, cpu=1024, gpu=8192),
)

# 04_sharding, scripts/sharded.py (DDP, ZeRO-1, FSDP2) on MODEL's 4 blocks.
SHARDING = Settings(
    procs=By(quick=[2], cpu=[2, 4], gpu=[2]),
    steps=By(quick=3, cpu=5, gpu=10),
)

# 05_hybrid, scripts/hybrid.py: a (data × tensor) mesh of procs / tp × tp.
HYBRID = Settings(
    procs=4,
    tp=2,
    layers=2,
    steps=By(quick=2, cpu=5, gpu=10),
)

_TORCH_SCHEDULES = ["1f1b", "interleaved", "interleaved_zb", "zbv"]

# 06_pipeline_schedules, scripts/pipeline_schedules.py. Processes, cpu: 2, one per core
# of a 2-core laptop: with more processes than cores the operating system time-slices
# them, and a block's duration would include the time it waited for a core.
PIPELINE_SCHEDULES = Settings(
    stages=By(quick=[2], cpu=[2], gpu=[2, 4]),
    schedules=By(
        quick=_TORCH_SCHEDULES,
        cpu=[*_TORCH_SCHEDULES, "dualpipev"],
        gpu=[*_TORCH_SCHEDULES, "dualpipev"],
    ),
    microbatches=By(quick=[4], cpu=[4, 8], gpu=[4, 8]),
    batch_size=By(quick=16, cpu=64, gpu=128),
    repeats=3,  # timed steps per schedule, the schedules interleaved round after round
)

# 07_sequence_context, scripts/context_parallel.py (its defaults): ring attention on
# MODEL's width.
CONTEXT = Settings(
    procs=By(quick=[2], cpu=[2, 4], gpu=[2, 4]),
    seq_lens=By(quick=[64, 128], cpu=[256, 512, 1024], gpu=[1024, 2048, 4096]),
    seq_len=By(quick=64, cpu=256, gpu=1024),  # part 1 and the equivalence check
    repeats=By(quick=2, cpu=5, gpu=5),  # timed (one process, ring) pairs, A B B A ...
)

# 08_experts, scripts/experts.py; and the router's load-balancing run in the notebook.
EXPERTS = Settings(
    procs=2,
    experts=4,
    layers=2,
    steps=By(quick=2, cpu=10, gpu=20),
    balance_steps=By(quick=30, cpu=60, gpu=60),
)

# 09_checkpoints, scripts/reshard_checkpoint.py: saved by save_procs, loaded by load_procs.
CHECKPOINTS = Settings(
    save_procs=4,
    load_procs=2,
    layers=2,
    steps=By(quick=1, cpu=5, gpu=10),
)

# 10_planner: one step of notebook 4's, 5's and 8's scripts, measured against the plan.
PLANNER = Settings(
    layers=2,
    steps=1,
    mesh=By(quick=False, cpu=True, gpu=True),  # the 2 × 2 mesh's 4 processes (section 2)
)
