"""A registry of models by name, so that a checkpoint ``{arch, kwargs, state_dict}``
can be rebuilt anywhere: by the Trainer, by a script under torchrun, by the grader.

    model = models.build("fmnist_cnn", width=16)
    models.save("run/model.pt", model, epoch=3)
    same = models.load("run/model.pt")        # torch.load(weights_only=True) + build

Every image model takes float images ``(N, C, H, W)`` and returns logits ``(N, num_classes)``;
``char_transformer`` (Lab 4) takes character ids ``(N, T)`` and returns ``(N, T, vocab)``.
Register your own with ``@models.register("name")`` on a class or a function whose
keyword arguments are plain values (numbers, strings, booleans, tuples).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "CheckpointError",
    "build",
    "checkpoint",
    "load",
    "names",
    "read_checkpoint",
    "register",
    "save",
]

Factory = TypeVar("Factory", bound=Callable[..., nn.Module])

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
_CHECKPOINT_KEYS = ("arch", "kwargs", "state_dict")
_PLAIN_TYPES = (bool, int, float, str, type(None))


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit its architecture."""


# --------------------------------------------------------------------------- registry
def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: make a model class or factory function buildable as ``build(name)``.

    Registering the same name again is allowed only for a redefinition of the same
    object (a re-run notebook cell); a different model under a taken name is an error.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a model name must be a non-empty string, got {name!r}")

    def decorator(factory: Factory) -> Factory:
        old = _REGISTRY.get(name)
        if old is not None and _qualified(old) != _qualified(factory):
            raise ValueError(f"model name {name!r} is already registered by {_qualified(old)}")
        _REGISTRY[name] = factory
        return factory

    return decorator


def _qualified(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def names() -> list[str]:
    """The registered architecture names, sorted."""
    _import_plugins()
    return sorted(_REGISTRY)


# Library modules that register models of their own (they import this one, so they
# cannot be imported at its top): loaded when a name is not found, so that
# ``load(checkpoint)`` rebuilds their models without an import by the caller.
_PLUGINS = ("lab_utils.moe",)


def _import_plugins() -> None:
    for module in _PLUGINS:
        importlib.import_module(module)


def build(arch: str, **kwargs: Any) -> nn.Module:
    """Build a registered model; it remembers ``arch_spec = {"arch", "kwargs"}``.

    ``arch_spec["kwargs"]`` holds every argument including the defaults, so the
    checkpoint rebuilds the same model even if a default changes later.
    """
    if arch not in _REGISTRY:
        _import_plugins()
    if arch not in _REGISTRY:
        raise ValueError(f"unknown model {arch!r}; registered: {', '.join(names())}")
    factory = _REGISTRY[arch]
    signature = inspect.signature(factory)
    try:
        bound = signature.bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"{arch}: {e}; its parameters are {signature}") from None
    bound.apply_defaults()
    full: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        kind = signature.parameters[key].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            full.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            full[key] = value
    model = factory(**full)
    model.arch_spec = {"arch": arch, "kwargs": full}
    return model


