"""Datasets as tensors: Fashion-MNIST, CIFAR-10, a synthetic CIFAR-10 stand-in, and
regression data with a known truth.

``load(name)`` returns a :class:`Dataset` of ``uint8`` images ``(N, C, H, W)`` and
``int64`` labels. It reads the official file formats (IDX gzip files; the
``cifar-10-batches-py`` pickles) from the first folder that holds them, in this order:

1. the ``root`` argument,
2. ``$LABS_DATA``,
3. the user cache (``$LABS_CACHE``, default ``~/.cache/lab_utils``),
4. system copies (Debian's ``dataset-fashion-mnist`` installs ``/usr/share/datasets/fashion-mnist``),
5. a download from the official source into the cache.

Every file is checked for structure (IDX magic number and sizes; pickle keys and
shapes) and checksum before use. Checksums cover the *decompressed* bytes, because
Debian recompresses the ``.gz`` files. Parsed tensors are cached in the process and
as a ``.pt`` file in the cache, so the second load is quick.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import math
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import urllib.request
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab_utils import paths

__all__ = [
    "CIFAR10_ARCHIVE_MD5",
    "CIFAR10_URL",
    "DataError",
    "Dataset",
    "FASHION_MNIST_URL",
    "NAMES",
    "TRAINING_ONLY",
    "channel_stats",
    "download_cifar10",
    "download_fashion_mnist",
    "load",
    "make_cifar10_archive",
    "read_cifar_batch",
    "read_idx",
    "synthetic_regression",
    "write_synthetic_cifar10",
]

NAMES = ("fashion-mnist", "cifar10", "synthetic-cifar10")

FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# sha256 of the decompressed files (Debian's package recompresses the .gz archives).
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte.gz": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte.gz": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte.gz": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
# md5 of each pickle inside the official archive (the values torchvision checks).
CIFAR10_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

SYNTHETIC_MANIFEST = "checksums.md5"
SYNTHETIC_CLASSES = tuple(f"pattern-{i}" for i in range(10))

SYSTEM_DIRS = (Path("/usr/share/datasets"), Path("/usr/local/share/datasets"))

# A folder holding this file is a copy of the training split alone (what the
# autograder's sandbox shows a submission): the test files are not needed there and
# the test split loads empty. ``Dataset.holdout`` then gives a validation part.
TRAINING_ONLY = "TRAINING_ONLY"
TEST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", "test_batch")

_TENSOR_CACHE_VERSION = 1


class DataError(RuntimeError):
    """A dataset is missing, truncated or corrupted; the message says what to do."""


# --------------------------------------------------------------------------- Dataset
@dataclass(frozen=True, repr=False)
class Dataset:
    """Images and labels of one dataset, as tensors.

    ``x_*`` are ``uint8`` ``(N, C, H, W)``; ``y_*`` are ``int64`` ``(N,)``; ``mean`` and
    ``std`` are per channel on the 0–1 scale (what a loader normalises with);
    ``source`` is the folder the files were read from. The tensors may be shared with
    other loads of the same files: treat them as read-only.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    def subset(
        self, n_train: int | None = None, n_test: int | None = None, seed: int = 0
    ) -> Dataset:
        """A random, reproducible subset of at most ``n_train`` / ``n_test`` images
        (``None`` or more than there are: all of them, shuffled)."""
        gen = torch.Generator().manual_seed(seed)
        x_train, y_train = _take(self.x_train, self.y_train, n_train, gen, "n_train")
        x_test, y_test = _take(self.x_test, self.y_test, n_test, gen, "n_test")
        return Dataset(
            self.name,
            x_train,
            y_train,
            x_test,
            y_test,
            self.classes,
            self.mean,
            self.std,
            self.source,
        )

    def holdout(self, n: int | float, seed: int = 0) -> Dataset:
        """The training split cut in two: ``n`` random training images (a float: that
        share of them) become the test split, a validation part to report accuracy
        on; the rest stay for training. The held-out test split is not used."""
        if isinstance(n, float):
            n = round(n * len(self.x_train))
        if not 0 < n < len(self.x_train):
            raise ValueError(f"holdout n must be in 1..{len(self.x_train) - 1}, got {n}")
        idx = torch.randperm(len(self.x_train), generator=torch.Generator().manual_seed(seed))
        val, train = idx[:n], idx[n:]
        return Dataset(
            self.name,
            self.x_train[train],
            self.y_train[train],
            self.x_train[val],
            self.y_train[val],
            self.classes,
            self.mean,
            self.std,
            self.source,
        )

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={len(self.x_train)}, test={len(self.x_test)}, "
            f"image_shape={self.image_shape}, classes={self.num_classes}, "
            f"source={self.source!r})"
        )


