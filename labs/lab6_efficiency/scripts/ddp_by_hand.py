"""Data parallelism built by hand: broadcast, bucketed asynchronous all-reduces during backward.

1. Equivalence: the character transformer trained --steps SGD steps by HandDDP (hooks
   launch one asynchronous all-reduce per bucket as soon as its last gradient is
   ready; the optimizer waits for them) and by DistributedDataParallel from the same
   start on the same batches; rank 0 reports how far gradients and weights differ.
2. Timing, shown: naive (all-reduce after backward) and overlapped HandDDP and DDP,
   timed interleaved (A B C C B A ...) in the same run.
3. An α–β model of the all-reduce (t = α + β·bytes) fitted from timed all-reduces; it
   replays the overlapped backward for each --bucket-kb and predicts the best bucket,
   shown beside the bucket size that measured fastest.

    torchrun --standalone --nproc-per-node 2 ddp_by_hand.py
    mpirun -np 2 python ddp_by_hand.py --bucket-kb 16 64 256 1024
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import metrics, parallel, profile

# Notebook 5's exercise: the buckets DDP fills, last parameter first (its reference solution)
from lab_utils.solutions.lab6 import make_buckets

BUGS = ("none", "no_average", "early_bucket")


class HandDDP:
    """DistributedDataParallel by hand.

    [1] rank 0's weights are broadcast, so every rank starts equal;
    [2] each parameter gets a post-accumulate-grad hook; when the last gradient of a
        bucket has arrived, the bucket is flattened and all-reduced asynchronously
        while backward goes on computing the earlier layers' gradients (overlap);
    [3] ``finish()`` waits for every bucket, divides by the number of ranks (the
        average) and copies the result back into the ``.grad`` tensors.
    ``overlap=False`` is the naive version: nothing is sent until backward has ended.
    ``bug`` makes one deliberate mistake (to show that the equivalence check catches it)."""

    def __init__(
        self, model: torch.nn.Module, bucket_bytes: int, *, overlap: bool = True, bug: str = "none"
    ) -> None:
        self.model, self.overlap, self.bug = model, overlap, bug
        self.world_size = dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # [1] everybody starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in b] for b in make_buckets(sizes, bucket_bytes)]
        self.bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        for p in self.params:  # [2]
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.Tensor) -> None:
        k = self.bucket_of[id(p)]
        self.ready[k] += 1
        launch = self.ready[k] == (1 if self.bug == "early_bucket" else len(self.buckets[k]))
        if self.overlap and launch:  # [2] the bucket is complete: send it now, keep computing
            self._launch(k)

    def _launch(self, k: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, k))

    def finish(self) -> None:
        """[3] Wait for every bucket, average, write the gradients back."""
        if not self.overlap:  # naive: everything is sent after backward
            for k in range(len(self.buckets)):
                self._launch(k)
        for work, flat, k in self.pending:
            work.wait()
            if self.bug != "no_average":
                flat /= self.world_size
            offset = 0
            for p in self.buckets[k]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)


def parse_args(argv=None) -> argparse.Namespace:
    P = profile.current()
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--bucket-kb",
        nargs="+",
        type=float,
        default=P.pick(
            quick=[16, 128, 1024], cpu=[32, 256, 1024, 4096], gpu=[256, 1024, 4096, 25600]
        ),
        help="bucket sizes (KiB) timed; the first is used for the equivalence check",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=P.pick(quick=3, cpu=8, gpu=10),
        help="timed rounds; each round times every variant once, in alternating order",
    )
    p.add_argument(
        "--bugs",
        nargs="+",
        choices=BUGS,
        default=["none"],
        help="the equivalence check of each: HandDDP as written (none) or wrong on "
        "purpose (forget the average; send a bucket when its first gradient is ready)",
    )
    p.add_argument("--no-timing", action="store_true", help="only the equivalence check")
    return p.parse_args(argv)


def my_batch(args: argparse.Namespace, data, step: int, device: torch.device):
    """This rank's share of the global batch of ``step``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data.batch(args.batch_size, args.seq_len, step, args.seed)
    mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    return x[mine].to(device), y[mine].to(device)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def equivalence(args: argparse.Namespace, bug: str, data, device: torch.device) -> dict:
    """Train HandDDP and DDP side by side; the largest relative difference of the
    averaged gradients over the steps, and of the weights at the end."""
    torch.manual_seed(args.seed + 1 + dist.get_rank())  # different starts: [1] must fix them
    mine = parallel.build_model(args).to(device)
    for q in mine.parameters():  # a model that differs on every rank before [1]
        q.data.add_(torch.randn_like(q), alpha=0.01 * dist.get_rank())
    hand = HandDDP(mine, int(args.bucket_kb[0] * 1024), bug=bug)
    ref = DDP(
        parallel.build_model(args).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (mine, ref)]
    grad_err = 0.0
    for step in range(args.steps):
        x, y = my_batch(args, data, step, device)
        for m, opt in zip((mine, ref), opts):
            opt.zero_grad()
            parallel.lm_loss(m(x), y).backward()
        hand.finish()  # [3] before the optimizer step
        grad_err = max(grad_err, parallel.relative_error(grads_of(mine), grads_of(ref.module)))
        for opt in opts:
            opt.step()
    weight_err = parallel.relative_error(
        dict(mine.named_parameters()), dict(ref.module.named_parameters())
    )
    return {
        "event": "equivalence",
        "bug": bug,
        "steps": args.steps,
        "buckets": len(hand.buckets),
        "bucket_kb": args.bucket_kb[0],
        "grad_rel_err": grad_err,
        "weight_rel_err": weight_err,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    """One way of training, timed step by step."""

    def __init__(
        self, name: str, args: argparse.Namespace, device: torch.device, bucket_kb: float, kind: str
    ) -> None:
        model = parallel.build_model(args).to(device)
        self.name, self.kind, self.hand = name, kind, None
        if kind == "ddp":
            model = DDP(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=bucket_kb / 1024,
            )
        elif kind in ("naive", "overlap"):
            self.hand = HandDDP(model, int(bucket_kb * 1024), overlap=kind == "overlap")
        self.model, self.device = model, device
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.seconds: list[float] = []
        self.backward_seconds: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        sync(self.device)
        start = time.perf_counter()
        self.opt.zero_grad()
        loss = parallel.lm_loss(self.model(x), y)
        t_bwd = time.perf_counter()
        loss.backward()
        sync(self.device)
        self.backward_seconds.append(time.perf_counter() - t_bwd)
        if self.hand is not None:
            self.hand.finish()
        self.opt.step()
        sync(self.device)
        self.seconds.append(time.perf_counter() - start)


def interleaved_times(
    variants: list[Variant], args: argparse.Namespace, data, device: torch.device
) -> None:
    """One warm-up step each, then --repeats rounds, the order reversed every other
    round (A B C, C B A, ...) so a machine that gets busier favours no variant."""
    x, y = my_batch(args, data, 0, device)
    for v in variants:
        v.step(x, y)
        v.seconds.clear()
        v.backward_seconds.clear()
    for r in range(args.repeats):
        x, y = my_batch(args, data, r + 1, device)
        for v in variants if r % 2 == 0 else variants[::-1]:
            dist.barrier()  # every rank starts the variant together
            v.step(x, y)


def allreduce_times(device: torch.device, sizes: list[int], repeats: int) -> list[float]:
    """Median seconds of one all-reduce of each size (bytes of float32)."""
    out = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device=device)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            dist.all_reduce(t)
            sync(device)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """α (s) and β (s/byte) of t = α + β·bytes, fitted on relative errors (weights 1/t):
    plain least squares would let the largest sizes decide everything and leave α to noise."""
    t = np.asarray(seconds, float)
    beta, alpha = np.polyfit(np.asarray(sizes, float), t, 1, w=1 / np.maximum(t, 1e-12))
    return float(max(alpha, 0.0)), float(max(beta, 0.0))


