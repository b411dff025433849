"""Judge a checkpoint in a fresh interpreter that imports only verified code.

After the job, and after :mod:`assessment.integrity` found the course code, the
target and the test data unchanged, the grader runs :func:`run` : a new
``python -I`` (no ``PYTHONPATH``, no user site, no current folder on the path) that
imports ``lab_utils`` and ``assessment`` from the verified checkout alone, reads
``checkpoint.pt`` with ``torch.load(weights_only=True)``, rebuilds the model from
the registry and evaluates it on the grader's copy of the test split. It answers
with one JSON line; nothing the job left in memory or in imported modules can
reach it.

Its memory is bounded twice. The checkpoint is refused before it is read when its
zip directory says it would unpack past the target's cap
(:func:`assessment.checkpoint.read`), and everything whose size the file decides
(reading it, rebuilding the model, the one-image check) runs under
:func:`memory_bound`: a few copies of the cap and torch's own overhead, beyond which
an allocation fails and the checkpoint is refused. The evaluation after it runs the
grader's own batches through a model whose size the cap has bounded. The result
says by how much the process's peak memory grew (``memory_mb``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EVAL_BATCH = 1000
RESULT_PREFIX = "lab-grade-evaluation: "
# Reading a checkpoint holds a few copies of its tensors at once (the storages read,
# the model built for real, the finiteness check's temporaries), on top of what
# torch itself allocates and a stack for each of its threads.
READ_COPIES = 3
READ_OVERHEAD_MB = 256
THREAD_MB = 16


@dataclass(frozen=True)
class TestSplit:
    """The held-out images the grader evaluates on, loaded before the job starts."""

    x: torch.Tensor
    y: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def save(self, path: Path) -> None:
        torch.save({"x": self.x, "y": self.y, "mean": list(self.mean), "std": list(self.std)}, path)

    @classmethod
    def read(cls, path: Path) -> TestSplit:
        d = torch.load(path, weights_only=True)
        return cls(d["x"], d["y"], tuple(d["mean"]), tuple(d["std"]))


def check_fits(model: torch.nn.Module, split: TestSplit) -> None:
    """Refuse a model that cannot take the split's images or name all its classes
    (e.g. built for CIFAR-10 and submitted for Fashion-MNIST): the submission's fault."""
    from . import checkpoint as ckpt_mod

    classes = int(split.y.max()) + 1
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(1, *split.x.shape[1:]))
    except Exception as e:  # a shape mismatch inside the network
        raise ckpt_mod.CheckpointRejected(
            "wrong_arch",
            f"the model cannot take images of shape {tuple(split.x.shape[1:])}: "
            f"{type(e).__name__}: {e}",
        ) from None
    if out.dim() != 2 or out.shape[1] < classes:
        raise ckpt_mod.CheckpointRejected(
            "wrong_arch",
            f"the model returns shape {tuple(out.shape)} for one image; the "
            f"dataset needs (1, {classes}) logits",
        )


def measure_accuracy(model: torch.nn.Module, split: TestSplit) -> tuple[float, int]:
    """Accuracy of ``model`` on ``split``, computed by the course's tested evaluation."""
    from lab_utils import profile as lprofile
    from lab_utils.loader import TensorLoader
    from lab_utils.train import evaluate

    device = lprofile.device()
    loader = TensorLoader(
        split.x,
        split.y,
        EVAL_BATCH,
        shuffle=False,
        even_shards=False,
        mean=split.mean,
        std=split.std,
        device=device,
    )
    result = evaluate(model.to(device), loader, device=device)
    return float(result["acc"]), int(result["n"])


