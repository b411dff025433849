"""Lab 6's sizes by profile, written once: what each notebook (and the scripts it
launches) runs, by the notebook it sizes.

The character transformer's own sizes (width, blocks, sequence length, batch) are
:data:`lab_utils.parallel.MODEL` where a notebook runs that model as Labs 4 and 7 do;
what is here is what Lab 6 chooses on top of it, or instead of it where a notebook
measures another model (01-03's shallower, smaller batches)."""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_flops_mfu_roofline (MODEL's width and sequence length).
FLOPS = Settings(
    layers=By(quick=2, cpu=4, gpu=8),
    heads=4,
    batch=By(quick=8, cpu=16, gpu=32),
    cnn_width=By(quick=8, cpu=16, gpu=32),
    cnn_batch=By(quick=32, cpu=128, gpu=512),
    matmul_n=By(quick=512, cpu=1024, gpu=8192),  # side of the peak-measuring matmul
    copy_mib=By(quick=16, cpu=128, gpu=1024),  # size of the bandwidth-measuring copy
    repeats=By(quick=3, cpu=7, gpu=20),  # timed runs of each measurement
)

# 02_mixed_precision (MODEL's width and sequence length).
PRECISION = Settings(
    layers=By(quick=2, cpu=4, gpu=8),
    heads=4,
    batch=By(quick=8, cpu=16, gpu=32),
    steps=By(quick=6, cpu=20, gpu=100),  # training steps of each precision
    rounds=By(quick=3, cpu=5, gpu=10),  # interleaved timing rounds
    additions=By(quick=3000, cpu=10000, gpu=10000),
    # (d_model, layers, batch, seq_len) of the fp16 + GradScaler run: small on a CPU, whose
    # fp16 matrix products are slow without fp16 instructions (section 5 prints the step time)
    scaler_shape=By(quick=(64, 2, 8, 32), cpu=(64, 2, 8, 32), gpu=(512, 8, 32, 256)),
    scaler_steps=By(quick=14, cpu=14, gpu=24),
)

# 03_recomputation (MODEL's sequence length; a narrower model than MODEL on a GPU).
RECOMPUTATION = Settings(
    d_model=By(quick=64, cpu=128, gpu=256),
    layers=By(quick=2, cpu=4, gpu=8),
    heads=4,
    batch=By(quick=8, cpu=16, gpu=16),
    rounds=By(quick=3, cpu=6, gpu=10),  # interleaved timing rounds
)

# 04_profiling: scripts/profile_ddp.py on MODEL, at DDP bucket caps (MiB).
PROFILING = Settings(
    caps=By(
        quick=[0.01, 0.1, 25.0], cpu=[0.01, 0.05, 0.25, 1.0, 25.0], gpu=[1.0, 5.0, 25.0, 100.0]
    ),
    active=By(quick=2, cpu=3, gpu=5),  # recorded steps (after one warm-up step)
)

# 05_ddp_by_hand and the defaults of scripts/ddp_by_hand.py, on MODEL.
DDP_BY_HAND = Settings(
    bucket_kb=By(quick=[16, 128, 1024], cpu=[32, 256, 1024, 4096], gpu=[256, 1024, 4096, 25600]),
    repeats=By(quick=3, cpu=8, gpu=10),  # timed rounds, the order alternating
    steps=By(quick=3, cpu=5, gpu=10),  # training steps of the equivalence check
)

# 06_predicted_bytes: scripts/predicted_bytes.py on MODEL.
PREDICTED_BYTES = Settings(microbatches=2)