def replay_exposed(bucket_bytes: list[int], backward_s: float, alpha: float, beta: float) -> float:
    """Communication left after backward ends, when bucket i is ready once backward has
    produced its share of the gradient bytes and the all-reduces run one after another
    (α + β·bytes each)."""
    total, done, free = sum(bucket_bytes), 0, 0.0
    for b in bucket_bytes:
        done += b
        ready = backward_s * done / total
        free = max(free, ready) + alpha + beta * b
    return max(0.0, free - backward_s)


def check_equivalence(args: argparse.Namespace, data, device: torch.device) -> None:
    """Part 1: HandDDP against DDP for every --bugs entry."""
    for bug in args.bugs:
        eq = equivalence(args, bug, data, device)
        metrics.emit({**eq, "procs": dist.get_world_size()})
        labdist.print0(
            f"HandDDP (bug={bug}, {eq['buckets']} buckets) vs DDP after {args.steps} steps: "
            f"gradients differ by {eq['grad_rel_err']:.1e}, weights by {eq['weight_rel_err']:.1e}"
        )


def bucket_bytes(hand: HandDDP) -> list[int]:
    """Bytes of each of HandDDP's buckets, in the order they are sent."""
    return [sum(p.numel() * p.element_size() for p in bucket) for bucket in hand.buckets]