def _take(
    x: torch.Tensor, y: torch.Tensor, n: int | None, gen: torch.Generator, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if n is not None and n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    idx = torch.randperm(len(x), generator=gen)[:n]
    return x[idx], y[idx]


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std (0–1 scale) of ``uint8`` images ``(N, C, H, W)``.

    Counts the 256 pixel values of each channel instead of converting the whole set
    to float, so it needs no extra memory.
    """
    if x.dtype != torch.uint8 or x.dim() != 4:
        raise ValueError(f"expected uint8 images (N, C, H, W), got {x.dtype} {tuple(x.shape)}")
    values = torch.arange(256, dtype=torch.float64) / 255
    means, stds = [], []
    for c in range(x.shape[1]):
        counts = torch.bincount(x[:, c].reshape(-1), minlength=256).to(torch.float64)
        p = counts / counts.sum()
        mean = float((p * values).sum())
        means.append(mean)
        stds.append(float((p * (values - mean) ** 2).sum().sqrt()))
    return tuple(means), tuple(stds)


# --------------------------------------------------------------------------- load
@dataclass(frozen=True)
class _Kind:
    """How one dataset lies on disk and how to get it."""

    name: str
    files: tuple[str, ...]  # what a folder must hold
    subfolders: tuple[str, ...]  # where below a search folder those files may sit
    cache_folder: str  # where in the cache a download (or generation) goes
    read: Callable[[Path], dict[str, Any]]
    fetch: Callable[[Path], Path]  # fills the cache folder, returns it
    how_to_get: str


def load(name: str, root: str | os.PathLike | None = None, download: bool = True) -> Dataset:
    """Load ``fashion-mnist``, ``cifar10`` or ``synthetic-cifar10`` as a :class:`Dataset`.

    Searches ``root``, ``$LABS_DATA``, the cache, then system copies (each folder
    itself and the usual subfolder, e.g. ``<folder>/fashion-mnist`` or
    ``<folder>/cifar-10-batches-py``); the first folder holding every file wins. A
    copy that is found but corrupted raises :class:`DataError` rather than being
    skipped. With nothing found it downloads into the cache (``download=True``);
    ``synthetic-cifar10`` is generated there instead. Offline with no copy it raises
    a :class:`DataError` listing every folder searched and the files to put there.
    """
    kind = _kind(name)
    looked: list[tuple[str, Path, list[str]]] = []
    for label, folder in _search_folders(kind, root):
        missing = [f for f in _needed(kind, folder) if not (folder / f).is_file()]
        if not missing:
            return _dataset(kind, folder)
        looked.append((label, folder, missing))
    if kind.name != "synthetic-cifar10" and not download:
        raise DataError(_not_found_message(kind, looked, "download=False was given"))
    try:
        folder = kind.fetch(paths.cache_dir() / kind.cache_folder)
    except OSError as e:  # urllib's URLError is an OSError: offline, DNS, HTTP errors
        raise DataError(_not_found_message(kind, looked, f"the download failed: {e}")) from e
    missing = [f for f in kind.files if not (folder / f).is_file()]
    if missing:  # e.g. a half-filled folder of the user's own in the cache
        raise DataError(
            f"{folder}: still missing {', '.join(missing)}; delete the folder and load again."
        )
    return _dataset(kind, folder)


def _kind(name: str) -> _Kind:
    kinds = {
        "fashion-mnist": _Kind(
            "fashion-mnist",
            tuple(FASHION_MNIST_SHA256),
            ("fashion-mnist", "FashionMNIST/raw"),
            "fashion-mnist",
            _read_fashion_mnist,
            download_fashion_mnist,
            f"the four official .gz files from {FASHION_MNIST_URL} "
            "(or Debian's package dataset-fashion-mnist)",
        ),
        "cifar10": _Kind(
            "cifar10",
            tuple(CIFAR10_MD5),
            (CIFAR10_FOLDER, f"cifar10/{CIFAR10_FOLDER}"),
            "cifar10",
            _read_cifar10,
            download_cifar10,
            f"the contents of {CIFAR10_FOLDER}/ from {CIFAR10_URL}",
        ),
        "synthetic-cifar10": _Kind(
            "synthetic-cifar10",
            (*CIFAR10_MD5, SYNTHETIC_MANIFEST),
            ("synthetic-cifar10",),
            "synthetic-cifar10",
            _read_synthetic_cifar10,
            _generate_into,
            "a folder written by data.write_synthetic_cifar10()",
        ),
    }
    if name not in kinds:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(NAMES)}")
    return kinds[name]


def _search_folders(kind: _Kind, root: str | os.PathLike | None) -> list[tuple[str, Path]]:
    bases: list[tuple[str, Path]] = []
    if root is not None:
        bases.append(("root argument", Path(root).expanduser()))
    if os.environ.get("LABS_DATA"):
        bases.append(("$LABS_DATA", Path(os.environ["LABS_DATA"]).expanduser()))
    bases.append(("user cache", paths.cache_dir()))
    bases += [("system copy", d) for d in SYSTEM_DIRS]
    folders, seen = [], set()
    for label, base in bases:
        for folder in (base, *(base / sub for sub in kind.subfolders)):
            key = os.path.abspath(folder)
            if key not in seen:
                seen.add(key)
                folders.append((label, folder))
    return folders


def _not_found_message(kind: _Kind, looked: list[tuple[str, Path, list[str]]], reason: str) -> str:
    lines = [f"{kind.name}: no complete copy found and {reason}.", "Looked in:"]
    for label, folder, missing in looked:
        state = "no such folder" if not folder.is_dir() else f"missing {', '.join(missing)}"
        lines.append(f"  - {folder}  ({label}: {state})")
    lines += [
        f"Fix: put {kind.how_to_get} into one of",
        f"  {paths.cache_dir() / kind.cache_folder}   (the user cache), or",
        f"  $LABS_DATA/{kind.cache_folder}   (set LABS_DATA to a folder of datasets), or",
        "  any folder passed as load(..., root=FOLDER).",
        f"The folder must hold: {', '.join(kind.files)}.",
    ]
    return "\n".join(lines)


def _training_only(folder: Path) -> bool:
    return (folder / TRAINING_ONLY).is_file()


def _needed(kind: _Kind, folder: Path) -> list[str]:
    """The files ``folder`` must hold: all of them, or the training ones in a
    training-only copy."""
    if _training_only(folder):
        return [f for f in kind.files if f not in TEST_FILES]
    return list(kind.files)


def _dataset(kind: _Kind, folder: Path) -> Dataset:
    folder = folder.resolve()
    stamp = tuple((f, *_size_and_mtime(folder / f)) for f in _needed(kind, folder))
    parts = _parse_cached(kind.name, folder, stamp)
    return Dataset(name=kind.name, source=str(folder), **parts)


def _size_and_mtime(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _parse_cached(name: str, folder: Path, stamp: tuple) -> dict[str, Any]:
    """Parsed tensors of ``folder``; ``stamp`` (sizes, mtimes) keys out edited files."""
    kind = _kind(name)
    digest = hashlib.sha256(repr((_TENSOR_CACHE_VERSION, str(folder), stamp)).encode())
    cached = paths.cache_dir() / "tensors" / f"{name}-{digest.hexdigest()[:16]}.pt"
    if cached.is_file():
        try:
            parts = torch.load(cached, weights_only=True)
            parts["classes"], parts["mean"], parts["std"] = (
                tuple(parts["classes"]),
                tuple(parts["mean"]),
                tuple(parts["std"]),
            )
            return parts
        except Exception as e:  # a damaged cache file is rebuilt, never fatal
            warnings.warn(f"ignoring unreadable tensor cache {cached}: {e}", stacklevel=2)
    parts = kind.read(folder)
    _write_tensor_cache(cached, parts)
    return parts


def _write_tensor_cache(target: Path, parts: dict[str, Any]) -> None:
    """Save the parsed tensors, replacing older caches of the same dataset."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        os.close(fd)
        try:
            torch.save(parts, tmp)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        prefix = target.name.rsplit("-", 1)[0]
        for old in target.parent.glob(f"{prefix}-*.pt"):
            if old != target and old.name.rsplit("-", 1)[0] == prefix:
                old.unlink(missing_ok=True)
    except OSError as e:  # a read-only or full cache only costs speed
        warnings.warn(f"could not write tensor cache {target}: {e}", stacklevel=3)


# --------------------------------------------------------------------------- IDX (Fashion-MNIST)
def read_idx(path: str | os.PathLike, sha256: str | None = None) -> np.ndarray:
    """Read an IDX file of unsigned bytes (gzip-compressed or plain) into a ``uint8`` array.

    Checks the magic number and that the byte count matches the declared dimensions
    (a truncated file is caught even without a checksum), then ``sha256`` of the
    decompressed bytes when given.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # the gzip magic number
        raw = _gunzip(path, raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(
            f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'}, "
            "expected 0000 followed by type and rank)"
        )
    type_code, rank = raw[2], raw[3]
    if type_code != 0x08:
        raise DataError(
            f"{path}: IDX type code {type_code:#04x}; only unsigned bytes (0x08) are supported"
        )
    header = 4 + 4 * rank
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside its header ({len(raw)} bytes)")
    dims = struct.unpack(f">{rank}I", raw[4:header])
    expected = math.prod(dims)
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: the header declares shape {dims} = {expected} bytes of data but the "
            f"file holds {len(raw) - header}; it is truncated or damaged. Delete it and "
            "fetch it again."
        )
    if sha256 is not None:
        _check_digest(
            path, hashlib.sha256(raw).hexdigest(), sha256, "sha256 of the decompressed bytes"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _gunzip(path: Path, raw: bytes) -> bytes:
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(
            f"{path}: cannot decompress it ({e}); the file is truncated or not a "
            "gzip file. Delete it and fetch it again."
        ) from e


def _check_digest(path: Path, actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise DataError(
            f"{path}: checksum mismatch: {what} is {actual}, expected {expected}. "
            "The file is corrupted or not the official one; delete it and fetch "
            "it again."
        )


def _read_fashion_mnist(folder: Path) -> dict[str, Any]:
    only_train = _training_only(folder)
    arrays = {
        f: read_idx(folder / f, digest)
        for f, digest in FASHION_MNIST_SHA256.items()
        if not (only_train and f in TEST_FILES)
    }
    parts: dict[str, Any] = {
        "x_test": torch.empty(0, 1, 28, 28, dtype=torch.uint8),
        "y_test": torch.empty(0, dtype=torch.int64),
    }
    for split, prefix in (("train", "train"), ("test", "t10k")):
        if f"{prefix}-images-idx3-ubyte.gz" not in arrays:
            continue
        images = arrays[f"{prefix}-images-idx3-ubyte.gz"]
        labels = arrays[f"{prefix}-labels-idx1-ubyte.gz"]
        if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
            raise DataError(
                f"{folder}: {prefix} images {images.shape} and labels "
                f"{labels.shape} do not fit together"
            )
        parts[f"x_{split}"] = torch.from_numpy(images.reshape(-1, 1, 28, 28).copy())
        parts[f"y_{split}"] = torch.from_numpy(labels.astype(np.int64))
    return dict(
        parts, classes=FASHION_MNIST_CLASSES, mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD
    )


# --------------------------------------------------------------------------- CIFAR-10 pickles
class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles containers, numbers, strings and numpy arrays, and nothing else: a
    pickle can run arbitrary code, and these files come from the internet."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }  # how Python 3 writes bytes at pickle protocol 2

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_cifar_batch(path: str | os.PathLike, md5: str | None = None) -> dict[str, Any]:
    """Read one ``cifar-10-batches-py`` pickle into a dict with ``str`` keys.

    Only numpy arrays and plain containers are unpickled; ``md5`` of the file is
    checked when given.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        entry = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # truncated or foreign pickles fail in many ways
        raise DataError(
            f"{path}: cannot read it as a CIFAR-10 pickle ({type(e).__name__}: {e}); "
            "it is truncated or not a CIFAR-10 batch. Delete it and fetch it "
            "again."
        ) from e
    if not isinstance(entry, dict):
        raise DataError(f"{path}: expected a pickled dict, found {type(entry).__name__}")
    if md5 is not None:
        _check_digest(path, hashlib.md5(raw, usedforsecurity=False).hexdigest(), md5, "md5")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def _cifar_images(path: Path, md5: str | None) -> tuple[np.ndarray, np.ndarray]:
    entry = read_cifar_batch(path, md5)
    data, labels = entry.get("data"), entry.get("labels")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
    ):
        found = getattr(data, "shape", type(data).__name__)
        raise DataError(f"{path}: 'data' must be a uint8 array (N, 3072), found {found}")
    labels = np.asarray(labels if labels is not None else [], dtype=np.int64)
    if labels.shape != (len(data),) or labels.min(initial=0) < 0 or labels.max(initial=0) > 9:
        raise DataError(
            f"{path}: 'labels' must hold {len(data)} integers in 0..9, found shape {labels.shape}"
        )
    return data.reshape(-1, 3, 32, 32), labels


