"""Algorithms for large batches (Lab 3).

* learning-rate scaling rules: :func:`scale_lr` (linear, Goyal et al. 2017; square
  root, Krizhevsky 2014 / Hoffer et al. 2017);
* schedules as ``LambdaLR`` factors, stepped once per optimiser step:
  :func:`warmup`, :func:`lr_schedule`, :func:`lambda_lr`;
* layer-wise adaptive optimisers: :class:`LARS` (You et al. 2017; its trust ratio is
  :func:`lars_trust_ratio`) and :class:`LAMB` (You et al. 2019), with their last trust
  ratios kept for plotting (:func:`trust_ratios`, the :class:`TrustRatioRecorder`
  Trainer callback);
* ghost batch normalisation: :class:`GhostBatchNorm1d`, :class:`GhostBatchNorm2d`,
  :func:`ghost_batch_norm` (Hoffer et al. 2017);
* LARC (LARS with a clip, as in apex) and NovoGrad (layer-wise second moments,
  Ginsburg et al. 2019): :class:`LARC`, :class:`NovoGrad`;
* per-sample multiplicative gradient noise with σ² ∝ B (Hoffer et al. 2017):
  :func:`noise_std`, :class:`SampleNoiseLoss`, :func:`weighted_mean_covariance`;
* growing the batch instead of decaying the learning rate: :class:`BatchGrowth` and
  its Trainer callback :class:`GrowBatch` (Smith et al. 2017).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from .train import Callback, unwrap

Factor = Callable[[int], float]

# ---------------------------------------------------------------------------
# Learning-rate scaling rules
# ---------------------------------------------------------------------------

SCALING_RULES = ("linear", "sqrt", "none")


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """The learning rate for ``batch`` when ``base_lr`` was right for ``base_batch``.

    ``linear``: ``base_lr · batch / base_batch`` — k times the batch makes one step
    do the work of k small ones (Goyal et al. 2017).
    ``sqrt``: ``base_lr · sqrt(batch / base_batch)`` — keeps the variance of the
    update the same (Krizhevsky 2014; Hoffer et al. 2017).
    ``none``: ``base_lr`` unchanged (the naive large batch).
    """
    if base_lr <= 0 or base_batch <= 0 or batch <= 0:
        raise ValueError(
            f"base_lr, base_batch and batch must be positive, got {base_lr}, {base_batch}, {batch}"
        )
    k = batch / base_batch
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown scaling rule {rule!r}; use one of {', '.join(SCALING_RULES)}")


# ---------------------------------------------------------------------------
# Schedules: functions step -> factor, for torch.optim.lr_scheduler.LambdaLR.
# ``step`` counts optimiser steps already taken, so factor(0) is the first update's.
# ---------------------------------------------------------------------------


def warmup(warmup_steps: int, start_factor: float = 0.0) -> Factor:
    """Gradual linear warm-up (Goyal et al. 2017) as a ``LambdaLR`` factor.

    The factor rises by a constant amount per update from ``start_factor`` and
    reaches 1 at update number ``warmup_steps`` (``step = warmup_steps - 1``), then
    stays at 1. Goyal et al. start from the small-batch rate: ``start_factor = 1/k``.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= start_factor <= 1.0:
        raise ValueError(f"start_factor must be in [0, 1], got {start_factor}")

    def factor(step: int) -> float:
        if step >= warmup_steps:
            return 1.0
        return start_factor + (1.0 - start_factor) * (step + 1) / warmup_steps

    return factor


