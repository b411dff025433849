"""Lab 3's experiments: train one configuration with the lab_utils Trainer.

The notebooks and ``science.py`` describe a run with :class:`Run` (batch size,
learning rate, optimiser, warm-up, batch growth, ghost BN, gradient noise) on top of
the profile's shared :class:`Setup` (data, model, epochs, base batch and learning
rate, step decay) and call :func:`train`. Every run on a profile uses the same
training images, test images and initial weights for a given seed, so the only
difference between two runs is what the :class:`Run` says.

The training set is cut so that every batch size used divides an epoch exactly (for
example 57 344 = 7 × 8192); the images left over form the validation split that
chooses learning rates, and the test split is only used to report.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import lab3_settings  # beside this file: the sizes of each profile
from lab_utils import data, models, optim
from lab_utils.loader import TensorLoader
from lab_utils.profile import Profile
from lab_utils.profile import device as default_device
from lab_utils.train import Trainer

OPTIMIZERS = ("sgd", "lars", "lamb", "larc", "novograd")


@dataclass(frozen=True)
class Setup:
    """What every run of a profile shares."""

    dataset: str = "fashion-mnist"
    arch: str = "mlp"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    n_train: int = 57344
    n_val: int = 2656
    n_test: int | None = None
    epochs: int = 8
    base_batch: int = 64
    base_lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    decay: str = "cosine"  # the learning-rate decay: cosine, or step (÷ 1/gamma at decay_at)
    decay_at: tuple[float, ...] = (0.5, 0.75)  # fractions of training, for step decay
    gamma: float = 0.25  # the step decay; batch growth multiplies the batch by 1/gamma
    micro_batch: int | None = None  # emulate larger batches by gradient accumulation
    augment: bool = False
    naive_ratio: int = 16  # "large batch" = this × base_batch
    largest_ratio: int = 128  # the largest batch, where LARS/LAMB meet SGD
    warmup_epochs: float = 1.0
    # the learning rates tried at the largest batch: three each, a factor 2 apart
    lars_lrs: tuple[float, ...] = (4.0, 8.0, 16.0)
    lamb_lrs: tuple[float, ...] = (0.04, 0.08, 0.16)
    larc_lrs: tuple[float, ...] = (
        0.2,
        0.4,
        0.8,
    )  # LARC (clip): γ, the ceiling of every layer's rate
    novograd_lrs: tuple[float, ...] = (0.005, 0.01, 0.02)
    sgd_lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)  # × the sqrt-scaled base LR
    # what the LARS/LAMB-vs-SGD claim reads of each grid (positions in lr_grid): the rate
    # the full grid chose on the validation split and its neighbours in the grid, which
    # show it is the best one (science_cpu.json records the full grid); None: every rate
    claim_lrs: dict[str, tuple[int, ...]] | None = None

    def milestones(self, epochs: int | None = None) -> list[int]:
        """The epochs at which the learning rate decays (or the batch grows)."""
        e = epochs or self.epochs
        return sorted({max(1, round(f * e)) for f in self.decay_at if round(f * e) < e})


def setup_for(profile: Profile) -> Setup:
    """The experiment sizes of a run profile: ``lab3_settings.SETUP``.

    ``quick`` checks that the code runs (seconds, numbers mean little); ``cpu`` is
    the recorded science on Fashion-MNIST with an MLP (minutes on 2 cores); ``gpu``
    is CIFAR-10 with the ResNet-style net.
    """
    # a copy: a notebook that changes its setup's model_kwargs changes no other setup
    return Setup(**copy.deepcopy(dict(lab3_settings.SETUP.of(profile.name))))


@dataclass(frozen=True)
class Run:
    """One training configuration on top of a :class:`Setup`."""

    label: str
    batch: int
    lr: float
    optimizer: str = "sgd"
    warmup_epochs: float = 0.0
    decay: str | None = None  # default: the setup's
    grow_batch: bool = False  # grow the batch by 1/gamma at decay_at instead of decaying the LR
    ghost_batch: int | None = None
    noise_scale: float = 0.0  # per-sample noise z ~ N(1, σ²), σ² = scale · (B / base_batch − 1)
    epochs: int | None = None  # default: the setup's
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.batch <= 0 or self.lr <= 0:
            raise ValueError(f"{self.label}: batch and lr must be positive")


@dataclass
class Result:
    """What a run measured."""

    run: Run
    test_acc: float
    val_acc: float
    updates: int
    seconds: float
    diverged: bool
    epochs: list[dict[str, float]]
    steps: list[dict[str, float]]
    trust: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Splits:
    """Train / validation / test tensors of one dataset, with its normalisation."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_shape: tuple[int, int, int]
    num_classes: int

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images as the model takes them: floats in [0, 1], then per channel
        ``(x − mean) / std`` (what the TensorLoader does to every batch)."""
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return (x.float() / 255 - mean) / std


def load_splits(setup: Setup, seed: int = 0) -> Splits:
    """The setup's dataset cut into train / validation / test (one shuffle, by seed)."""
    ds = data.load(setup.dataset)
    need = setup.n_train + setup.n_val
    if need > len(ds.x_train):
        raise ValueError(f"n_train + n_val = {need} > {len(ds.x_train)} training images")
    order = torch.randperm(len(ds.x_train), generator=torch.Generator().manual_seed(seed))
    train, val = order[: setup.n_train], order[setup.n_train : need]
    test = torch.arange(len(ds.x_test))
    if setup.n_test is not None:
        test = torch.randperm(len(ds.x_test), generator=torch.Generator().manual_seed(seed))
        test = test[: setup.n_test]
    return Splits(
        ds.x_train[train],
        ds.y_train[train],
        ds.x_train[val],
        ds.y_train[val],
        ds.x_test[test],
        ds.y_test[test],
        ds.mean,
        ds.std,
        ds.image_shape,
        ds.num_classes,
    )