def _read_cifar_folder(folder: Path, checksums: Mapping[str, str]) -> dict[str, Any]:
    train = [_cifar_images(folder / f, checksums[f]) for f in CIFAR10_TRAIN_BATCHES]
    if _training_only(folder):
        x_test, y_test = np.empty((0, 3, 32, 32), np.uint8), np.empty(0, np.int64)
    else:
        x_test, y_test = _cifar_images(folder / "test_batch", checksums["test_batch"])
    meta = read_cifar_batch(folder / "batches.meta", checksums["batches.meta"])
    names = meta.get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        raise DataError(f"{folder / 'batches.meta'}: 'label_names' must list 10 class names")
    return {
        "x_train": torch.from_numpy(np.concatenate([x for x, _ in train])),
        "y_train": torch.from_numpy(np.concatenate([y for _, y in train])),
        "x_test": torch.from_numpy(x_test.copy()),  # unpickled arrays may be read-only
        "y_test": torch.from_numpy(y_test),
        "classes": tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names),
    }


def _read_cifar10(folder: Path) -> dict[str, Any]:
    return dict(_read_cifar_folder(folder, CIFAR10_MD5), mean=CIFAR10_MEAN, std=CIFAR10_STD)


def _read_synthetic_cifar10(folder: Path) -> dict[str, Any]:
    parts = _read_cifar_folder(folder, _read_manifest(folder / SYNTHETIC_MANIFEST))
    mean, std = channel_stats(parts["x_train"])
    return dict(parts, mean=mean, std=std)