def lr_schedule(
    total_steps: int,
    *,
    warmup_steps: int = 0,
    warmup_start: float = 0.0,
    decay: str = "none",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    final_factor: float = 0.0,
) -> Factor:
    """Warm-up followed by a decay, as one ``LambdaLR`` factor per optimiser step.

    ``decay``: ``none`` (constant), ``cosine`` (to ``final_factor`` at
    ``total_steps``), ``linear`` (same, in a straight line) or ``step`` (multiply by
    ``gamma`` at each step in ``milestones``). The decay runs over the steps after
    the warm-up.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) > total_steps ({total_steps})")
    if decay not in ("none", "cosine", "linear", "step"):
        raise ValueError(f"unknown decay {decay!r}; use none, cosine, linear or step")
    rise = warmup(warmup_steps, warmup_start)
    span = max(1, total_steps - warmup_steps)
    marks = sorted(milestones)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return rise(step)
        progress = min(1.0, (step - warmup_steps) / span)
        if decay == "cosine":
            return final_factor + (1 - final_factor) * 0.5 * (1 + math.cos(math.pi * progress))
        if decay == "linear":
            return final_factor + (1 - final_factor) * (1 - progress)
        if decay == "step":
            return gamma ** sum(step >= m for m in marks)
        return 1.0

    return factor


def lambda_lr(optimizer: Optimizer, factor: Factor) -> LambdaLR:
    """A ``LambdaLR`` that applies ``factor`` to every parameter group."""
    return LambdaLR(optimizer, lr_lambda=factor)


# ---------------------------------------------------------------------------
# Layer-wise adaptive optimisers
# ---------------------------------------------------------------------------


def _is_excluded(p: torch.Tensor, group: dict) -> bool:
    """Biases and normalisation weights (1-D tensors) skip decay and adaptation."""
    return bool(group["exclude_bias_and_norm"]) and p.ndim <= 1


def _safe_ratio(
    numerator: torch.Tensor, w_norm: torch.Tensor, u_norm: torch.Tensor
) -> torch.Tensor:
    """``numerator / u_norm``, or 1 when either norm is zero (a fresh zero-initialised
    layer or a layer with no gradient would otherwise never move or divide by 0).
    Computed without ``.item()`` so that a GPU step never waits for the host."""
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(
        ok, numerator / torch.where(ok, u_norm, torch.ones_like(u_norm)), torch.ones_like(w_norm)
    )


def lars_trust_ratio(
    w: torch.Tensor,
    g: torch.Tensor,
    trust_coefficient: float = 0.001,
    weight_decay: float = 0.0,
    eps: float = 0.0,
) -> torch.Tensor:
    """LARS's local learning rate of one layer: ``η ‖w‖ / (‖g‖ + β‖w‖ + eps)``,
    or 1 when ``‖w‖`` or the denominator is 0 (a 0-dim tensor)."""
    w_norm, g_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    return _safe_ratio(trust_coefficient * w_norm, w_norm, g_norm + weight_decay * w_norm + eps)


def _check_rates(
    lr: float, momentum: float | None = None, betas: tuple[float, float] | None = None
) -> None:
    """The checks every optimiser here makes of its learning rate and averaging factors."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be in [0, 1), got {betas}")


def _check_trust(weight_decay: float, trust_coefficient: float, eps: float) -> None:
    """The checks LARS and LARC make of their trust ratio's terms."""
    if weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
        raise ValueError("weight_decay and eps must be >= 0 and trust_coefficient > 0")


