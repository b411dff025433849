"""Lab 1, part 3: how many updates does each batch size need to reach a target?

``03_batch_size_cost.ipynb`` runs this experiment and ``tests/test_lab1.py`` asserts
its claim on the ``cpu`` profile (Shallue et al., 2018: steps fall like 1/B for small
batches, then flatten):

    python labs/lab1_optimisation/steps_to_target.py [--profile cpu]

For each batch size and seed a small CNN trains on Fashion-MNIST with SGD + momentum
until its held-out accuracy reaches the target. The accuracy is checked after step 1
and then whenever the step count has grown by ``growth`` (the same resolution on a
log axis at every batch size), and the step at which the target is crossed is
interpolated between the last check below it and the first at or above it, so the
result does not jump with the grid of checks. A ``first_check`` above 1 skips the
evaluations of that grid before it (one step for every batch size, or one per batch
size): the same crossings, for fewer evaluations, as long as no run reaches the target
at its first check (``Measured.unbracketed``).

The learning rate grows linearly with the batch from ``lr_smallest`` and is capped
at ``lr_max``. A capped batch trains at less than the linear rate, so it is drawn
but kept out of the slope fits: its steps say what the cap costs, not where the
curve bends.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import lab1_settings  # beside this file: the sizes of each profile
from lab_utils import data, models, profile
from lab_utils.checks import Claim
from lab_utils.loader import TensorLoader
from lab_utils.profile import Profile
from lab_utils.train import Callback, Trainer, evaluate

# The claim's thresholds: the smallest batches scale nearly perfectly (slope ≤ −0.7),
# the largest uncapped ones clearly less (slope at least 0.3 higher).
SMALL_SLOPE_MAX = -0.7
BEND_MIN = 0.3


@dataclass(frozen=True)
class Setup:
    """The experiment's sizes on one profile."""

    target_acc: float = 0.80
    n_train: int = 60_000
    held_out: int = 1000  # test images the accuracy is measured on
    batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    seeds: tuple[int, ...] = (0, 1, 2)  # one crossing is noisy: the median is kept
    lr_smallest: float = 0.003  # at batches[0]
    lr_max: float = 0.1
    momentum: float = 0.9
    width: int = 16  # channels of the CNN's first conv layer
    max_images: int = 200_000  # give up after this many training images
    growth: float = 1.15  # the step count grows by this between two accuracy checks
    # steps before it are never checked (a check costs an evaluation): one step for every
    # batch size, or {batch: step}
    first_check: int | dict[int, int] = 1

    def lr(self, batch: int) -> float:
        """Linear scaling from the smallest batch, capped at ``lr_max``."""
        return min(self.lr_smallest * batch / self.batches[0], self.lr_max)

    def capped(self, batch: int) -> bool:
        """Whether the cap holds this batch below the linear rate."""
        return self.lr_smallest * batch / self.batches[0] > self.lr_max

    def check_from(self, batch: int) -> int:
        """The first step at which a run at ``batch`` checks its accuracy."""
        if isinstance(self.first_check, dict):
            return self.first_check.get(batch, 1)
        return self.first_check

    @property
    def cap_batch(self) -> float:
        """The batch size from which the cap applies."""
        return self.lr_max / self.lr_smallest * self.batches[0]


def setup_for(p: Profile) -> Setup:
    """The profile's setup: its sizes are ``lab1_settings.STEPS`` (``quick`` shows the
    code path on tiny subsets; ``cpu`` is the measured claim)."""
    return Setup(**lab1_settings.STEPS.of(p.name))


def crossing(checks: Sequence[tuple[int, float]], target: float) -> float | None:
    """The step at which the accuracy first reaches ``target``, interpolated linearly
    in log(step) between the last check below it and the first at or above it; None
    if it never does. ``checks``: (step, accuracy) in the order they were made."""
    prev: tuple[int, float] | None = None
    for step, acc in checks:
        if acc >= target:
            if prev is None or prev[1] >= acc:
                return float(step)
            s0, a0 = prev
            frac = (target - a0) / (acc - a0)
            return float(math.exp(math.log(s0) + frac * (math.log(step) - math.log(s0))))
        prev = (step, acc)
    return None


