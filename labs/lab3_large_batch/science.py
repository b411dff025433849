"""Lab 3's science claims, measured: ``make science``.

    python labs/lab3_large_batch/science.py [--profile cpu] [--seeds 2] [--json out.json]

Trains every configuration the claims need (on the ``cpu`` profile: Fashion-MNIST,
an MLP, 8 epochs, batches from 64 to 8192), with each seed, and prints the runs and a
table of claims with PASS/FAIL and margins. The exit status is 1 if a claim fails on
the ``cpu`` or ``gpu`` profile; ``quick`` only checks that the code runs (its tiny runs
cannot show the claims, so they print "not asserted (quick)"; the exact accumulation
claim is asserted everywhere). ``tests/test_lab3.py`` asserts the claims on the ``cpu``
profile in ``make test``.

The claims and their fixed thresholds (``lab3_checks``):

1. a naive large batch (×16, same epochs, base learning rate) loses ≥ 2 points;
2. linear scaling + warm-up at that batch is within 1 point of the baseline;
3. at the largest batch, LARS or LAMB beats SGD with the same epochs and schedule
   (each optimiser's learning rate picked from three on the validation split);
4. growing the batch (×4 at 50 % and 75 % of training) is within 1 point of decaying
   the learning rate (÷4 at the same epochs), with fewer updates;
5. accumulating k micro-batches gives the gradient of one batch of k·b to ~1e-6.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from queue import Empty
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments.py beside this file

import lab3_checks as checks
import lab3_settings
from experiments import (
    Run,
    Setup,
    Splits,
    accumulation_errors,
    build_model,
    load_splits,
    lr_grid,
    setup_for,
    train,
)
from lab_utils import optim, profile


@dataclass(frozen=True)
class Plan:
    """The runs behind the claims (for one seed)."""

    baseline: Run
    naive: Run
    scaled: Run
    sqrt_scaled: Run
    no_warmup: Run
    decay: Run
    growth: Run
    grid: dict[str, list[Run]]  # optimiser -> the same run at several learning rates
    claim_grid: dict[str, list[Run]]  # the rates of each grid that decide claim 3

    def runs(self, claims_only: bool = False) -> list[Run]:
        """Every run, or (``claims_only``) only those the claims compare: the square-root
        and no-warm-up runs are for the table, and of each grid the claim reads the chosen
        rate and its neighbours."""
        fixed = [self.baseline, self.naive, self.scaled, self.decay, self.growth]
        grid = self.claim_grid if claims_only else self.grid
        if not claims_only:
            fixed[3:3] = [self.sqrt_scaled, self.no_warmup]
        return fixed + [r for runs in grid.values() for r in runs]


def make_plan(setup: Setup) -> Plan:
    """Every run the claims need, from the setup's base batch and learning rate."""
    b0, lr0, warm = setup.base_batch, setup.base_lr, setup.warmup_epochs
    k, kmax = setup.naive_ratio, setup.largest_ratio
    big, biggest = k * b0, kmax * b0
    lin, sqrt = optim.scale_lr(lr0, b0, big, "linear"), optim.scale_lr(lr0, b0, big, "sqrt")
    grid = {
        name: [
            Run(f"{name.upper()} ×{kmax} lr={lr:.3g}", biggest, lr, name, warm)
            for lr in lr_grid(setup, name)
        ]
        for name in ("sgd", "lars", "lamb")
    }
    picks = setup.claim_lrs or {}
    claim_grid = {
        name: [runs[i] for i in picks[name]] if name in picks else runs
        for name, runs in grid.items()
    }
    return Plan(
        baseline=Run(f"baseline B={b0}", b0, lr0),
        naive=Run(f"naive ×{k}", big, lr0),
        scaled=Run(f"×{k} linear + warm-up", big, lin, warmup_epochs=warm),
        sqrt_scaled=Run(f"×{k} sqrt + warm-up", big, sqrt, warmup_epochs=warm),
        no_warmup=Run(f"×{k} linear, no warm-up", big, lin),
        decay=Run(f"step LR decay B={b0}", b0, lr0, decay="step"),
        growth=Run(f"batch growth from B={b0}", b0, lr0, grow_batch=True),
        grid=grid,
        claim_grid=claim_grid,
    )


@dataclass
class Summary:
    """One configuration over all seeds."""

    run: Run
    test: list[float]
    val: list[float]
    updates: int
    seconds: float
    diverged: int

    @property
    def test_mean(self) -> float:
        return statistics.fmean(self.test)

    @property
    def val_mean(self) -> float:
        return statistics.fmean(self.val)

    def accuracy_text(self) -> str:
        if len(self.test) == 1:
            return f"{100 * self.test_mean:6.2f}"
        return f"{100 * self.test_mean:6.2f} ± {100 * statistics.stdev(self.test):4.2f}"