class _PerTensor(Optimizer):
    """An optimiser whose update of a tensor reads only that tensor, its gradient, its
    state and its group's settings: :meth:`step` visits every parameter that has a
    gradient and each subclass writes the update of one (``_update``)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; the loss of ``closure``
        (re-evaluated with gradients on, as torch.optim does), if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError


class LARS(_PerTensor):
    """Layer-wise Adaptive Rate Scaling (You, Gitman & Ginsburg 2017, Algorithm 1).

    For each parameter tensor ``w`` (a "layer") with gradient ``g``::

        local_lr = η · ‖w‖ / (‖g‖ + β‖w‖)           (the trust ratio; 1 if a norm is 0)
        v ← m · v + γ · local_lr · (g + β w)
        w ← w − v

    with global learning rate ``γ = lr``, trust coefficient ``η``, weight decay
    ``β`` and momentum ``m``. With ``exclude_bias_and_norm=True``, 1-D tensors
    (biases, BatchNorm weights) use ``local_lr = 1`` and no weight decay, i.e. plain
    SGD with momentum. The last trust ratio of each tensor is kept in
    ``optimizer.state[p]["trust_ratio"]`` (see :func:`trust_ratios`). A subclass may
    override :meth:`trust_ratio` to try another rule.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        exclude_bias_and_norm: bool = False,
    ) -> None:
        _check_rates(lr, momentum=momentum)
        _check_trust(weight_decay, trust_coefficient, eps)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            exclude_bias_and_norm=exclude_bias_and_norm,
        )
        super().__init__(params, defaults)

    def trust_ratio(self, w: torch.Tensor, g: torch.Tensor, group: dict) -> torch.Tensor:
        """The local learning rate of tensor ``w`` with gradient ``g`` (0-dim tensor)."""
        return lars_trust_ratio(
            w, g, group["trust_coefficient"], group["weight_decay"], group["eps"]
        )

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        """One LARS update of tensor ``p``."""
        if _is_excluded(p, group):
            d, ratio = g, torch.ones((), device=p.device)
        else:
            wd = group["weight_decay"]
            ratio = self.trust_ratio(p, g, group)
            d = g.add(p, alpha=wd) if wd else g
            d = d * ratio
        state["trust_ratio"] = ratio
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p)
        buf.mul_(group["momentum"]).add_(d, alpha=group["lr"])
        p.sub_(buf)


class LAMB(_PerTensor):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019, Algorithm 2).

    Adam's moments, then a per-tensor trust ratio::

        m ← β1 m + (1 − β1) g          v ← β2 v + (1 − β2) g²
        m̂ = m / (1 − β1ᵗ)              v̂ = v / (1 − β2ᵗ)      (if bias_correction)
        u = m̂ / (√v̂ + ε) + λ w
        w ← w − lr · (‖w‖ / ‖u‖) · u    (the trust ratio; 1 if a norm is 0)

    With ``exclude_bias_and_norm=True``, 1-D tensors use ratio 1 and no weight decay
    (an AdamW-style step). The last trust ratio of each tensor is kept in
    ``optimizer.state[p]["trust_ratio"]``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        exclude_bias_and_norm: bool = False,
    ) -> None:
        _check_rates(lr, betas=betas)
        if eps <= 0 or weight_decay < 0:
            raise ValueError("eps must be > 0 and weight_decay >= 0")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            exclude_bias_and_norm=exclude_bias_and_norm,
        )
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        """One LAMB update of tensor ``p``."""
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if group["bias_correction"]:
            m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        else:
            m_hat, v_hat = m, v
        u = m_hat / (v_hat.sqrt() + group["eps"])
        if _is_excluded(p, group):
            ratio = torch.ones((), device=p.device)
        else:
            if group["weight_decay"]:
                u.add_(p, alpha=group["weight_decay"])
            w_norm = torch.linalg.vector_norm(p)
            ratio = _safe_ratio(w_norm, w_norm, torch.linalg.vector_norm(u))
        state["trust_ratio"] = ratio
        p.sub_(u * (group["lr"] * ratio))