class StopAtAccuracy(Callback):
    """Evaluate on a held-out loader every so often; stop once ``target`` is reached."""

    def __init__(
        self,
        loader,
        target: float,
        batch_size: int,
        max_images: int,
        growth: float = 1.15,
        first_check: int = 1,
    ) -> None:
        self.loader, self.target, self.growth = loader, target, growth
        self.max_steps = max(1, max_images // batch_size)
        self.next_check, self.first_check = 1, first_check
        self.checks: list[tuple[int, float]] = []

    def on_batch_end(self, trainer: Trainer, step: int, loss: float) -> None:
        if step < self.next_check:
            return
        self.next_check = max(step + 1, math.ceil(step * self.growth))
        if step < self.first_check:
            return  # on the same grid of steps as from step 1, without evaluating
        accuracy = evaluate(trainer.model, self.loader)["acc"]
        self.checks.append((step, accuracy))
        if accuracy >= self.target or step >= self.max_steps:
            trainer.stop_training = True  # reached, or gave up: this batch never got there

    @property
    def reached_at(self) -> float | None:
        return crossing(self.checks, self.target)


@dataclass
class Measured:
    """Steps to the target of every (batch, seed); None where it was never reached."""

    setup: Setup
    per_seed: dict[int, list[float | None]]
    checks: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict)
    seconds: float = 0.0

    def median(self, batch: int) -> float | None:
        """The median over seeds; an unreached target counts as infinitely many steps."""
        found = [s if s is not None else math.inf for s in self.per_seed[batch]]
        m = statistics.median(found)
        return m if math.isfinite(m) else None

    def unbracketed(self) -> list[tuple[int, int]]:
        """The (batch, seed) runs that reached the target at their first check: their
        crossing is only bounded from above (check earlier: a smaller ``first_check``)."""
        return [
            key
            for key, checks in self.checks.items()
            if checks and checks[0][1] >= self.setup.target_acc
        ]

    def fitted(self) -> tuple[list[int], list[float]]:
        """The batches the slopes are fitted on (reached, below the cap) and their medians."""
        batches = [
            b for b in self.setup.batches if not self.setup.capped(b) and self.median(b) is not None
        ]
        return batches, [self.median(b) for b in batches]

    def slopes(self) -> tuple[float, float, int]:
        """(slope over the smallest half, slope over the largest half, half) of the fitted
        points: the two regimes of the curve."""
        batches, steps = self.fitted()
        half = max(2, (len(batches) + 1) // 2)
        return (
            loglog_slope(batches[:half], steps[:half]),
            loglog_slope(batches[-half:], steps[-half:]),
            half,
        )


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def data_for(setup: Setup, device: torch.device | None = None):
    """(training subset, held-out loader) of the setup: the same for every run."""
    ds = data.load("fashion-mnist")
    held = ds.subset(n_train=0, n_test=setup.held_out, seed=1)
    # batches of 250: the same accuracy as one batch of 1000, without allocating (and
    # faulting in) fresh pages for the large activations at every check
    held_loader = TensorLoader.from_dataset(held, "test", 250, device=device)
    return ds.subset(n_train=setup.n_train, n_test=0, seed=0), held_loader


def steps_to_target(
    batch: int, seed: int, setup: Setup, train_set, held_loader, device: torch.device | None = None
) -> StopAtAccuracy:
    """Train from scratch at ``batch`` until the held-out accuracy reaches the target;
    the returned callback holds the checks and the interpolated crossing."""
    torch.manual_seed(seed)
    model = models.build("fmnist_cnn", width=setup.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr(batch), momentum=setup.momentum)
    stopper = StopAtAccuracy(
        held_loader,
        setup.target_acc,
        batch,
        setup.max_images,
        setup.growth,
        setup.check_from(batch),
    )
    trainer = Trainer(model, optimizer, callbacks=[stopper], progress=False, device=device)
    loader = TensorLoader.from_dataset(train_set, "train", batch, seed=seed, device=device)
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's per-epoch lines
        trainer.fit(loader, epochs=math.ceil(setup.max_images / len(train_set.x_train)) + 1)
    return stopper


def measure(setup: Setup, device: torch.device | None = None, progress: bool = True) -> Measured:
    """Every (batch, seed) of the setup."""
    from tqdm.auto import tqdm

    train_set, held_loader = data_for(setup, device)
    out = Measured(setup, {b: [] for b in setup.batches})
    start = time.perf_counter()
    runs = [(b, s) for b in setup.batches for s in setup.seeds]
    for batch, seed in tqdm(runs, desc="runs (batch size, seed)", disable=not progress):
        stopper = steps_to_target(batch, seed, setup, train_set, held_loader, device)
        out.per_seed[batch].append(stopper.reached_at)
        out.checks[batch, seed] = stopper.checks
    out.seconds = time.perf_counter() - start
    return out


def claims(m: Measured) -> list[Claim]:
    """The measured curve against its thresholds: every uncapped batch reaches the
    target; small batches scale nearly perfectly; larger ones clearly less."""
    uncapped = [b for b in m.setup.batches if not m.setup.capped(b)]
    reached = [b for b in uncapped if m.median(b) is not None]
    out = [
        Claim(
            "every uncapped batch size reaches the target",
            f"{len(reached)} of {len(uncapped)}",
            "all",
            len(reached) == len(uncapped),
            float(len(reached) - len(uncapped)),
            "batches",
        )
    ]
    if len(reached) < 4:
        return out + [
            Claim(
                "two regimes of steps vs batch",
                f"{len(reached)} points",
                "≥ 4 fitted points",
                False,
                float(len(reached) - 4),
                "points",
            )
        ]
    small, large, half = m.slopes()
    out.append(
        Claim(
            f"small batches: steps ∝ 1/B (smallest {half})",
            f"slope {small:+.2f}",
            f"≤ {SMALL_SLOPE_MAX:+.1f}",
            small <= SMALL_SLOPE_MAX,
            SMALL_SLOPE_MAX - small,
            "slope",
        )
    )
    out.append(
        Claim(
            f"larger batches: diminishing returns (largest {half})",
            f"slope {large:+.2f} vs {small:+.2f}",
            f"≥ small + {BEND_MIN:g}",
            large - small >= BEND_MIN,
            large - small - BEND_MIN,
            "slope",
        )
    )
    return out


def report(m: Measured) -> str:
    """One line per batch: learning rate, steps per seed, median."""
    lines = []
    for b in m.setup.batches:
        shown = ", ".join(f"{s:.0f}" if s is not None else "—" for s in m.per_seed[b])
        med = m.median(b)
        cap = "  (capped: out of the fit)" if m.setup.capped(b) else ""
        lines.append(
            f"B = {b:5d}, lr = {m.setup.lr(b):.4f}: steps per seed [{shown}]"
            + (f", median {med:.0f}" if med is not None else ", not reached")
            + cap
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Steps to a target accuracy against batch size.")
    p.add_argument(
        "--profile",
        choices=profile.PROFILES,
        default=None,
        help="run profile (default: $LABS_PROFILE, else cpu: the asserted one)",
    )
    args = p.parse_args(argv)
    P = profile.current(args.profile or os.environ.get("LABS_PROFILE") or "cpu")
    m = measure(setup_for(P), P.device)
    print(report(m))
    judged = [c for c in claims(m) if c.asserted(P.name)]
    for c in claims(m):
        print(c.shown(P.name))
    print(f"{m.seconds:.0f} s")
    return 0 if all(c.ok for c in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
