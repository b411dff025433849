"""Read a submission's checkpoint without trusting it, and rebuild the model.

The checkpoint contract (set by ``assessment/starter.py``): rank 0 saves
``checkpoint.pt`` in its working directory as ``{"arch": str, "kwargs": dict,
"state_dict": dict[str, Tensor]}`` (``lab_utils.models.save`` writes exactly that;
extra keys are ignored). Here, in the grader's own process:

* the file must be a regular file inside the working directory (no link);
* no larger than the target's cap, on disk and unpacked: the sizes its zip directory
  gives for its entries must add up to no more than the cap, and every entry must be
  stored, as ``torch.save`` writes it, not compressed (a deflated file of a few MB
  would otherwise unpack to GBs inside ``torch.load``); checked before it is read;
* it is read with ``torch.load(weights_only=True)``, which refuses pickled code;
* ``arch`` must be allowed by the target and known to ``lab_utils.models``;
* the model is first built on the ``meta`` device (no memory) to compare every
  key and shape, then built for real; weights must be finite.

Every problem raises :class:`CheckpointRejected` carrying the verdict's reason.
"""

from __future__ import annotations

import os
import pickle
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from lab_utils import models

CHECKPOINT_NAME = "checkpoint.pt"
_PLAIN = (str, int, float, bool, type(None))


class CheckpointRejected(Exception):
    """The checkpoint cannot be graded; ``reason`` is a :data:`report.REASONS` key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _plain(value: Any) -> bool:
    """True for JSON-like values: what model kwargs may hold."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def locate(workdir: Path) -> Path:
    """The checkpoint file in ``workdir``, refusing links and anything but a regular file."""
    path = workdir / CHECKPOINT_NAME
    try:
        st = path.lstat()
    except FileNotFoundError:
        stray = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*.pt"))[:5]
        hint = f" (found {', '.join(stray)} instead)" if stray else ""
        raise CheckpointRejected(
            "no_checkpoint",
            f"the job exited cleanly but wrote no {CHECKPOINT_NAME} in its "
            f"working directory{hint}. Rank 0 must save the final model there, e.g. "
            f"lab_utils.models.save('{CHECKPOINT_NAME}', model).",
        ) from None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        raise CheckpointRejected(
            "checkpoint_outside",
            f"{CHECKPOINT_NAME} is a symbolic link to {target}. The "
            "checkpoint must be a regular file written inside the working directory.",
        )
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointRejected("checkpoint_outside", f"{CHECKPOINT_NAME} is not a regular file")
    real = path.resolve()
    if real.parent != workdir.resolve():
        raise CheckpointRejected(
            "checkpoint_outside", f"{CHECKPOINT_NAME} resolves to {real}, outside {workdir}"
        )
    return path


def read(path: Path, max_mb: float) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of ``path``, checked for the contract's keys."""
    size_mb = path.stat().st_size / 2**20
    if size_mb > max_mb:
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{path.name} is {size_mb:.0f} MB; the target allows at most {max_mb:g} MB",
        )
    obj = _load(path, max_mb)
    _check_contract(obj, path.name)
    return obj