def build_model(setup: Setup, splits: Splits, seed: int, ghost_batch: int | None = None):
    """The setup's model, initialised from ``seed`` (the same weights for every run)."""
    torch.manual_seed(seed)
    channels, size, _ = splits.image_shape
    kwargs = dict(setup.model_kwargs, num_classes=splits.num_classes, in_channels=channels)
    if setup.arch != "resnet_cifar":
        kwargs["image_size"] = size
    model = models.build(setup.arch, **kwargs)
    if ghost_batch is not None:
        optim.ghost_batch_norm(model, ghost_batch)
    return model


def make_optimizer(name: str, params, lr: float, setup: Setup) -> torch.optim.Optimizer:
    """SGD with momentum, LARS and LARC (SGD-momentum base; LARC clips each layer's rate
    at ``lr``), LAMB (Adam base) or NovoGrad (layer-wise second moments); biases and
    norm weights are left out of the layer-wise adaptation and weight decay."""
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay
        )
    if name == "lars":
        return optim.LARS(
            params,
            lr=lr,
            momentum=setup.momentum,
            weight_decay=setup.weight_decay,
            exclude_bias_and_norm=True,
        )
    if name == "lamb":
        return optim.LAMB(
            params, lr=lr, weight_decay=setup.weight_decay, exclude_bias_and_norm=True
        )
    if name == "larc":
        return optim.LARC(
            params,
            lr=lr,
            momentum=setup.momentum,
            mode="clip",
            weight_decay=setup.weight_decay,
            exclude_bias_and_norm=True,
        )
    if name == "novograd":
        return optim.NovoGrad(
            params, lr=lr, weight_decay=setup.weight_decay, exclude_bias_and_norm=True
        )
    raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")


def lr_grid(setup: Setup, optimizer: str) -> list[float]:
    """The learning rates an optimiser tries at the largest batch; the one with the
    best validation accuracy is kept. SGD's start from the square-root-scaled base
    rate, which is where the instability of larger ones begins on this problem."""
    if optimizer == "lars":
        return list(setup.lars_lrs)
    if optimizer == "lamb":
        return list(setup.lamb_lrs)
    if optimizer == "larc":
        return list(setup.larc_lrs)
    if optimizer == "novograd":
        return list(setup.novograd_lrs)
    if optimizer == "sgd":
        batch = setup.largest_ratio * setup.base_batch
        sqrt = optim.scale_lr(setup.base_lr, setup.base_batch, batch, "sqrt")
        return [f * sqrt for f in setup.sgd_lr_factors]
    raise ValueError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")