def _read_manifest(path: Path) -> dict[str, str]:
    """``md5sum``-style lines ``<md5>  <file>``; must cover every CIFAR file."""
    checksums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, _, name = line.strip().partition("  ")
            checksums[name] = digest
    only_train = _training_only(path.parent)
    missing = [
        f for f in CIFAR10_MD5 if f not in checksums and not (only_train and f in TEST_FILES)
    ]
    if missing:
        raise DataError(f"{path}: no checksum for {', '.join(missing)}")
    return checksums


# --------------------------------------------------------------------------- synthetic stand-in
def write_synthetic_cifar10(
    folder: str | os.PathLike, n_train: int = 5000, n_test: int = 1000, seed: int = 0
) -> Path:
    """Write ``synthetic-cifar10``, a learnable stand-in for CIFAR-10, into ``folder``.

    The files have the real ``cifar-10-batches-py`` layout and pickle keys (five
    ``data_batch_*``, ``test_batch``, ``batches.meta``) plus ``checksums.md5``, so the
    real parser and verifier read them. Each class is a pair of coloured gratings
    (orientation, frequency and colour fixed per class) drawn at a random phase — a
    random shift — on a random background, under pixel noise. Position carries no
    information, so a linear model stays near chance (about 20 %), while a small CNN
    (``resnet_cifar`` of width 4) passes 90 % after one epoch on 2,000 images.
    Deterministic for a given ``seed``; the default size takes well under 2 s.
    """
    if n_train < len(CIFAR10_TRAIN_BATCHES) or n_test < 1:
        raise ValueError(
            f"need n_train >= 5 (five batches) and n_test >= 1, got {n_train}, {n_test}"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = np.concatenate([rng.permutation(np.arange(n) % 10) for n in (n_train, n_test)])
    images = _grating_images(labels, rng)
    batches = np.array_split(np.arange(n_train), len(CIFAR10_TRAIN_BATCHES))
    contents = {
        name: _batch_dict(images[idx], labels[idx], f"training batch {i} of 5", idx)
        for i, (name, idx) in enumerate(zip(CIFAR10_TRAIN_BATCHES, batches, strict=True), 1)
    }
    test = np.arange(n_train, n_train + n_test)
    contents["test_batch"] = _batch_dict(images[test], labels[test], "testing batch 1 of 1", test)
    contents["batches.meta"] = {
        b"num_cases_per_batch": len(batches[0]),
        b"num_vis": 3072,
        b"label_names": [c.encode() for c in SYNTHETIC_CLASSES],
    }
    lines = []
    for name, content in contents.items():
        raw = pickle.dumps(content, protocol=4)
        (folder / name).write_bytes(raw)
        lines.append(f"{hashlib.md5(raw, usedforsecurity=False).hexdigest()}  {name}")
    # Written last: a folder without its manifest counts as incomplete.
    (folder / SYNTHETIC_MANIFEST).write_text("\n".join(lines) + "\n")
    return folder


def _batch_dict(
    images: np.ndarray, labels: np.ndarray, batch_label: str, ids: np.ndarray
) -> dict[bytes, Any]:
    return {
        b"batch_label": batch_label.encode(),
        b"labels": labels.tolist(),
        b"data": images.reshape(len(images), -1),
        b"filenames": [f"synthetic_{i:06d}.png".encode() for i in ids],
    }


def _grating_images(
    labels: np.ndarray, rng: np.random.Generator, noise: float = 0.15
) -> np.ndarray:
    """uint8 images (N, 3, 32, 32) of the given classes; see write_synthetic_cifar10."""
    n, components = len(labels), 2
    angle = rng.uniform(0, np.pi, (10, components))
    freq = rng.uniform(0.08, 0.25, (10, components))  # cycles per pixel
    colour = rng.uniform(-1, 1, (10, components, 3)).astype(np.float32)
    colour /= np.linalg.norm(colour, axis=2, keepdims=True)
    # Uniform noise of standard deviation ``noise`` (cheaper than Gaussian) on a random
    # background colour, built in place to keep the default size well under a second.
    half_width = noise * np.sqrt(3)
    x = rng.random((n, 3, 32, 32), dtype=np.float32)
    x *= np.float32(2 * half_width)
    x += (rng.uniform(0.3, 0.7, (n, 3, 1, 1)) - half_width).astype(np.float32)
    pos = np.arange(32, dtype=np.float32)
    for k in range(components):
        ky = (2 * np.pi * freq[labels, k] * np.sin(angle[labels, k])).astype(np.float32)
        kx = (2 * np.pi * freq[labels, k] * np.cos(angle[labels, k])).astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)  # a random shift
        wave = np.cos(
            ky[:, None, None] * pos[None, :, None]
            + kx[:, None, None] * pos[None, None, :]
            + phase[:, None, None]
        )
        weight = rng.uniform(0.1, 0.25, (n, 1)).astype(np.float32) * colour[labels, k]
        for c in range(3):
            x[:, c] += weight[:, c, None, None] * wave
    x *= 255
    x += 0.5
    np.clip(x, 0, 255, out=x)
    return x.astype(np.uint8)


