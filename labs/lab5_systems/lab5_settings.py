"""Lab 5's sizes by profile, written once: what each notebook (and the scripts it
launches) runs, by the notebook it sizes. A notebook's ``parameters`` cell reads its
:class:`Settings` (``S = lab5_settings.HOGWILD.of()``) and names what it uses."""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_parameter_server: scripts/param_server.py, synchronous and asynchronous.
PARAMETER_SERVER = Settings(
    workers=By(quick=2, cpu=2, gpu=4),  # workers of the sync/async comparison
    steps=By(quick=30, cpu=300, gpu=600),  # gradients each worker pushes
    n_train=By(quick=4000, cpu=20000, gpu=60000),
    delay=0.1,  # seconds of simulated compute per step in section 3 (a sleep)
    delay_workers=By(quick=3, cpu=4, gpu=4),  # equal workers of section 3
    straggler=3,  # section 3's slow worker computes this many times longer per step
    delay_steps=By(quick=6, cpu=60, gpu=60),  # per worker in section 3 (a multiple of straggler)
    sweep=By(quick=[1, 2], cpu=[1, 2, 4], gpu=[1, 2, 4, 8]),  # workers, the throughput curve
    sweep_steps=By(quick=30, cpu=100, gpu=200),  # gradients per worker, every point of the sweep
)

# 02_adam_on_server: the replayed synchronous run.
ADAM = Settings(
    workers=By(quick=2, cpu=2, gpu=4),
    steps=By(quick=5, cpu=40, gpu=40),  # synchronous steps of the replayed run
    hidden=64,  # hidden units of the MLP
    n_train=By(quick=2000, cpu=10000, gpu=10000),
)

# 03_hogwild: scripts/hogwild.py.
HOGWILD = Settings(
    workers=By(quick=2, cpu=2, gpu=4),  # processes sharing the model
    steps=By(quick=150, cpu=1500, gpu=3000),  # updates per process
    n_train=By(quick=5000, cpu=30000, gpu=60000),
)

# 04_easgd: scripts/easgd.py.
EASGD = Settings(
    workers=By(quick=2, cpu=2, gpu=4),
    taus=By(quick=[1, 8], cpu=[1, 4, 16], gpu=[1, 4, 16, 64]),  # local steps between rounds
    steps=By(quick=64, cpu=800, gpu=2000),  # local steps per worker
    n_train=By(quick=4000, cpu=20000, gpu=60000),
    eval_every=By(quick=4, cpu=2, gpu=2),  # rounds between evaluations of the centre
)

# 05_graphs: eager against compiled training steps.
GRAPHS = Settings(
    backend=By(quick="aot_eager", cpu="inductor", gpu="inductor"),  # torch.compile backend
    batch=By(quick=64, cpu=256, gpu=1024),
    steps=By(quick=10, cpu=200, gpu=500),  # timed training steps per variant
)

# 06_fault_tolerance: scripts/elastic_train.py under torchrun --max-restarts 1.
FAULT_TOLERANCE = Settings(
    steps=By(quick=60, cpu=400, gpu=800),  # global steps of training
    ckpt_every=By(quick=20, cpu=50, gpu=100),  # steps between checkpoints
    kill_at=By(quick=45, cpu=390, gpu=790),  # the step at which rank 1 is killed
    # More intervals to time (one as long as the run: no checkpoint before the kill, redo
    # it all). None divides kill_at: a checkpoint due at the very step of the kill would
    # race with it.
    intervals=By(quick=[], cpu=[25, 100, 400], gpu=[25, 200, 800]),
    n_train=By(quick=4000, cpu=20000, gpu=60000),
)