def _loader_batch(setup: Setup, batch: int) -> tuple[int, int]:
    """``(loader batch, accumulation steps)`` for an optimiser batch of ``batch``."""
    if setup.micro_batch is None or batch <= setup.micro_batch:
        return batch, 1
    if batch % setup.micro_batch or setup.n_train % batch:
        raise ValueError(
            f"batch {batch} must be a multiple of micro_batch {setup.micro_batch} "
            f"and divide n_train {setup.n_train} for exact accumulation"
        )
    return setup.micro_batch, batch // setup.micro_batch


def schedule(run: Run, setup: Setup, steps_per_epoch: int) -> optim.Factor:
    """The run's LambdaLR factor: warm-up from the base-batch rate, then the decay
    (none when the batch grows instead)."""
    epochs = run.epochs or setup.epochs
    total = epochs * steps_per_epoch
    warm = round(run.warmup_epochs * steps_per_epoch)
    start = min(1.0, setup.base_batch / run.batch)  # Goyal et al.: start at the small-batch LR
    if run.grow_batch:
        return optim.lr_schedule(total, warmup_steps=warm, warmup_start=start)
    decay = run.decay or setup.decay
    if decay == "cosine":
        return optim.lr_schedule(total, warmup_steps=warm, warmup_start=start, decay="cosine")
    marks = [m * steps_per_epoch for m in setup.milestones(epochs)]
    return optim.lr_schedule(
        total,
        warmup_steps=warm,
        warmup_start=start,
        decay=decay,
        milestones=marks,
        gamma=setup.gamma,
    )


def train(
    run: Run,
    setup: Setup,
    splits: Splits,
    *,
    progress: bool = False,
    trust_every: int = 0,
    device: torch.device | None = None,
) -> Result:
    """Train ``run`` and measure it; a run that diverges is reported, not raised.
    ``device``: default, this process's GPU if there is one, else the CPU."""
    device = device or default_device()
    epochs = run.epochs or setup.epochs
    model = build_model(setup, splits, run.seed, run.ghost_batch).to(device)
    loader_batch, accum = _loader_batch(setup, run.batch)
    loader = TensorLoader(
        splits.x_train,
        splits.y_train,
        loader_batch,
        seed=run.seed,
        mean=splits.mean,
        std=splits.std,
        device=device,
        augment=setup.augment,
    )
    # evaluation: every sample once, in order
    val, test = (
        TensorLoader(
            x,
            y,
            1024,
            shuffle=False,
            even_shards=False,
            mean=splits.mean,
            std=splits.std,
            device=device,
        )
        for x, y in ((splits.x_val, splits.y_val), (splits.x_test, splits.y_test))
    )
    opt = make_optimizer(run.optimizer, model.parameters(), run.lr, setup)
    steps_per_epoch = math.ceil(len(loader) / accum)
    scheduler = optim.lambda_lr(opt, schedule(run, setup, steps_per_epoch))
    callbacks: list[Any] = []
    if run.grow_batch:
        growth = optim.BatchGrowth(run.batch, 1 / setup.gamma, tuple(setup.milestones(epochs)))
        callbacks.append(optim.GrowBatch(loader, growth))
    recorder = optim.TrustRatioRecorder(trust_every) if trust_every else None
    if recorder is not None:
        callbacks.append(recorder)
    loss_fn = None
    if run.noise_scale:
        sigma = optim.noise_std(run.batch, setup.base_batch, run.noise_scale)
        loss_fn = optim.SampleNoiseLoss(sigma, seed=run.seed)
    trainer = Trainer(
        model,
        opt,
        loss_fn=loss_fn,
        scheduler=scheduler,
        callbacks=callbacks,
        progress=progress,
        grad_accum_steps=accum,
        device=device,
    )
    start = time.perf_counter()
    diverged = False
    try:
        trainer.fit(loader, epochs, val_loader=val)
    except FloatingPointError:
        diverged = True
    seconds = time.perf_counter() - start
    test_acc = trainer.evaluate(test)["acc"]
    val_acc = trainer.evaluate(val)["acc"]  # a diverged model still gets measured
    return Result(
        run,
        test_acc,
        val_acc,
        trainer.step,
        seconds,
        diverged,
        trainer.history.epochs,
        trainer.history.steps,
        recorder.records if recorder else [],
    )


