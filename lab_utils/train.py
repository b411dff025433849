"""The Trainer: fit loop, evaluation, history, callbacks, time budget, checkpoints.

One loop serves a notebook cell, a single-process script and every rank of a
data-parallel job. It works with a plain model or one wrapped in
``DistributedDataParallel``; with Horovod, pass ``hvd.DistributedOptimizer``.
Only rank 0 shows progress, writes metrics and saves checkpoints; every decision to
stop (time budget, callbacks, NaN) is agreed by all ranks so no rank is left
waiting in a collective.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dist as labdist
from . import metrics as lmetrics
from . import models
from .models import unwrap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Callback:
    """Hooks into :meth:`Trainer.fit`; override the ones you need.

    Set ``trainer.stop_training = True`` to end the fit after the current step. With
    several ranks, make that decision the same on every rank (a step count, a value
    all-reduced first), or request it in :meth:`on_epoch_end`, where the Trainer
    agrees on it across ranks: a rank that leaves alone leaves the others waiting.
    ``loss`` in :meth:`on_batch_end` is a detached 0-d tensor (no device sync).
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...
    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...
    def on_batch_end(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, float]) -> None: ...
    def on_fit_end(self, trainer: Trainer) -> None: ...


class StepTimer(Callback):
    """Training seconds per optimiser step, leaving out the first step of each epoch
    (its shuffle and warm-up), and an optional stop after ``max_steps`` steps.

    Reads ``steps`` and ``seconds`` after ``fit``; every rank stops at the same step.
    """

    def __init__(self, max_steps: int = 0) -> None:
        self.max_steps, self.steps, self.seconds = max_steps, 0, 0.0
        self._last: float | None = None

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self._last = None

    def on_batch_end(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.steps, self.seconds = self.steps + 1, self.seconds + now - self._last
        self._last = now
        if self.max_steps and trainer.step >= self.max_steps:
            trainer.stop_training = True


@dataclass
class History:
    """What happened during training: one row per epoch and one per optimiser step."""

    epochs: list[dict[str, float]] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)

    def column(self, key: str) -> list[float]:
        """One value per epoch, e.g. ``history.column("val_acc")``."""
        return [row[key] for row in self.epochs if key in row]

    @property
    def last(self) -> dict[str, float]:
        return self.epochs[-1] if self.epochs else {}

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs, self.steps = list(state["epochs"]), list(state["steps"])


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Loss and accuracy of ``model`` over ``loader``, summed exactly over all ranks.

    Each rank evaluates its own samples and the sums (loss, correct, count) are
    all-reduced, so with a loader whose shards do not overlap
    (``TensorLoader(..., even_shards=False)``) the result equals a single-process
    evaluation of the whole set. The bare model is used (not the DDP wrapper),
    because ranks may hold different numbers of batches.
    """
    loss_fn = loss_fn or F.cross_entropy
    net = unwrap(model)
    device = torch.device(device) if device is not None else next(net.parameters()).device
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for xb, yb in loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with _autocast(device, autocast_dtype):
            out = net(xb)
        out = out.float()
        sums[0] += loss_fn(out, yb).double() * yb.shape[0]
        sums[1] += (out.argmax(1) == yb).sum()
        sums[2] += yb.shape[0]
    net.train(was_training)
    loss_sum, correct, n = labdist.all_reduce_sum(sums).tolist()
    if n == 0:
        raise ValueError("evaluate() got an empty loader")
    return {"loss": loss_sum / n, "acc": correct / n, "n": int(n)}


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class Trainer:
    """Fit a model with an optimiser over a loader of ``(x, y)`` batches.

    Args:
        model: the network, plain or wrapped in DDP (already on its device).
        optimizer: any ``torch.optim.Optimizer`` (also Horovod's wrapper, LARS, LAMB).
        loss_fn: ``loss_fn(logits, y)`` returning the mean loss.
        scheduler: stepped after every optimiser step (not every epoch).
        device: where batches go; default: the model's device.
        callbacks: :class:`Callback` objects.
        max_seconds: wall-clock budget for :meth:`fit`; training stops cleanly
            when it is spent (checked on all ranks together).
        progress: show a tqdm bar on rank 0; ``None`` means "in a notebook or a
            terminal", so launched scripts print one line per epoch instead.
        metrics_path: JSON-lines file that rank 0 appends one record per epoch to.
        checkpoint_path: where rank 0 saves a resumable checkpoint after every epoch.
        grad_accum_steps: micro-batches per optimiser step (DDP syncs only the last).
        autocast_dtype: e.g. ``torch.bfloat16`` for mixed precision.
        sync_every: steps between the checks that all ranks agree on (budget, stop
            requests, NaN); each costs one tiny all-reduce.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn | None = None,
        scheduler: Any = None,
        device: torch.device | str | None = None,
        callbacks: Sequence[Callback] = (),
        max_seconds: float | None = None,
        progress: bool | None = None,
        metrics_path: str | Path | None = None,
        checkpoint_path: str | Path | None = None,
        grad_accum_steps: int = 1,
        autocast_dtype: torch.dtype | None = None,
        sync_every: int = 25,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError("grad_accum_steps must be >= 1")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn or F.cross_entropy
        self.scheduler = scheduler
        net = unwrap(model)
        self.device = torch.device(device) if device is not None else next(net.parameters()).device
        if not isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model.to(self.device)  # a DDP wrapper already sits on its device
        self.callbacks = list(callbacks)
        self.max_seconds = max_seconds
        self.is_main = labdist.is_main()
        if progress is None:
            progress = _in_notebook() or sys.stderr.isatty()
        self.progress = bool(progress) and self.is_main
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.grad_accum_steps = grad_accum_steps
        self.autocast_dtype = autocast_dtype
        self.sync_every = max(1, sync_every)
        self.history = History()
        self.epoch = 0  # epochs completed
        self.step = 0  # optimiser steps taken
        self.elapsed = 0.0  # seconds spent in fit(), over all calls
        self.stop_training = False
        self.stop_reason = ""

    # ------------------------------------------------------------------ fitting
    def fit(
        self, train_loader: Iterable, epochs: int, val_loader: Iterable | None = None
    ) -> History:
        """Train until ``epochs`` epochs are complete (counting resumed ones)."""
        self.stop_training, self.stop_reason = False, ""
        start = time.perf_counter() - self.elapsed
        self._fit_start = start
        bar = self._progress_bar(train_loader, epochs)
        self._call("on_fit_start")
        try:
            while self.epoch < epochs and not self.stop_training:
                row = self._train_epoch(train_loader, epochs, bar)
                if val_loader is not None:
                    val = evaluate(
                        self.model, val_loader, self.loss_fn, self.device, self.autocast_dtype
                    )
                    row.update(val_loss=val["loss"], val_acc=val["acc"])
                self.elapsed = time.perf_counter() - start
                row["time"] = self.elapsed
                self.history.epochs.append(row)
                self._call("on_epoch_end", self.epoch, row)
                self._agree_to_stop()
                self._report(row, epochs, bar)
                if self.checkpoint_path is not None:
                    self.save_checkpoint(self.checkpoint_path)
        finally:
            if bar is not None:
                bar.close()
            self.elapsed = time.perf_counter() - start
        self._call("on_fit_end")
        return self.history

    def _train_epoch(self, loader: Iterable, epochs: int, bar: Any) -> dict[str, float]:
        n_batches = self._start_epoch(loader, epochs, bar)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, n
        step_losses: list[torch.Tensor] = []
        step_lrs: list[float] = []
        micro = 0
        for i, (xb, yb) in enumerate(loader):
            micro += 1
            last_micro = micro == self.grad_accum_steps or (
                n_batches is not None and i == n_batches - 1
            )
            loss = self._micro_batch(xb, yb, self._group_size(i, n_batches), last_micro, sums)
            if not last_micro:
                continue
            micro = 0
            step_lrs.append(self.optimizer.param_groups[0]["lr"])  # the LR this step used
            self._optimizer_step()
            step_losses.append(loss.detach())
            self._after_step(loss.detach(), bar)
            if self.stop_training:
                break
        if micro:  # a loader without a length ended inside a group: step what it has
            step_lrs.append(self.optimizer.param_groups[0]["lr"])
            self._optimizer_step()
            step_losses.append(loss.detach())
        self._record_steps(step_losses, step_lrs)
        return self._end_epoch(sums, step_lrs)

    def _start_epoch(self, loader: Iterable, epochs: int, bar: Any) -> int | None:
        """Tells the loader and the callbacks; returns the loader's length if it has one."""
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        self._call("on_epoch_start", self.epoch)
        self.model.train()
        n_batches = len(loader) if hasattr(loader, "__len__") else None
        if bar is not None and n_batches is not None:  # a callback may have grown the batch
            bar.total = bar.n + math.ceil(n_batches / self.grad_accum_steps) * (epochs - self.epoch)
            bar.refresh()
        return n_batches

    def _group_size(self, i: int, n_batches: int | None) -> int:
        """How many micro-batches the step of batch ``i`` averages: a short last group (the
        epoch's batches do not divide evenly) averages over fewer, not over a full group."""
        group = self.grad_accum_steps
        if n_batches is not None:
            group = min(group, n_batches - (i // self.grad_accum_steps) * self.grad_accum_steps)
        return group

    def _micro_batch(
        self, xb: torch.Tensor, yb: torch.Tensor, group: int, last_micro: bool, sums: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (its share of the group's mean), adding
        its loss, correct count and size to ``sums``; returns its loss."""
        xb = xb.to(self.device, non_blocking=True)
        yb = yb.to(self.device, non_blocking=True)
        sync = contextlib.nullcontext()
        if not last_micro and hasattr(self.model, "no_sync"):
            sync = self.model.no_sync()  # DDP: accumulate locally, all-reduce once
        with sync:
            with _autocast(self.device, self.autocast_dtype):
                out = self.model(xb)
                loss = self.loss_fn(out.float(), yb)
            (loss / group).backward()
        with torch.no_grad():
            sums[0] += loss.detach().double() * yb.shape[0]
            sums[1] += (out.argmax(1) == yb).sum()
            sums[2] += yb.shape[0]
        return loss

    def _after_step(self, loss: torch.Tensor, bar: Any) -> None:
        """Callbacks and the progress bar; every ``sync_every`` steps the ranks check the
        loss is finite and agree whether to stop."""
        self._call("on_batch_end", self.step, loss)
        if bar is not None:
            bar.update(1)
        if self.step % self.sync_every == 0:
            self._check_finite(loss)
            self._agree_to_stop()
            if bar is not None:
                bar.set_postfix(epoch=self.epoch + 1, loss=f"{loss.item():.4f}")

    def _record_steps(self, step_losses: list[torch.Tensor], step_lrs: list[float]) -> None:
        """The epoch's per-step loss and LR into the history (one device sync for all)."""
        first = self.step - len(step_losses) + 1
        losses = torch.stack(step_losses).tolist() if step_losses else []
        for k, (lo, lr) in enumerate(zip(losses, step_lrs)):
            self.history.steps.append({"step": first + k, "loss": lo, "lr": lr})

    def _end_epoch(self, sums: torch.Tensor, step_lrs: list[float]) -> dict[str, float]:
        """The epoch's loss and accuracy over every rank's samples."""
        self._check_finite(sums[0])
        loss_sum, correct, n = labdist.all_reduce_sum(sums).tolist()
        self.epoch += 1
        return {
            "epoch": self.epoch,
            "step": self.step,
            "train_loss": loss_sum / max(n, 1),
            "train_acc": correct / max(n, 1),
            "lr": step_lrs[-1] if step_lrs else self.optimizer.param_groups[0]["lr"],
        }

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    # ---------------------------------------------------------- stop agreement
    def _agree_to_stop(self) -> None:
        """All ranks stop together: budget, callbacks' requests (max over ranks)."""
        wall = time.perf_counter() - self._fit_start
        if self.max_seconds is not None and wall >= self.max_seconds and not self.stop_training:
            self.stop_training, self.stop_reason = (
                True,
                f"time budget of {self.max_seconds:g}s spent",
            )
        flag = torch.tensor([1.0 if self.stop_training else 0.0], dtype=torch.float64)
        others = labdist.world_size() > 1 and labdist.all_reduce_sum(flag).item() > 0
        if others and not self.stop_training:
            self.stop_training, self.stop_reason = True, "another rank stopped"

    def _check_finite(self, value: torch.Tensor) -> None:
        bad = torch.tensor([0.0 if math.isfinite(float(value)) else 1.0], dtype=torch.float64)
        if labdist.all_reduce_sum(bad).item() > 0:
            raise FloatingPointError(
                f"training diverged: the loss is not finite at step {self.step} "
                f"(epoch {self.epoch + 1}). Lower the learning rate or add warm-up."
            )

    # ----------------------------------------------------------------- output
    def _progress_bar(self, loader: Iterable, epochs: int) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        per_epoch = len(loader) if hasattr(loader, "__len__") else None
        total = None
        if per_epoch is not None:
            total = math.ceil(per_epoch / self.grad_accum_steps) * max(epochs - self.epoch, 0)
        return tqdm(total=total, desc="training", unit="step", leave=False)

    def _report(self, row: dict[str, float], epochs: int, bar: Any) -> None:
        if not self.is_main:
            return
        lmetrics.emit({"event": "epoch", **row}, self.metrics_path)
        text = f"epoch {row['epoch']}/{epochs}  loss {row['train_loss']:.4f}  acc {row['train_acc']:.2%}"
        if "val_acc" in row:
            text += f"  val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.2%}"
        text += f"  {row['time']:.1f}s"
        if self.stop_reason:
            text += f"  (stopped: {self.stop_reason})"
        if bar is not None:
            bar.write(text)
        else:
            print(text, flush=True)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # ------------------------------------------------------------ evaluation
    def evaluate(self, loader: Iterable) -> dict[str, float]:
        """Loss and accuracy over ``loader`` (see :func:`evaluate`)."""
        return evaluate(self.model, loader, self.loss_fn, self.device, self.autocast_dtype)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model, optimiser, schedule, counters, RNG."""
        net = unwrap(self.model)
        state: dict[str, Any] = {}
        if hasattr(net, "arch_spec"):
            state = models.checkpoint(net)
        else:
            state["state_dict"] = net.state_dict()
        state.update(
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            epoch=self.epoch,
            step=self.step,
            elapsed=self.elapsed,
            history=self.history.state_dict(),
            rng={
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        )
        return state

    def save_checkpoint(self, path: str | Path) -> None:
        """Write a resumable checkpoint (rank 0 only; atomically, so a kill cannot
        leave half a file)."""
        if not self.is_main:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from :meth:`save_checkpoint`'s file (every rank reads it)."""
        state = torch.load(path, map_location=self.device, weights_only=True)
        unwrap(self.model).load_state_dict(state["state_dict"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))
        self.history.load_state_dict(state["history"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if torch.cuda.is_available() and state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["rng"]["cuda"]])