class LARC(_PerTensor):
    """Layer-wise Adaptive Rate Control: LARS with an optional clip (NVIDIA's LARC, as
    in apex; the deck's ``min(γ, η‖w‖/‖g‖)``), on SGD with momentum.

    For each tensor ``w`` with gradient ``g`` (the weight decay ``β`` moves into the
    gradient, as apex does)::

        local = η ‖w‖ / (‖g‖ + β‖w‖ + eps)           (skipped, = 1, if a norm is 0)
        clip:  local = min(local / γ, 1)             (so γ·local = min(γ, η‖w‖/‖g‖…))
        d = local · (g + β w)
        v ← m · v + d ;  w ← w − γ · v                (torch.optim.SGD's momentum)

    ``mode="scale"`` keeps ``γ · local`` unclipped: LARS's local rate. In clip mode
    the global rate ``γ`` is a ceiling that the layer's own rate never exceeds, so a
    layer whose ``η‖w‖/‖g‖`` is small moves slowly and the others move at ``γ``.
    ``state[p]["trust_ratio"]`` keeps ``γ · local / γ = local`` for plotting.
    """

    MODES = ("clip", "scale")

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.02,
        eps: float = 1e-8,
        mode: str = "clip",
        exclude_bias_and_norm: bool = False,
    ) -> None:
        _check_rates(lr, momentum=momentum)
        _check_trust(weight_decay, trust_coefficient, eps)
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            mode=mode,
            exclude_bias_and_norm=exclude_bias_and_norm,
        )
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        """One LARC update of tensor ``p``."""
        lr, wd = group["lr"], group["weight_decay"]
        if _is_excluded(p, group):
            d, local = g, torch.ones((), device=p.device)
        else:
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
            local = _safe_ratio(
                group["trust_coefficient"] * w_norm, w_norm, g_norm + wd * w_norm + group["eps"]
            )
            if group["mode"] == "clip":
                local = torch.clamp(local / lr, max=1.0)
            ok = (w_norm > 0) & (g_norm > 0)  # apex leaves such a tensor's gradient as is
            local = torch.where(ok, local, torch.ones_like(local))
            d = torch.where(ok, g.add(p, alpha=wd) if wd else g, g) * local
        state["trust_ratio"] = local
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = d.clone()
        else:
            buf.mul_(group["momentum"]).add_(d)
        p.sub_(buf, alpha=lr)


class NovoGrad(_PerTensor):
    """NovoGrad: SGD with momentum on gradients normalised by layer-wise second moments
    (Ginsburg et al. 2019, Algorithm 1).

    For each tensor ("layer") ``w`` with gradient ``g`` at step ``t``; ``v`` is one
    number per layer, not one per element as in Adam::

        t = 1:  v = ‖g‖²                  m = g / √v + d·w
        t > 1:  v ← β2 v + (1 − β2) ‖g‖²  m ← β1 m + (g / (√v + ε) + d·w)
        w ← w − lr · m

    with weight decay ``d``. ``grad_averaging=True`` multiplies the new term of ``m``
    by ``1 − β1`` (a common variant; the paper's rule is the default). With
    ``exclude_bias_and_norm=True`` 1-D tensors get no weight decay.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.01,
        betas: tuple[float, float] = (0.95, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_averaging: bool = False,
        exclude_bias_and_norm: bool = False,
    ) -> None:
        _check_rates(lr, betas=betas)
        if eps < 0 or weight_decay < 0:
            raise ValueError("eps and weight_decay must be >= 0")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            exclude_bias_and_norm=exclude_bias_and_norm,
        )
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        """One NovoGrad update of tensor ``p``."""
        beta1, beta2 = group["betas"]
        sq = torch.linalg.vector_norm(g).square()
        wd = 0.0 if _is_excluded(p, group) else group["weight_decay"]
        if not state:
            state["step"] = 1
            state["v"] = sq.clone()
            u = g / torch.clamp(sq.sqrt(), min=torch.finfo(g.dtype).tiny)
            if wd:
                u = u.add(p, alpha=wd)
            state["m"] = u
        else:
            state["step"] += 1
            state["v"].mul_(beta2).add_(sq, alpha=1 - beta2)
            u = g / (state["v"].sqrt() + group["eps"])
            if wd:
                u = u.add(p, alpha=wd)
            if group["grad_averaging"]:
                u = u * (1 - beta1)
            state["m"].mul_(beta1).add_(u)
        p.sub_(state["m"], alpha=group["lr"])


def trust_ratios(model: nn.Module, optimizer: Optimizer) -> dict[str, float]:
    """The last trust ratio of each of ``model``'s parameters, by parameter name.

    Works for :class:`LARS` and :class:`LAMB` after at least one step; parameters
    that have not been updated yet are left out.
    """
    out = {}
    for name, p in model.named_parameters():
        ratio = optimizer.state.get(p, {}).get("trust_ratio")
        if ratio is not None:
            out[name] = float(ratio)
    return out


class TrustRatioRecorder(Callback):
    """Trainer callback: the trust ratio of each layer every ``every`` optimiser
    steps, to plot how LARS/LAMB adapt each layer's step.

    ``records`` is a list of ``{"step": s, "<parameter name>": ratio, ...}``.
    """

    def __init__(self, every: int = 1) -> None:
        if every <= 0:
            raise ValueError(f"every must be positive, got {every}")
        self.every = every
        self.records: list[dict[str, float]] = []

    def on_batch_end(self, trainer, step: int, loss: torch.Tensor) -> None:
        """Read the optimiser's trust ratios after an update."""
        if step % self.every == 0:
            ratios = trust_ratios(unwrap(trainer.model), trainer.optimizer)
            if ratios:
                self.records.append({"step": step, **ratios})