def with_seed(runs: list[Run], seed: int) -> list[Run]:
    """The same runs with another seed (other initial weights and shuffles)."""
    return [replace(r, seed=seed) for r in runs]


def accumulation_errors(
    model_fn,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    micro_batch: int,
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
) -> dict[str, float]:
    """How far k = batch/micro_batch accumulated micro-batches are from one batch.

    ``grad``: ‖g_one − g_accumulated‖ / ‖g_one‖ for the first batch of ``x``.
    ``weights``: train one epoch of ``x`` both ways with the Trainer (SGD with
    momentum, ``len(x) / batch`` updates) and compare ‖θ_one − θ_acc‖ to how far the
    weights moved, ‖θ_one − θ_0‖. ``model_fn()`` must return the same initial model
    each call, without BatchNorm (whose statistics would differ per micro-batch);
    ``x`` holds float inputs as the model takes them.
    """
    if batch % micro_batch or len(x) % batch:
        raise ValueError("micro_batch must divide batch, and batch must divide len(x)")
    k = batch // micro_batch
    loss_fn = torch.nn.functional.cross_entropy

    model = model_fn()
    xb, yb = x[:batch], y[:batch]
    loss_fn(model(xb), yb).backward()
    one = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    for xm, ym in zip(xb.split(micro_batch), yb.split(micro_batch), strict=True):
        (loss_fn(model(xm), ym) / k).backward()
    acc = torch.cat([p.grad.flatten() for p in model.parameters()])
    grad_error = float((one - acc).norm() / one.norm())

    def fit(loader_batch: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        net = model_fn()
        start = torch.cat([p.detach().flatten() for p in net.parameters()])
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        loader = TensorLoader(x, y, loader_batch, seed=0)
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(net, opt, grad_accum_steps=accum, progress=False).fit(loader, 1)
        return start, torch.cat([p.detach().flatten() for p in net.parameters()])

    start, w_one = fit(batch, 1)
    _, w_acc = fit(micro_batch, k)
    weight_error = float((w_one - w_acc).norm() / (w_one - start).norm())
    return {"grad": grad_error, "weights": weight_error, "micro_batches": k}


def train_many(
    runs: list[Run],
    setup: Setup,
    splits: Splits,
    *,
    desc: str = "training",
    trust_every: int = 0,
    device: torch.device | None = None,
) -> list[Result]:
    """Train several runs one after the other under one progress bar (the Trainer's
    own per-epoch lines are kept out of the way)."""
    from tqdm.auto import tqdm

    results = []
    with tqdm(runs, desc=desc, unit="run") as bar:
        for run in bar:
            bar.set_postfix_str(run.label)
            with contextlib.redirect_stdout(io.StringIO()):
                results.append(train(run, setup, splits, trust_every=trust_every, device=device))
    return results


def table(results: list[Result]) -> str:
    """A plain-text table of runs: batch, learning rate, updates, accuracies, time."""
    lines = [
        f"{'run':32s} {'batch':>6s} {'lr':>8s} {'updates':>8s} {'val %':>7s} "
        f"{'test %':>7s} {'time s':>7s}"
    ]
    for r in results:
        note = "  diverged" if r.diverged else ""
        lines.append(
            f"{r.run.label:32s} {r.run.batch:6d} {r.run.lr:8.4g} {r.updates:8d} "
            f"{100 * r.val_acc:7.2f} {100 * r.test_acc:7.2f} {r.seconds:7.1f}{note}"
        )
    return "\n".join(lines)
