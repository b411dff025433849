"""Lab 1's sizes by profile, written once: what its notebooks, ``steps_to_target.py``
and their tests run, by the notebook (or experiment) they size.

``quick`` shows every code path in seconds, ``cpu`` gives the real curves on a laptop
(the profile the science tests assert), ``gpu`` the larger sweeps. A notebook's cell
tagged ``parameters`` reads these (``S = lab1_settings.LINEAR.of()``) and names them.
"""

from __future__ import annotations

from lab_utils.settings import By, Settings

# 01_linear_regression: the conditioning sweep and the cost of the closed form.
LINEAR = Settings(
    n_conditions=By(quick=8, cpu=15, gpu=15),  # condition numbers swept
    cost_n=By(quick=4_000, cpu=20_000, gpu=50_000),  # rows while d grows
    cost_ds=By(
        quick=[16, 32, 64, 128, 256],
        cpu=[25, 50, 100, 200, 400, 800],
        gpu=[25, 50, 100, 200, 400, 800, 1600],
    ),  # columns swept
    cost_ns=By(
        quick=[2_000, 8_000, 32_000, 128_000],
        cpu=[2_000, 8_000, 32_000, 128_000, 512_000],
        gpu=[2_000, 8_000, 32_000, 128_000, 512_000, 2_048_000],
    ),  # rows swept
)

# 02_sgd_minibatches: the data set, the gradient-variance sweep and the decay run.
MINIBATCH = Settings(
    n_samples=By(quick=512, cpu=2048, gpu=4096),  # data set size n
    variance_batches=By(
        quick=[1, 2, 4, 8, 16, 32, 64],
        cpu=[1, 2, 4, 8, 16, 32, 64, 128],
        gpu=[1, 2, 4, 8, 16, 32, 64, 128, 256],
    ),
    variance_draws=By(quick=200, cpu=1000, gpu=2000),  # mini-batches per batch size
    decay_epochs=By(quick=20, cpu=20, gpu=40),
)

# 03_batch_size_cost, sections 1 and 2: throughput and a fixed budget of epochs.
BATCH_COST = Settings(
    throughput_batches=By(
        quick=[8, 32, 128],
        cpu=[4, 8, 16, 32, 64, 128, 256, 512, 1024],
        gpu=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
    ),
    throughput_images=By(quick=256, cpu=1024, gpu=32768),  # images per timing, 3 timings
    fixed_train=By(quick=1024, cpu=6_000, gpu=60_000),  # training images
    fixed_epochs=By(quick=1, cpu=2, gpu=4),
    fixed_batches=By(
        quick=[16, 128, 1024], cpu=[16, 64, 256, 1024], gpu=[32, 128, 512, 2048, 8192]
    ),
)

# 03_batch_size_cost, section 4, and steps_to_target.py: the fields of its ``Setup``
# that differ by profile (the others are the dataclass's defaults). ``width`` and
# ``held_out`` are also the CNN and the accuracy images of the notebook's sections 1-2.
# ``quick`` shows the code path on tiny subsets; ``cpu`` is the measured claim.
STEPS = Settings(
    target_acc=By(quick=0.55, cpu=0.80, gpu=0.80),
    n_train=By(quick=4096, cpu=60_000, gpu=60_000),
    held_out=By(quick=200, cpu=1000, gpu=2000),  # test images the accuracy is measured on
    batches=By(
        quick=(16, 64, 256),
        cpu=(8, 16, 32, 64, 128, 256, 512),
        gpu=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    ),
    seeds=By(quick=(0,), cpu=(0, 1, 2), gpu=(0, 1, 2)),  # one crossing is noisy: the median
    lr_smallest=By(quick=0.006, cpu=0.003, gpu=0.003),  # at batches[0]
    lr_max=By(quick=0.1, cpu=0.1, gpu=1.0),
    width=By(quick=8, cpu=16, gpu=16),  # channels of the CNN's first conv layer
    max_images=By(quick=8_000, cpu=200_000, gpu=2_000_000),  # give up after this many
)
