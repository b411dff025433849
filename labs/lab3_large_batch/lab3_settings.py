"""Lab 3's sizes by profile, written once: what its notebooks, ``experiments.py``,
``science.py``, ``scripts/train_large_batch.py`` and their tests run.

``quick`` checks that the code runs (seconds, numbers mean little); ``cpu`` is the
recorded science on Fashion-MNIST with an MLP (minutes on 2 cores); ``gpu`` is
CIFAR-10 with the ResNet-style net. A notebook's cell tagged ``parameters`` reads
these (``S = lab3_settings.REGULARISE.of()``) and names them.
"""

from __future__ import annotations

from lab_utils.settings import By, Settings

# experiments.Setup, what every run of a profile shares: the fields that differ by
# profile (the others are the dataclass's defaults). Read by experiments.setup_for.
SETUP = Settings(
    dataset=By(quick="fashion-mnist", cpu="fashion-mnist", gpu="cifar10"),
    arch=By(quick="mlp", cpu="mlp", gpu="resnet_cifar"),
    model_kwargs=By(quick={"hidden": (64,)}, cpu={"hidden": (256, 128)}, gpu={"width": 32}),
    # training images: every batch size used divides an epoch (57 344 = 7 × 8192)
    n_train=By(quick=4096, cpu=57344, gpu=49152),
    n_val=By(quick=512, cpu=2656, gpu=848),  # the rest of the training set: chooses LRs
    n_test=By(quick=1000, cpu=None, gpu=None),  # None: the whole test set
    epochs=By(quick=2, cpu=8, gpu=16),
    base_batch=By(quick=32, cpu=64, gpu=128),
    base_lr=By(quick=0.02, cpu=0.01, gpu=0.05),
    weight_decay=By(quick=0.0, cpu=0.0, gpu=5e-4),
    augment=By(quick=False, cpu=False, gpu=True),
    # quick: the largest batch (×16 = 512) still makes 16 updates, so curves are curves
    largest_ratio=By(quick=16, cpu=128, gpu=64),
    # of each LR grid, the rates claim 3 reads (None: all); cpu: chosen SGD 0.226 (the
    # largest), LARS 4 (the smallest), LAMB 0.08, with their neighbours
    claim_lrs=By(
        quick=None,
        cpu={"sgd": (1, 2), "lars": (0, 1), "lamb": (0, 1, 2)},
        gpu=None,
    ),
)

# science.py (`make science`): seeds per configuration.
SCIENCE = Settings(seeds=By(quick=1, cpu=2, gpu=2))

# 03_regularise_grow_recipe: the BatchNorm network of the ghost-BN runs (what it changes
# in SETUP; the MLP of the other runs has no BatchNorm), the batch trained longer, and
# how long the data-parallel recipe run may take.
REGULARISE = Settings(
    bn_setup=By(
        quick={
            "arch": "fmnist_cnn",
            "model_kwargs": {"width": 4, "batch_norm": True},
            "n_train": 1024,
        },
        cpu={"arch": "fmnist_cnn", "model_kwargs": {"width": 8, "batch_norm": True}, "epochs": 4},
        gpu={},  # the ResNet already has BatchNorm
    ),
    longer_factor=By(quick=2, cpu=4, gpu=4),  # batch × this, trained 1, 2, … × longer
    recipe_timeout=By(quick=180, cpu=900, gpu=900),  # seconds
)

# scripts/train_large_batch.py's defaults when it is run by hand (a notebook passes the
# setup's epochs, base batch and LR): named as its options (RECIPE.args(...)).
RECIPE = Settings(
    epochs=By(quick=2, cpu=4, gpu=8),
    batch_per_worker=By(quick=64, cpu=256, gpu=512),
    base_batch=By(quick=32, cpu=64, gpu=64),  # the batch size base_lr was tuned for
    base_lr=By(quick=0.02, cpu=0.01, gpu=0.01),
    n_train=By(quick=2048, cpu=57344, gpu=0),  # training images (0: all)
    n_test=By(quick=1000, cpu=0, gpu=0),  # test images (0: all)
)