def _train_seed(
    runs: Sequence[Run],
    setup: Setup,
    splits: Splits | None,
    seed: int,
    threads: int | None = None,
    queue: Any = None,
) -> list[dict[str, Any]]:
    """Train ``runs`` with one seed (in this process or a worker process) and return
    what each measured. ``queue`` receives the label of each finished run."""
    if threads:
        torch.set_num_threads(threads)
    splits = splits or load_splits(setup)
    out = []
    for run in runs:
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's epoch lines
            r = train(replace(run, seed=seed), setup, splits)
        out.append(
            {
                "test": r.test_acc,
                "val": r.val_acc,
                "updates": r.updates,
                "seconds": r.seconds,
                "diverged": r.diverged,
            }
        )
        if queue is not None:
            queue.put(f"{run.label} (seed {seed})")
    return out


def run_plan(
    plan: Plan,
    setup: Setup,
    splits: Splits,
    seeds: Sequence[int],
    progress: bool = True,
    jobs: int = 1,
    claims_only: bool = False,
) -> dict[Run, Summary]:
    """Train every run of ``plan`` with every seed; the summaries are keyed by the
    seed-0 form of each run.

    With ``jobs > 1`` the seeds run in that many worker processes with one thread
    each: on a few cores that is faster than one process with several threads (small
    matrices leave threads waiting for each other) and it does not slow down when
    other programs share the cores.
    """
    from tqdm.auto import tqdm

    runs = plan.runs(claims_only)
    seeds = list(seeds)
    jobs = max(1, min(jobs, len(seeds)))
    bar = tqdm(total=len(runs) * len(seeds), desc="lab 3 science", unit="run", disable=not progress)
    if jobs == 1:
        per_seed = []
        for seed in seeds:
            queue = _BarQueue(bar)
            per_seed.append(_train_seed(runs, setup, splits, seed, queue=queue))
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=context) as pool:
            queue = manager.Queue()
            futures = [
                pool.submit(_train_seed, runs, setup, None, seed, threads, queue) for seed in seeds
            ]
            finished = 0
            while finished < len(runs) * len(seeds) and not any(
                f.done() and f.exception() for f in futures
            ):
                try:
                    bar.set_postfix_str(queue.get(timeout=1.0))
                except Empty:
                    continue
                bar.update(1)
                finished += 1
            per_seed = [f.result() for f in futures]  # raises a worker's error here
    bar.close()
    out: dict[Run, Summary] = {}
    for i, run in enumerate(runs):
        rows = [seed_rows[i] for seed_rows in per_seed]
        out[run] = Summary(
            run,
            [r["test"] for r in rows],
            [r["val"] for r in rows],
            rows[0]["updates"],
            sum(r["seconds"] for r in rows),
            sum(r["diverged"] for r in rows),
        )
    return out