# ---------------------------------------------------------------------------
# Ghost batch normalisation
# ---------------------------------------------------------------------------


class _GhostBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose training statistics come from virtual ("ghost") batches.

    In training, the batch is cut into ``ceil(B / ghost_batch_size)`` nearly equal
    chunks and each is normalised with its own mean and variance, so a large batch
    sees the noisier statistics of small ones (Hoffer et al. 2017). The running
    statistics are updated once per chunk. In evaluation it is ordinary batch norm.
    When ``ghost_batch_size >= B`` it is exactly ``BatchNorm``.
    """

    def __init__(self, num_features: int, ghost_batch_size: int = 32, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        if ghost_batch_size <= 0:
            raise ValueError(f"ghost_batch_size must be positive, got {ghost_batch_size}")
        self.ghost_batch_size = ghost_batch_size

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ghost_batch_size={self.ghost_batch_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or x.shape[0] <= self.ghost_batch_size:
            return super().forward(x)
        n_chunks = math.ceil(x.shape[0] / self.ghost_batch_size)
        outputs = []
        for chunk in torch.tensor_split(x, n_chunks):
            if self.track_running_stats:
                self.num_batches_tracked.add_(1)
                factor = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
            else:
                factor = 0.0
            outputs.append(
                F.batch_norm(
                    chunk,
                    self.running_mean,
                    self.running_var,
                    self.weight,
                    self.bias,
                    True,
                    factor,
                    self.eps,
                )
            )
        return torch.cat(outputs)


class GhostBatchNorm1d(_GhostBatchNorm):
    """:class:`torch.nn.BatchNorm1d` with ghost batches; see :class:`_GhostBatchNorm`."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input, got {x.dim()}D")