def _generate_into(target: Path) -> Path:
    """Generate the default stand-in into ``target`` atomically (another process may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        write_synthetic_cifar10(tmp)
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _move_into_place(tmp: Path, target: Path) -> None:
    try:
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():  # not the "someone else got there first" case
            raise


def make_cifar10_archive(folder: str | os.PathLike, archive: str | os.PathLike) -> str:
    """Pack the files of ``folder`` as ``cifar-10-batches-py/<file>`` into a ``.tar.gz``
    (the official archive's layout) and return the archive's md5."""
    folder, archive = Path(folder), Path(archive)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            tar.add(path, arcname=f"{CIFAR10_FOLDER}/{path.name}")
    return hashlib.md5(archive.read_bytes(), usedforsecurity=False).hexdigest()


# --------------------------------------------------------------------------- downloads
def download_fashion_mnist(
    dest: str | os.PathLike | None = None, base_url: str = FASHION_MNIST_URL
) -> Path:
    """Download the four Fashion-MNIST files into ``dest`` (default: the cache).

    Each file goes to a temporary name, is verified (structure and sha256 of the
    decompressed bytes), then renamed into place; files already there are kept.
    """
    dest = Path(dest) if dest is not None else paths.cache_dir() / "fashion-mnist"
    for name, sha256 in FASHION_MNIST_SHA256.items():
        if not (dest / name).is_file():
            _download(
                base_url + name, dest / name, verify=lambda p, digest=sha256: read_idx(p, digest)
            )  # type: ignore[misc]
    return dest


def download_cifar10(
    dest: str | os.PathLike | None = None, url: str = CIFAR10_URL, md5: str = CIFAR10_ARCHIVE_MD5
) -> Path:
    """Download and unpack the CIFAR-10 archive; returns ``dest/cifar-10-batches-py``.

    The archive is verified against ``md5`` before anything is unpacked; a mismatch
    raises :class:`DataError` and leaves no file behind. Only plain files directly
    under ``cifar-10-batches-py/`` are taken from the archive.
    """
    dest = Path(dest) if dest is not None else paths.cache_dir() / "cifar10"
    archive = dest / url.rsplit("/", 1)[-1]
    _download(url, archive, md5=md5)
    tmp = Path(tempfile.mkdtemp(dir=dest, prefix=f".{CIFAR10_FOLDER}."))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                folder, _, name = member.name.partition("/")
                if member.isfile() and folder == CIFAR10_FOLDER and name and "/" not in name:
                    with tar.extractfile(member) as src, open(tmp / name, "wb") as out:  # type: ignore[union-attr]
                        shutil.copyfileobj(src, out)
        _move_into_place(tmp, dest / CIFAR10_FOLDER)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DataError(f"{archive}: cannot unpack it ({e})") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        archive.unlink(missing_ok=True)
    return dest / CIFAR10_FOLDER


def _download(
    url: str,
    target: Path,
    *,
    md5: str | None = None,
    verify: Callable[[Path], object] | None = None,
) -> None:
    """Fetch ``url`` to a temporary file beside ``target``, verify, then rename."""
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    digest = hashlib.md5(usedforsecurity=False)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=target.name, leave=False) as bar:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if md5 is not None and digest.hexdigest() != md5:
            raise DataError(
                f"download of {url}: md5 is {digest.hexdigest()}, expected {md5}. "
                "The transfer was corrupted or the file changed upstream; nothing "
                "was kept."
            )
        if verify is not None:
            verify(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- regression
def synthetic_regression(
    n: int = 1000,
    d: int = 1,
    noise: float = 0.1,
    seed: int = 0,
    bias: bool = True,
    condition_number: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Linear-regression data with a known truth: ``y = X @ w_true + b_true + noise·ε``.

    Returns ``(X, y, w_true, b_true)`` as float64: ``X`` ``(n, d)``, ``y`` ``(n,)``,
    ``w_true`` ``(d,)``, ``b_true`` a float (``0.0`` when ``bias=False``); ``ε`` is
    standard normal. By default the features are standard normal. With
    ``condition_number=κ`` (needs ``d >= 2``) the features are centred and
    ``XᵀX / n`` — the Hessian of the mean squared error, up to a factor 2 — has
    eigenvalues spread evenly on a log scale from 1 down to ``1/κ``, so gradient
    descent meets a valley ``κ`` times steeper across than along.
    """
    if n < 1 or d < 1:
        raise ValueError(f"need n >= 1 and d >= 1, got n={n}, d={d}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    rng = np.random.default_rng(seed)
    if condition_number is None:
        X = rng.standard_normal((n, d))
    else:
        if condition_number < 1:
            raise ValueError(f"condition_number must be >= 1, got {condition_number}")
        if d < 2 or n <= d:
            raise ValueError(
                f"condition_number needs d >= 2 features and n > d samples, got n={n}, d={d}"
            )
        z = rng.standard_normal((n, d))
        q, _ = np.linalg.qr(z - z.mean(axis=0))  # orthonormal, zero-mean columns
        eigenvalues = np.geomspace(1.0, 1.0 / condition_number, d)
        rotation, _ = np.linalg.qr(rng.standard_normal((d, d)))
        X = np.sqrt(n) * q @ np.diag(np.sqrt(eigenvalues)) @ rotation.T
    w_true = rng.standard_normal(d)
    b_true = float(rng.standard_normal()) if bias else 0.0
    y = X @ w_true + b_true + noise * rng.standard_normal(n)
    return X, y, w_true, b_true