# --------------------------------------------------------------------------- checkpoints
def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel / DataParallel / torch.compile."""
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def checkpoint(model: nn.Module, **extra: Any) -> dict[str, Any]:
    """``{"arch", "kwargs", "state_dict", **extra}`` of a model made by :func:`build`.

    DDP / DataParallel / compiled wrappers are removed first, and the weights are
    copied to the CPU, so the dict loads anywhere and no longer changes with training.
    """
    net = unwrap(model)
    spec = getattr(net, "arch_spec", None)
    if spec is None:
        raise ValueError(
            "this model was not made by lab_utils.models.build(), so its "
            "architecture is unknown; build it by name to checkpoint it"
        )
    clash = sorted(set(extra) & set(_CHECKPOINT_KEYS))
    if clash:
        raise ValueError(f"extra entries may not be named {', '.join(clash)}")
    _check_plain(spec["kwargs"], f"{spec['arch']} kwargs")
    state = {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}
    return {"arch": spec["arch"], "kwargs": dict(spec["kwargs"]), "state_dict": state, **extra}


def _check_plain(value: Any, where: str) -> None:
    """A weights-only checkpoint can hold only tensors and plain values."""
    if isinstance(value, (*_PLAIN_TYPES, torch.Tensor)):
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, where)
    else:
        raise ValueError(
            f"{where}: {value!r} ({type(value).__name__}) cannot be stored in a "
            "weights-only checkpoint; use numbers, strings, booleans or tuples"
        )


def save(path: str | os.PathLike, model: nn.Module, **extra: Any) -> Path:
    """Write :func:`checkpoint` to ``path`` atomically (a crash leaves no half file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(checkpoint(model, **extra), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint dict at ``path``, loaded with ``weights_only=True`` and validated.

    Raises ``FileNotFoundError`` for a missing file and :class:`CheckpointError` for
    anything else: a file that is not a checkpoint, one holding arbitrary Python
    objects (refused, never executed), a bare ``state_dict``, or missing keys.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = _unpickler_reason(e)
        if "Unsupported global" not in reason:
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({reason})") from e
        raise CheckpointError(
            f"{path}: refused to load: it holds Python objects other than tensors and plain "
            f"containers, and weights-only loading does not run them ({reason}). Save "
            "checkpoints with lab_utils.models.save()."
        ) from e
    except Exception as e:  # zip, pickle and storage errors all mean "not a checkpoint"
        raise CheckpointError(
            f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{path}: expected a dict with keys arch, kwargs, state_dict; "
            f"found {type(obj).__name__}"
        )
    missing = [k for k in _CHECKPOINT_KEYS if k not in obj]
    if missing:
        hint = ""
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            hint = (
                " It looks like a bare model.state_dict(); save with "
                "lab_utils.models.save(path, model) so the architecture is recorded."
            )
        raise CheckpointError(f"{path}: missing {', '.join(missing)}.{hint}")
    state = obj["state_dict"]
    if not isinstance(obj["arch"], str) or not isinstance(obj["kwargs"], dict):
        raise CheckpointError(f"{path}: 'arch' must be a string and 'kwargs' a dict")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path}: 'state_dict' must map parameter names to tensors")
    return obj


def _unpickler_reason(error: Exception) -> str:
    """The one informative line of torch's long weights-only error message."""
    text = str(error)
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip()
    detail = detail.split(" was not an allowed global", 1)[0]
    return " ".join(detail.split("\n\n", 1)[0].split()) or type(error).__name__


def load(path: str | os.PathLike, map_location: Any = "cpu") -> nn.Module:
    """Rebuild the model saved at ``path`` from the registry, in eval mode.

    The weights must fit exactly (strict loading). With ``map_location`` a device
    (``"cpu"``, ``"cuda:0"``, ...), the model is moved there. A model registered by
    your own code needs that code imported first.
    """
    ckpt = read_checkpoint(path, map_location)
    arch, kwargs = ckpt["arch"], ckpt["kwargs"]
    if arch not in _REGISTRY:
        raise CheckpointError(
            f"{path}: unknown architecture {arch!r}; registered: "
            f"{', '.join(names())} (import the module that registers it)"
        )
    try:
        model = build(arch, **kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot build {arch} from the saved kwargs: {e}") from e
    try:
        model.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise CheckpointError(
            f"{path}: the weights do not fit {arch}({_format_kwargs(kwargs)}): {e}"
        ) from e
    if isinstance(map_location, str | torch.device):
        model.to(map_location)
    return model.eval()


def _format_kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


# --------------------------------------------------------------------------- building blocks
def _check_input(x: torch.Tensor, shape: tuple[int, ...], model: str) -> None:
    if x.dim() != 4 or tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"{model} expects images (N, {', '.join(map(str, shape))}), got {tuple(x.shape)}"
        )


def _conv_block(c_in: int, c_out: int, batch_norm: bool) -> nn.Sequential:
    """3×3 convolution, optional BatchNorm, ReLU (no conv bias when BN follows)."""
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    """``x + f(x)``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


# --------------------------------------------------------------------------- models
@register("linear")
class LinearClassifier(nn.Module):
    """Multinomial logistic regression on the flattened pixels."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.fc = nn.Linear(math.prod(self.input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.input_shape, "linear")
        return self.fc(x.flatten(1))


@register("mlp")
class MLP(nn.Module):
    """Fully connected network on the flattened pixels: ``hidden`` sizes, ReLU between."""

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        hidden: Sequence[int] = (256, 128),
    ) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        sizes = [math.prod(self.input_shape), *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        layers.append(nn.Linear(sizes[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.input_shape, "mlp")
        return self.net(x.flatten(1))


@register("fmnist_cnn")
class FashionCNN(nn.Module):
    """Small fast CNN for 28×28 images: three conv blocks (``width, 2·width, 4·width``
    channels), the first two halving the size, then a linear classifier on the 7×7 map.

    ``batch_norm=False`` gives a model without BatchNorm, whose data-parallel gradients
    equal the large-batch ones exactly.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        width: int = 16,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.features = nn.Sequential(
            _conv_block(in_channels, width, batch_norm),
            nn.MaxPool2d(2),
            _conv_block(width, 2 * width, batch_norm),
            nn.MaxPool2d(2),
            _conv_block(2 * width, 4 * width, batch_norm),
        )
        side = image_size // 4
        if side < 1:
            raise ValueError(f"fmnist_cnn needs image_size >= 4, got {image_size}")
        self.classifier = nn.Linear(4 * width * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.input_shape, "fmnist_cnn")
        return self.classifier(self.features(x).flatten(1))


@register("resnet_cifar")
class ResNetCIFAR(nn.Module):
    """Fast ResNet-style net (the "ResNet-9" of DAWNBench), any image size >= 8.

    prep ``width`` → ``2·width`` + pool + residual → ``4·width`` + pool →
    ``8·width`` + pool + residual → global max pool → linear, with logits scaled by
    ``logit_scale`` (a fixed temperature that lets it train at high learning rates).
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 64,
        batch_norm: bool = True,
        logit_scale: float = 0.125,
    ) -> None:
        super().__init__()
        w = width

        def residual(c: int) -> _Residual:
            return _Residual(
                nn.Sequential(_conv_block(c, c, batch_norm), _conv_block(c, c, batch_norm))
            )

        self.features = nn.Sequential(
            _conv_block(in_channels, w, batch_norm),
            _conv_block(w, 2 * w, batch_norm),
            nn.MaxPool2d(2),
            residual(2 * w),
            _conv_block(2 * w, 4 * w, batch_norm),
            nn.MaxPool2d(2),
            _conv_block(4 * w, 8 * w, batch_norm),
            nn.MaxPool2d(2),
            residual(8 * w),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(8 * w, num_classes, bias=False)
        self.in_channels = in_channels
        self.logit_scale = logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels or min(x.shape[2:]) < 8:
            raise ValueError(
                f"resnet_cifar expects images (N, {self.in_channels}, H>=8, W>=8), "
                f"got {tuple(x.shape)}"
            )
        return self.classifier(self.features(x)) * self.logit_scale


# --------------------------------------------------------------------------- Lab 4
class TokenEmbedding(nn.Module):
    """Character ids ``(N, T)`` → token + learned position embeddings ``(N, T, d)``."""

    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.dtype != torch.long or idx.shape[1] > self.pos.num_embeddings:
            raise ValueError(
                f"char_transformer expects int64 ids (N, T<={self.pos.num_embeddings}), "
                f"got {tuple(idx.shape)} {idx.dtype}"
            )
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with separate ``q``, ``k``, ``v`` and ``proj``
    layers, so tensor parallelism can split q/k/v by columns (heads) and ``proj`` by
    rows. The head count is read from the local width (``-1``), so a rank holding
    half the columns simply runs half the heads."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(n, t, -1, self.head_dim).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(n, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``;
    the MLP is ``fc1`` (d → 4d), GELU, ``fc2`` (4d → d)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(d_model, 4 * d_model))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and the projection to character logits."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


@register("char_transformer")
class CharTransformer(nn.Module):
    """A small decoder-only (GPT-style) transformer over characters.

    ``layers`` is the flat list ``[embed, block 0, ..., block L-1, head]`` so that a
    pipeline can cut it into contiguous stages (:meth:`stage_layers`).
    """

    def __init__(
        self,
        vocab: int = 96,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 4,
        max_len: int = 256,
    ) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            TokenEmbedding(vocab, d_model, max_len),
            *[Block(d_model, n_heads) for _ in range(n_layers)],
            LMHead(d_model, vocab),
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layers(idx)

    def stage_layers(self, stage: int, n_stages: int) -> list[int]:
        """Indices into ``layers`` of pipeline stage ``stage``: the blocks are split as
        evenly as possible; the embedding joins the first stage, the head the last."""
        n_blocks = len(self.layers) - 2
        if not 0 < n_stages <= n_blocks:
            raise ValueError(f"cannot cut {n_blocks} blocks into {n_stages} pipeline stages")
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} is not in 0..{n_stages - 1}")
        bounds = [round(i * n_blocks / n_stages) for i in range(n_stages + 1)]
        idx = list(range(1 + bounds[stage], 1 + bounds[stage + 1]))
        if stage == 0:
            idx = [0, *idx]
        if stage == n_stages - 1:
            idx = [*idx, len(self.layers) - 1]
        return idx