class GhostBatchNorm2d(_GhostBatchNorm):
    """:class:`torch.nn.BatchNorm2d` with ghost batches; see :class:`_GhostBatchNorm`."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(f"expected 4D input, got {x.dim()}D")


def ghost_batch_norm(model: nn.Module, ghost_batch_size: int) -> nn.Module:
    """Replace every ``BatchNorm1d``/``BatchNorm2d`` in ``model`` by its ghost version
    (same parameters and running statistics), in place; returns ``model``."""
    for name, child in model.named_children():
        kind = {nn.BatchNorm1d: GhostBatchNorm1d, nn.BatchNorm2d: GhostBatchNorm2d}.get(type(child))
        if kind is None:
            ghost_batch_norm(child, ghost_batch_size)
            continue
        ghost = kind(
            child.num_features,
            ghost_batch_size,
            eps=child.eps,
            momentum=child.momentum,
            affine=child.affine,
            track_running_stats=child.track_running_stats,
        )
        ghost.load_state_dict(child.state_dict())
        ghost.to(next(child.buffers(), torch.empty(0)).device)
        ghost.train(child.training)
        setattr(model, name, ghost)
    return model


# ---------------------------------------------------------------------------
# Gradient noise
# ---------------------------------------------------------------------------


def noise_std(batch: int, small_batch: int, scale: float = 1.0) -> float:
    """σ of the per-sample multiplicative noise that gives a batch of ``batch`` the
    gradient covariance of a batch of ``small_batch`` (Hoffer et al. 2017, section 5).

    With per-sample gradients of covariance Σ, the mean of ``batch`` of them weighted by
    ``z_n ~ N(1, σ²)`` has covariance ``((1 + σ²) Σ + σ² ḡḡᵀ) / batch``; equal to a small
    batch's ``Σ / small_batch`` (up to the ḡḡᵀ term, small while the noise dominates the
    mean gradient) when ``σ² = batch / small_batch − 1``, which grows like the batch.
    ``scale`` multiplies σ² (1: the small batch's covariance; 0: no noise).
    """
    if batch <= 0 or small_batch <= 0 or scale < 0:
        raise ValueError("batch and small_batch must be positive and scale >= 0")
    if batch < small_batch:
        raise ValueError(f"batch {batch} < small_batch {small_batch}: nothing to put back")
    return math.sqrt(scale * (batch / small_batch - 1))


class SampleNoiseLoss:
    """A loss that multiplies **each sample's** loss by ``z_n ~ N(1, σ²)`` before the
    mean: its gradient is ``(1/M) Σ z_n ∇ℓ_n``, each sample's gradient scaled by its own
    ``z_n`` (Hoffer et al. 2017's multiplicative noise). Pass it as the Trainer's
    ``loss_fn``. The noise is drawn only where gradients are computed
    (``torch.is_grad_enabled()``), so evaluation sees the plain mean loss.

    ``loss_fn(logits, y, reduction="none")`` gives the per-sample losses (default:
    cross-entropy); ``seed`` makes the noise reproducible.
    """

    def __init__(
        self,
        sigma: float,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed: int | None = None,
    ) -> None:
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        self.sigma = sigma
        self.loss_fn = loss_fn or F.cross_entropy
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def weights(
        self, n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``n`` draws of ``z ~ N(1, σ²)``."""
        device = torch.device(device)
        eps = torch.randn(n, generator=self._generator(device), device=device, dtype=dtype)
        return 1 + self.sigma * eps

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_sample = self.loss_fn(logits, y, reduction="none")
        if self.sigma == 0 or not torch.is_grad_enabled():
            return per_sample.mean()
        z = self.weights(per_sample.shape[0], per_sample.device, per_sample.dtype)
        return (z * per_sample).mean()


def weighted_mean_covariance(
    grads: torch.Tensor, batch: int, sigma: float, draws: int, seed: int = 0, chunk: int = 256
) -> torch.Tensor:
    """Monte-Carlo covariance of ``(1/B) Σ z_n g_n`` over batches of ``batch`` per-sample
    gradients drawn with replacement from the rows of ``grads`` (N × d) and
    ``z_n ~ N(1, σ²)``: what :class:`SampleNoiseLoss` does to the gradient, measured."""
    if grads.ndim != 2 or batch <= 0 or draws < 2:
        raise ValueError("grads must be N × d, batch > 0 and draws >= 2")
    gen = torch.Generator().manual_seed(seed)
    g = grads.double()
    means = []
    for start in range(0, draws, chunk):
        r = min(chunk, draws - start)
        idx = torch.randint(len(g), (r, batch), generator=gen)
        z = 1 + sigma * torch.randn(r, batch, generator=gen, dtype=torch.float64)
        means.append((z.unsqueeze(-1) * g[idx]).mean(1))
    return torch.cov(torch.cat(means).T).reshape(g.shape[1], g.shape[1])


# ---------------------------------------------------------------------------
# Growing the batch instead of decaying the learning rate
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchGrowth:
    """ "Don't decay the learning rate, increase the batch size" (Smith et al. 2017).

    Where a step schedule would multiply the learning rate by ``1/factor`` at each
    epoch in ``milestones``, multiply the batch size by ``factor`` instead. Once the
    batch would exceed ``max_batch`` it stays there and the remaining factor is
    taken from the learning rate, as in the paper.
    """

    base_batch: int
    factor: float
    milestones: tuple[int, ...]
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.base_batch <= 0 or self.factor < 1:
            raise ValueError("base_batch must be positive and factor >= 1")
        if list(self.milestones) != sorted(self.milestones):
            raise ValueError(f"milestones must be increasing, got {self.milestones}")

    def _stage(self, epoch: int) -> int:
        return sum(epoch >= m for m in self.milestones)

    def batch_size(self, epoch: int) -> int:
        """The batch size to use during ``epoch`` (0-based)."""
        batch = round(self.base_batch * self.factor ** self._stage(epoch))
        return min(batch, self.max_batch) if self.max_batch else batch

    def lr_factor(self, epoch: int) -> float:
        """The learning-rate multiplier during ``epoch``: 1 until the batch hits
        ``max_batch``, then the part of the decay the batch could not take."""
        wanted = self.factor ** self._stage(epoch)
        achieved = self.batch_size(epoch) / self.base_batch
        return achieved / wanted

    def phases(self, epochs: int) -> list[tuple[int, int, float]]:
        """``(n_epochs, batch_size, lr_factor)`` for each stretch of constant settings."""
        out: list[tuple[int, int, float]] = []
        for e in range(epochs):
            key = (self.batch_size(e), self.lr_factor(e))
            if out and (out[-1][1], out[-1][2]) == key:
                out[-1] = (out[-1][0] + 1, *key)
            else:
                out.append((1, *key))
        return out

    def updates(self, n_train: int, epochs: int, drop_last: bool = False) -> int:
        """The number of optimiser steps over ``epochs`` on ``n_train`` samples."""
        per = (lambda b: n_train // b) if drop_last else (lambda b: math.ceil(n_train / b))
        return sum(n * per(b) for n, b, _ in self.phases(epochs))


class GrowBatch(Callback):
    """Trainer callback that follows a :class:`BatchGrowth` schedule: at the start of
    each epoch it sets ``loader.batch_size`` and, once the batch is capped, scales the
    learning rate by :meth:`BatchGrowth.lr_factor` (on top of any ``LambdaLR``)."""

    def __init__(self, loader, growth: BatchGrowth) -> None:
        if not hasattr(loader, "batch_size"):
            raise TypeError(
                "GrowBatch needs a loader with a settable batch_size "
                "(e.g. lab_utils.loader.TensorLoader)"
            )
        self.loader, self.growth = loader, growth
        self._base_lrs: list[float] | None = None

    def on_fit_start(self, trainer) -> None:
        """Remember the learning rates the schedule scales."""
        sched = trainer.scheduler
        if sched is not None and not isinstance(sched, LambdaLR):
            raise TypeError(
                f"GrowBatch works with no scheduler or a LambdaLR, got {type(sched).__name__}"
            )
        if self._base_lrs is None:
            self._base_lrs = (
                list(sched.base_lrs)
                if sched is not None
                else [g["lr"] for g in trainer.optimizer.param_groups]
            )

    def on_epoch_start(self, trainer, epoch: int) -> None:
        """Set this epoch's batch size and learning-rate factor."""
        self.loader.batch_size = self.growth.batch_size(epoch)
        factor = self.growth.lr_factor(epoch)
        sched = trainer.scheduler
        for i, (group, base) in enumerate(
            zip(trainer.optimizer.param_groups, self._base_lrs, strict=True)
        ):
            group["lr"] = base * factor
            if sched is not None:
                sched.base_lrs[i] = base * factor
                group["lr"] *= sched.lr_lambdas[i](sched.last_epoch)