def _load(path: Path, max_mb: float) -> Any:
    """``torch.load(weights_only=True)`` of a zip written by torch.save, or the refusal."""
    # O_NOFOLLOW: a link swapped in after locate() is refused, not followed.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        with os.fdopen(fd, "rb") as f:
            if not zipfile.is_zipfile(f):
                raise CheckpointRejected(
                    "unreadable_checkpoint",
                    f"{path.name} is not a file written by torch.save (not a zip archive)",
                )
            _check_entries(f, path.name, max_mb)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)
    except CheckpointRejected:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointRejected(
            "unsafe_checkpoint",
            f"{path.name} is not plain tensors and containers: "
            f"torch.load(weights_only=True) refused it ({_why_refused(e)}). Save "
            "{'arch', 'kwargs', 'state_dict': model.state_dict()}, not the model object "
            "or other Python objects.",
        ) from None
    except Exception as e:  # truncated zip, not a torch file, ...
        if out_of_memory(e):
            raise CheckpointRejected(
                "bad_checkpoint",
                f"{path.name} needs more memory to read than the grader allows for a "
                f"checkpoint of at most {max_mb:g} MB",
            ) from None
        raise CheckpointRejected(
            "unreadable_checkpoint",
            f"{path.name} cannot be read by torch.load: {type(e).__name__}: {e}",
        ) from None


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says an allocation failed (torch's CPU allocator raises a
    RuntimeError, "DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e)


def _check_entries(f: BinaryIO, name: str, max_mb: float) -> None:
    """Refuse, from the zip's central directory alone (nothing is unpacked), a file
    that would unpack past ``max_mb`` or whose entries ``torch.save`` cannot have
    written: it stores every entry uncompressed (the header of its writer,
    ``torch/include/caffe2/serialize/inline_container.h``: "All files are stored
    uncompressed"; tests/test_grader.py checks the files torch writes)."""
    try:
        with zipfile.ZipFile(f) as archive:  # a file object: closing it leaves f open
            entries = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise CheckpointRejected(
            "unreadable_checkpoint", f"{name} has a broken zip directory: {e}"
        ) from None
    unpacked = sum(e.file_size for e in entries)
    if unpacked > max_mb * 2**20:
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{name} would unpack to {unpacked / 2**20:.0f} MB (its zip directory says "
            f"so); the target allows at most {max_mb:g} MB, so it was not read",
        )
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise CheckpointRejected(
            "unreadable_checkpoint",
            f"{name} holds compressed entries ({', '.join(packed[:3])}"
            + (" ..." if len(packed) > 3 else "")
            + "): torch.save stores every entry uncompressed, so it did not write this "
            "file. Save with lab_utils.models.save and do not re-pack the file.",
        )


def _check_contract(obj: Any, name: str) -> None:
    """A dict of a registry name, plain keyword arguments and a tensor state_dict."""
    if not isinstance(obj, dict):
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{name} holds a {type(obj).__name__}, not a dict {{arch, kwargs, state_dict}}",
        )
    missing = [k for k in ("arch", "kwargs", "state_dict") if k not in obj]
    if missing:
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{name} lacks {', '.join(missing)}; it has {', '.join(map(str, obj)) or 'no keys'}",
        )
    if not isinstance(obj["arch"], str):
        raise CheckpointRejected("bad_checkpoint", "'arch' must be a registry name (a string)")
    if not isinstance(obj["kwargs"], dict) or not _plain(obj["kwargs"]):
        raise CheckpointRejected(
            "bad_checkpoint", "'kwargs' must be a dict of plain values (numbers, strings, lists)"
        )
    sd = obj["state_dict"]
    if not isinstance(sd, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        raise CheckpointRejected(
            "bad_checkpoint",
            "'state_dict' must map parameter names to "
            "tensors (model.state_dict() of the bare model)",
        )


def _why_refused(e: Exception) -> str:
    """The informative line of torch's long refusal message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported" in line or "GLOBAL" in line:
            return line
    return lines[0] if lines else type(e).__name__


def _strip_wrapper_prefix(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Keys saved from a DDP wrapper start with ``module.``; accept them, and say so."""
    if sd and all(k.startswith("module.") for k in sd):
        return {k[len("module.") :]: v for k, v in sd.items()}, True
    return sd, False


def rebuild(ckpt: dict[str, Any], allowed: Sequence[str]) -> tuple[nn.Module, list[str]]:
    """The model described by ``ckpt``, rebuilt from the registry with its weights.

    Returns the model (on the CPU, in eval mode) and warnings for the report.
    """
    arch, kwargs = ckpt["arch"], ckpt["kwargs"]
    notes: list[str] = []
    if arch not in allowed:
        raise CheckpointRejected(
            "wrong_arch",
            f"arch {arch!r} is not allowed by this target (allowed: {', '.join(allowed)})",
        )
    if arch not in models.names():
        raise CheckpointRejected(
            "wrong_arch", f"arch {arch!r} is not in the lab_utils.models registry"
        )
    sd, stripped = _strip_wrapper_prefix(ckpt["state_dict"])
    if stripped:
        notes.append(
            "state_dict keys started with 'module.' (saved from the DDP wrapper); "
            "save the bare model's state_dict instead"
        )
    try:
        with torch.device("meta"):  # shapes only: a huge width costs no memory here
            skeleton = models.build(arch, **kwargs)
    except Exception as e:  # e.g. a negative width: the submission's fault, not ours
        raise CheckpointRejected(
            "wrong_arch", f"kwargs {kwargs} do not fit arch {arch!r}: {e}"
        ) from None
    _compare(skeleton.state_dict(), sd, arch, kwargs)
    for name, t in sd.items():
        if t.is_floating_point() or t.is_complex():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointRejected(
                    "nan_weights",
                    f"{name} holds {bad} NaN or infinite value(s) of "
                    f"{t.numel()}: training diverged (look at the learning rate and warm-up)",
                )
    model = models.build(arch, **kwargs)
    model.load_state_dict(sd, strict=True)
    return model.eval(), notes


def _compare(
    expected: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    arch: str,
    kwargs: dict[str, Any],
) -> None:
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    wrong = [
        f"{k}: {tuple(got[k].shape)} instead of {tuple(v.shape)}"
        for k, v in expected.items()
        if k in got and got[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
    if unexpected:
        problems.append(
            f"unexpected {', '.join(unexpected[:4])}" + (" ..." if len(unexpected) > 4 else "")
        )
    if wrong:
        problems.append("; ".join(wrong[:4]) + (" ..." if len(wrong) > 4 else ""))
    if problems:
        raise CheckpointRejected(
            "wrong_shape",
            f"the state_dict does not fit {arch}({_kwargs_text(kwargs)}): "
            + " | ".join(problems)
            + ". Save the model you trained with the arch and kwargs "
            "it was built with (lab_utils.models.save does this).",
        )


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def parameter_count(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def describe(ckpt: dict[str, Any], model: nn.Module, path: Path) -> dict[str, Any]:
    """What the report shows about an accepted checkpoint."""
    return {
        "arch": ckpt["arch"],
        "kwargs": ckpt["kwargs"],
        "parameters": parameter_count(model),
        "size_mb": round(path.stat().st_size / 2**20, 3),
    }