def _status_bytes(name: str) -> int | None:
    """A memory figure of this process from ``/proc/self/status`` (``VmData``: the
    private writable memory RLIMIT_DATA counts; ``VmHWM``: the peak resident memory
    since the process started this program), or ``None`` where there is none (not
    Linux)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def memory_bound(extra_bytes: int) -> Iterator[int | None]:
    """Within the block this process may take at most ``extra_bytes`` more private
    memory than it has now; an allocation past that fails (MemoryError, or torch's
    RuntimeError). A soft RLIMIT_DATA, which counts the heap and private writable
    mappings (setrlimit(2): mmap(2) obeys it since Linux 4.7), restored after.
    Yields the limit in bytes, ``None`` where there is none to set (not Linux)."""
    used = _status_bytes("VmData")
    if used is None:
        yield None
        return
    before = resource.getrlimit(resource.RLIMIT_DATA)
    limit = used + extra_bytes
    for cap in before:  # never above the limit already set
        if cap != resource.RLIM_INFINITY:
            limit = min(limit, cap)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, before[1]))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def _peak_mb() -> float:
    """This process's peak resident memory so far, in MB. Linux: ``VmHWM``, not
    getrusage's ru_maxrss: "resource usage metrics are preserved across an execve(2)"
    (getrusage(2)), so this fresh interpreter's ru_maxrss starts at the grader's own
    peak. Elsewhere ru_maxrss (bytes on macOS)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def read_allowance(max_mb: float) -> int:
    """Bytes that reading, rebuilding and checking a checkpoint of at most ``max_mb``
    may take (see :data:`READ_COPIES`)."""
    mb = READ_COPIES * max_mb + READ_OVERHEAD_MB + THREAD_MB * torch.get_num_threads()
    return int(mb * 2**20)


def judge(workdir: Path, split: TestSplit, archs: list[str], max_mb: float) -> dict[str, Any]:
    """Read, check and evaluate the checkpoint in ``workdir``: a verdict's raw facts."""
    from . import checkpoint as ckpt_mod

    try:
        path = ckpt_mod.locate(workdir)
        with memory_bound(read_allowance(max_mb)):
            ckpt = ckpt_mod.read(path, max_mb)
            model, notes = ckpt_mod.rebuild(ckpt, archs)
            check_fits(model, split)
    except ckpt_mod.CheckpointRejected as e:
        return {"reason": e.reason, "message": str(e)}
    acc, n = measure_accuracy(model, split)
    return {
        "reason": None,
        "notes": notes,
        "checkpoint": ckpt_mod.describe(ckpt, model, path),
        "accuracy": round(acc, 5),
        "test_samples": n,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="assessment.evaluate")
    p.add_argument("--workdir", required=True)
    p.add_argument("--split", required=True)
    p.add_argument("--archs", required=True, help="JSON list of allowed architectures")
    p.add_argument("--max-mb", type=float, required=True)
    p.add_argument("--repo", required=True, help="the verified checkout")
    args = p.parse_args(argv)
    import assessment
    import lab_utils

    for mod in (assessment, lab_utils):  # imported from the verified checkout, or nothing
        if not Path(mod.__file__).resolve().is_relative_to(Path(args.repo).resolve()):
            raise RuntimeError(
                f"{mod.__name__} was imported from {mod.__file__}, not from {args.repo}"
            )
    split = TestSplit.read(Path(args.split))
    before = _peak_mb()
    result = judge(Path(args.workdir), split, json.loads(args.archs), args.max_mb)
    result["memory_mb"] = round(_peak_mb() - before, 1)  # how much judging raised the peak
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


class EvaluationError(RuntimeError):
    """The fresh evaluation process failed (a fault of the grader)."""


def run(
    workdir: Path,
    split_file: Path,
    archs: list[str],
    max_mb: float,
    repo: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run :func:`main` in ``python -I`` importing only ``repo``; its result."""
    boot = (
        "import sys; sys.path.insert(0, sys.argv[1]); del sys.argv[1]; "
        "from assessment.evaluate import main; sys.exit(main())"
    )
    cmd = [
        sys.executable,
        "-I",
        "-c",
        boot,
        str(repo),
        "--workdir",
        str(workdir),
        "--split",
        str(split_file),
        "--archs",
        json.dumps(list(archs)),
        "--max-mb",
        str(max_mb),
        "--repo",
        str(repo),
    ]
    clean = {k: v for k, v in (env or os.environ).items() if not k.startswith("PYTHON")}
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=clean,
        cwd=str(repo),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    raise EvaluationError(f"the evaluation process exited with {done.returncode}: {tail}")


if __name__ == "__main__":
    sys.exit(main())