class _BarQueue:
    """Stands in for a queue in this process: a finished run advances the bar."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def put(self, label: str) -> None:
        self.bar.set_postfix_str(label)
        self.bar.update(1)


def best_by_validation(summaries: Sequence[Summary]) -> Summary:
    """The learning rate with the best mean validation accuracy (the test split is
    never used to choose)."""
    return max(summaries, key=lambda s: s.val_mean)


def measured(runs: Sequence[Run], summaries: dict[Run, Summary]) -> list[Summary]:
    """The summaries of those of ``runs`` that were trained."""
    return [summaries[r] for r in runs if r in summaries]


def measure_accumulation(setup: Setup, splits: Splits) -> dict[str, float]:
    """Accumulation vs one batch on the setup's model and real training images."""
    batch, micro = setup.naive_ratio * setup.base_batch, setup.base_batch
    n = min(len(splits.x_train) // batch, 4) * batch
    if setup.arch != "mlp":  # the claim is about a model without BatchNorm
        setup = replace(setup, arch="mlp", model_kwargs={"hidden": (256, 128)})
    x = splits.normalise(splits.x_train[:n])
    return accumulation_errors(
        lambda: build_model(setup, splits, seed=0), x, splits.y_train[:n], batch, micro
    )


def evaluate_claims(
    plan: Plan, s: dict[Run, Summary], setup: Setup, accumulation: dict[str, float]
) -> list[checks.Claim]:
    """The five claims from the measured summaries (of each grid, the rates measured)."""
    k, kmax = setup.naive_ratio, setup.largest_ratio
    best = {name: best_by_validation(measured(runs, s)) for name, runs in plan.grid.items()}
    return [
        checks.claim_naive_gap(s[plan.baseline].test_mean, s[plan.naive].test_mean, k),
        checks.claim_scaling_recovers(s[plan.baseline].test_mean, s[plan.scaled].test_mean, k),
        checks.claim_adaptive_beats_sgd(
            best["sgd"].test_mean, best["lars"].test_mean, best["lamb"].test_mean, kmax
        ),
        checks.claim_growth_matches_decay(
            s[plan.decay].test_mean,
            s[plan.decay].updates,
            s[plan.growth].test_mean,
            s[plan.growth].updates,
        ),
        checks.claim_accumulation_exact(
            max(accumulation["grad"], accumulation["weights"]), int(accumulation["micro_batches"])
        ),
    ]


def runs_table(summaries: dict[Run, Summary], chosen: set[Run]) -> str:
    """One line per configuration: batch, learning rate, updates, test accuracy."""
    lines = [
        f"{'run':34s} {'batch':>6s} {'lr':>8s} {'updates':>8s} "
        f"{'test acc % (mean ± sd)':>23s} {'time s':>7s}"
    ]
    for run, sm in summaries.items():
        mark = " *" if run in chosen else ""
        flag = f"  diverged in {sm.diverged} seed(s)" if sm.diverged else ""
        lines.append(
            f"{run.label:34s} {run.batch:6d} {run.lr:8.4g} {sm.updates:8d} "
            f"{sm.accuracy_text():>23s} {sm.seconds:7.1f}{mark}{flag}"
        )
    return "\n".join(lines)


def claims_table(claims: Sequence[checks.Claim], profile_name: str = "cpu") -> str:
    """The claims with their measured numbers, thresholds, PASS/FAIL and margin; where
    the profile's runs are too small to show one, "not asserted (quick)" instead."""
    w = max(len(c.name) for c in claims)
    m = max(len(c.measured) for c in claims)
    lines = [f"{'claim':{w}s}  {'measured':{m}s}  {'needs':28s}  result"]
    for c in claims:
        result = c.result(profile_name)
        if c.asserted(profile_name):
            result += f" (margin {c.margin:+.2g} {c.unit})"
        lines.append(f"{c.name:{w}s}  {c.measured:{m}s}  {c.threshold:28s}  {result}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure Lab 3's claims and print PASS/FAIL.")
    p.add_argument(
        "--profile",
        choices=profile.PROFILES,
        default=None,
        help="run profile (default: $LABS_PROFILE, else cpu: the recorded one)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per configuration (default: the profile's, lab3_settings.SCIENCE)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="seeds trained at once, in separate processes (default: one per core)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--claims-only",
        action="store_true",
        help="skip the runs shown only in the table (square-root scaling, no warm-up) "
        "and the learning rates that do not decide claim 3",
    )
    args = p.parse_args(argv)

    P = profile.current(args.profile or os.environ.get("LABS_PROFILE") or "cpu")
    setup = setup_for(P)
    seeds = list(range(args.seeds or lab3_settings.SCIENCE.of(P.name).seeds))
    started = time.perf_counter()
    print(
        f"Lab 3 science — {P}, {setup.dataset}, {setup.arch} {setup.model_kwargs}, "
        f"{setup.epochs} epochs, {len(seeds)} seed(s)",
        flush=True,
    )
    splits = load_splits(setup)
    plan = make_plan(setup)
    jobs = args.jobs or (os.cpu_count() or 1)
    summaries = run_plan(
        plan,
        setup,
        splits,
        seeds,
        progress=not args.no_progress,
        jobs=jobs,
        claims_only=args.claims_only,
    )
    accumulation = measure_accumulation(setup, splits)
    claims = evaluate_claims(plan, summaries, setup, accumulation)
    chosen = {best_by_validation(measured(runs, summaries)).run for runs in plan.grid.values()}
    elapsed = time.perf_counter() - started

    print()
    print(runs_table(summaries, chosen))
    print(
        "  * the learning rate chosen on the validation split for each optimiser; "
        "time: training seconds over all seeds"
    )
    print(
        f"  accumulation: gradient error {accumulation['grad']:.1e}, weights after one "
        f"epoch {accumulation['weights']:.1e} (relative to how far they moved)"
    )
    print()
    print(claims_table(claims, P.name))
    workers = min(jobs, len(seeds))
    how = (
        f"{workers} processes × {max(1, (os.cpu_count() or 1) // workers)} thread(s)"
        if workers > 1
        else f"{P.threads} thread(s)"
    )
    judged = [c for c in claims if c.asserted(P.name)]
    held = f"{sum(c.ok for c in judged)}/{len(judged)} asserted claims hold"
    print(
        f"\n{held}; {elapsed / 60:.1f} min on "
        f"{os.cpu_count()} cores ({platform.machine()}), {how}, {date.today().isoformat()}"
    )

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "profile": P.name,
                    "date": date.today().isoformat(),
                    "seconds": elapsed,
                    "machine": platform.platform(),
                    "cores": os.cpu_count(),
                    "processes": workers,
                    "seeds": seeds,
                    "setup": asdict(setup),
                    "accumulation": accumulation,
                    "runs": [
                        {
                            "label": r.label,
                            "batch": r.batch,
                            "lr": r.lr,
                            "updates": sm.updates,
                            "test": sm.test,
                            "val": sm.val,
                            "seconds": sm.seconds,
                            "diverged": sm.diverged,
                        }
                        for r, sm in summaries.items()
                    ],
                    "claims": [asdict(c) | {"verdict": c.result(P.name)} for c in claims],
                },
                indent=2,
            )
        )
    if P.name == "quick":
        print(
            "quick profile: the runs are too small to show the claims; only the exact one "
            "is asserted (use LABS_PROFILE=cpu)"
        )
    return 0 if all(c.ok for c in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