def predict_buckets(
    caps: list[Variant], args: argparse.Namespace, backward_s: float, alpha: float, beta: float
) -> list[dict]:
    """For each --bucket-kb: its measured step times and the α–β replay's exposed time."""
    per_cap = []
    for b, v in zip(args.bucket_kb, caps, strict=True):
        bb = bucket_bytes(v.hand)
        per_cap.append(
            {
                "bucket_kb": b,
                "buckets": len(bb),
                "step_s": v.seconds,
                "predicted_exposed_s": replay_exposed(bb, backward_s, alpha, beta),
            }
        )
    return per_cap


def timing(args: argparse.Namespace, data, device: torch.device) -> None:
    """Parts 2 and 3: naive, overlapped and DDP timed interleaved; then the bucket sizes
    against backward without communication, and the α–β model's prediction."""
    kb = args.bucket_kb[0]
    side = [
        Variant("naive", args, device, kb, "naive"),
        Variant("overlapped", args, device, kb, "overlap"),
        Variant("DDP", args, device, kb, "ddp"),
    ]
    interleaved_times(side, args, data, device)
    alone = Variant("no communication", args, device, kb, "none")
    caps = [Variant(f"{b:g} KiB", args, device, b, "overlap") for b in args.bucket_kb]
    interleaved_times([alone, *caps], args, data, device)
    sizes = [2**k for k in range(10, 23, 2)]
    ar = allreduce_times(device, sizes, args.repeats)
    alpha, beta = fit_alpha_beta(sizes, ar)
    backward_s = statistics.median(alone.backward_seconds)
    metrics.emit(
        {
            "event": "timing",
            "procs": dist.get_world_size(),
            "repeats": args.repeats,
            "bucket_kb": kb,
            "psi_bytes": sum(p.numel() * p.element_size() for p in alone.model.parameters()),
            "variants": {v.name: v.seconds for v in side},
            "alpha_s": alpha,
            "beta_s_per_byte": beta,
            "allreduce_bytes": sizes,
            "allreduce_s": ar,
            "backward_s": backward_s,
            "no_comm_step_s": alone.seconds,
            "caps": predict_buckets(caps, args, backward_s, alpha, beta),
        }
    )
    med = {v.name: statistics.median(v.seconds) * 1e3 for v in side}
    labdist.print0("median step (ms): " + ", ".join(f"{k} {t:.1f}" for k, t in med.items()))
    labdist.print0(
        f"all-reduce fit: α = {alpha * 1e6:.0f} µs, 1/β = {1 / max(beta, 1e-30) / 1e9:.2f} GB/s"
    )


def main() -> None:
    args = parse_args()
    parallel.require_batch_split(args.batch_size)
    info = labdist.init(group_if_alone=True)
    data = parallel.corpus(args)
    check_equivalence(args, data, info.device)
    if not args.no_timing:
        timing(args, data, info.device)
    labdist.shutdown()


if __name__ == "__main__":
    main()
