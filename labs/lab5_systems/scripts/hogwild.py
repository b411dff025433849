"""Hogwild!: several processes train one model in shared memory, with or without a lock.

The official PyTorch pattern: ``model.share_memory()``, then ``torch.multiprocessing``
workers that each run an ordinary optimizer on the *same* parameter storage. With
``--lock`` every optimizer step holds one ``mp.Lock`` (writes never interleave);
without it, updates land whenever they are ready (Hogwild!).

Two models show why lock-free is safe when updates are sparse:

- ``dense``: an MLP on the pixels; every update writes every weight;
- ``sparse``: a linear model on hashed 7x7-patch features (``nn.EmbeddingBag`` with
  ``sparse=True``): an update writes only the rows of the features its batch has.

Each worker logs every write (its time interval and the rows it touched); two writes
*conflict* when they come from different workers, overlap in time and touch a common
row. JSON records (``hogwild``, via ``lab_utils.metrics``) carry updates per second, test accuracy
and the conflict counts.

    python scripts/hogwild.py --model sparse --workers 2    # lock-free
    python scripts/hogwild.py --model dense --workers 2 --lock
    python scripts/hogwild.py --grid                        # both models, lock and no lock

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    hogwild: model, lock, workers, updates, seconds, updates_per_s, acc, overlapped,
        collided, collided_when_overlapping, coords_per_update, coords_total (one per
        run)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lab_utils import metrics, models, profile, tensordata

BUCKETS = 2**18  # rows of the hashed feature table (row 0 = "no feature")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = profile.script_parser(__doc__)
    p.add_argument("--model", choices=("dense", "sparse"), default="sparse")
    p.add_argument("--lock", action="store_true", help="hold one lock around every update")
    p.add_argument(
        "--grid",
        action="store_true",
        help="run both models with and without the lock, one after the other",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="updates per worker")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds before workers are stopped")
    args = p.parse_args(argv)
    if args.workers < 1 or args.steps < 1:
        p.error("--workers and --steps must be >= 1")
    return args


# ----------------------------------------------------------------- the sparse model
def hashed_patches(x: torch.Tensor) -> torch.Tensor:
    """Feature ids ``(N, 16)``: each 7x7 patch, its pixels thresholded to a 49-bit code,
    hashed with its position into ``BUCKETS`` rows. Empty and full patches, which
    half the images share, get id 0 (no feature): what is left is rare, hence sparse."""
    bits = (x[:, 0] > 0).long().unfold(1, 7, 7).unfold(2, 7, 7).reshape(len(x), 16, 49)
    code = (bits << torch.arange(49)).sum(-1)
    key = torch.arange(16) * 2**49 + code
    ids = (key * 2654435761) % 4294967291 % (BUCKETS - 1) + 1  # int64 wraps: still a hash
    plain = (code == 0) | (code == 2**49 - 1)
    return torch.where(plain, torch.zeros_like(ids), ids)


class HashedLinear(nn.Module):
    """Logits = sum of the rows of the features present (a sparse linear model; no bias,
    so an update writes nothing but the rows of its batch's features)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(BUCKETS, classes, mode="sum", sparse=True, padding_idx=0)
        nn.init.zeros_(self.table.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


def build(kind: str) -> nn.Module:
    return HashedLinear() if kind == "sparse" else models.build("mlp", hidden=(64,))


# ----------------------------------------------------------------- one worker
def train(
    rank: int,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    lock,
    log,
    ready,
) -> None:
    """One Hogwild worker: its own optimizer over the shared parameters."""
    torch.set_num_threads(1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    writes = []  # (start, end, rows touched or None for "all")
    ready.wait()  # start together: a head start would hide the concurrency
    for step in range(args.steps):
        idx = tensordata.batch_indices(
            len(x), args.batch_size, seed=args.seed, worker=rank, step=step
        )
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        # (as numpy: tensors sent through an mp.Queue go by shared memory, which needs the
        # sender alive until they are read)
        rows = x[idx].unique().numpy() if args.model == "sparse" else None
        if lock is not None:
            lock.acquire()
        t0 = time.perf_counter()
        opt.step()  # in place, on the shared storage
        t1 = time.perf_counter()
        if lock is not None:
            lock.release()
        writes.append((t0, t1, rows))
    log.put((rank, writes))


def conflicts(logs: dict[int, list], dense_size: int) -> tuple[int, int, float, float]:
    """How often lock-free writes collided.

    Returns (writes, writes that overlapped another worker's write in time, the share
    of all written weights that another worker wrote at the same moment, that share
    among the overlapping writes only). A dense update writes all ``dense_size``
    weights; a sparse one only its rows (10 weights each).
    """
    items = [(t0, t1, rank, rows) for rank, ws in logs.items() for t0, t1, rows in ws]
    items.sort(key=lambda w: w[0])
    overlapped: set[int] = set()
    collided = [0] * len(items)
    for i, (_a0, a1, ra, rows_a) in enumerate(items):
        for j in range(i + 1, len(items)):
            b0, _b1, rb, rows_b = items[j]
            if b0 >= a1:
                break
            if ra == rb:
                continue
            overlapped.update((i, j))
            common = (
                dense_size
                if rows_a is None or rows_b is None
                else int(np.isin(rows_a, rows_b, assume_unique=True).sum())
            )
            collided[i] += common
            collided[j] += common
    size = [dense_size if rows is None else len(rows) for *_, rows in items]
    collided = [min(c, n) for c, n in zip(collided, size, strict=True)]  # once per weight
    in_overlaps = sum(size[i] for i in overlapped)
    return (
        len(items),
        len(overlapped),
        sum(collided) / sum(size),
        sum(collided) / in_overlaps if in_overlaps else 0.0,
    )


def collect(procs: list, log, args: argparse.Namespace, start: float) -> dict[int, list]:
    """Every worker's log of writes; stop the job on a dead worker or at --timeout, and
    leave no worker behind."""
    logs: dict[int, list] = {}
    try:
        while len(logs) < args.workers:
            left = args.timeout - (time.perf_counter() - start)
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"hogwild: worker exited with code {dead[0].exitcode}")
            if left <= 0:
                raise SystemExit(f"hogwild: workers did not finish within {args.timeout:g} s")
            try:
                rank, writes = log.get(timeout=min(1.0, left))
            except Exception:  # queue.Empty: look at the workers again
                continue
            logs[rank] = writes
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return logs


def run_workers(model: nn.Module, x_train, y_train, args, lock: bool, method: str) -> dict:
    """Start --workers processes on the shared model, all released together; their logs."""
    ctx = mp.get_context(method)
    the_lock = ctx.Lock() if lock else None
    log = ctx.Queue()
    ready = ctx.Barrier(args.workers)
    procs = [
        ctx.Process(target=train, args=(r, model, x_train, y_train, args, the_lock, log, ready))
        for r in range(args.workers)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    return collect(procs, log, args, start)


def report(kind: str, lock: bool, args, model: nn.Module, logs: dict, acc: float) -> dict:
    """Emit and print one run: updates per second, accuracy and the conflict counts."""
    first = min(w[0][0] for w in logs.values())
    last = max(w[-1][1] for w in logs.values())
    size = sum(p.numel() for p in model.parameters())
    updates, overlapped, collided, when_overlapping = conflicts(logs, size)
    touched = (
        sum(len(r) for ws in logs.values() for _, _, r in ws) / updates * 10  # 10 per row
        if kind == "sparse"
        else size
    )
    rec = {
        "event": "hogwild",
        "model": kind,
        "lock": lock,
        "workers": args.workers,
        "updates": updates,
        "seconds": last - first,
        "updates_per_s": updates / (last - first),
        "acc": acc,
        "overlapped": overlapped,
        "collided": collided,
        "collided_when_overlapping": when_overlapping,
        "coords_per_update": touched,
        "coords_total": size,
    }
    metrics.emit(rec)
    print(
        f"{kind:>6} model, {'lock   ' if lock else 'no lock'}, {args.workers} workers: "
        f"{rec['updates_per_s']:6.0f} updates/s, test accuracy {acc:.3f}; {overlapped}/{updates} "
        f"writes overlapped another worker's; of the weights these wrote, "
        f"{when_overlapping:.1%} collided ({collided:.2%} of all written); "
        f"{touched:,.0f} of {size:,} weights per update",
        flush=True,
    )
    return rec


def run_one(
    kind: str, lock: bool, args: argparse.Namespace, data: tensordata.Tensors, method: str
) -> dict:
    """One model trained by --workers processes on shared parameters, with or without
    the lock."""
    torch.manual_seed(args.seed)
    model = build(kind)
    model.share_memory()  # parameters in shared memory; gradients stay per process
    x_train, x_test = data.x_train, data.x_test
    if kind == "sparse":
        x_train, x_test = hashed_patches(x_train), hashed_patches(x_test)
    x_train.share_memory_()
    data.y_train.share_memory_()
    logs = run_workers(model, x_train, data.y_train, args, lock, method)
    acc = tensordata.accuracy(model, x_test, data.y_test)
    return report(kind, lock, args, model, logs, acc)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile.configure_threads(1)
    # Hogwild! is a shared-memory CPU technique: the model lives in host memory on every
    # machine. fork starts the workers quickly and shares the tensors with them.
    method = "fork"
    data = tensordata.load(args.n_train, args.n_test, seed=args.seed)
    grid = (
        [(m, lk) for m in ("dense", "sparse") for lk in (True, False)]
        if args.grid
        else [(args.model, args.lock)]
    )
    for kind, lock in grid:
        run_one(kind, lock, args, data, method)


if __name__ == "__main__":
    main()
