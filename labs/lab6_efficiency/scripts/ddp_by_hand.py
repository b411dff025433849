"""Data parallelism built by hand: broadcast, bucketed asynchronous all-reduces during backward.

1. Equivalence: the character transformer trained --steps SGD steps by HandDDP (hooks
   launch one asynchronous all-reduce per bucket as soon as its last gradient is
   ready; the optimizer waits for them) and by DistributedDataParallel from the same
   start on the same batches; rank 0 reports how far gradients and weights differ.
   Buckets: for every --bucket-kb and --compare-mb, HandDDP's buckets (built as DDP
   builds them) beside the buckets DDP itself made, parameter by parameter.
2. Timing, shown: naive (all-reduce after backward) and overlapped HandDDP and DDP,
   timed interleaved (A B C C B A ...) in the same run, all with DDP's buckets.
3. An α–β model of the all-reduce (t = α + β·bytes each rank sends) fitted from timed
   all-reduces over the range of bucket sizes used, with its residuals; two replays of
   the backward for each --bucket-kb (communication beside backward on free cores, or
   on the same cores, adding to the step) beside the measured steps.

    torchrun --standalone --nproc-per-node 2 ddp_by_hand.py
    mpirun -np 2 python ddp_by_hand.py --bucket-kb 16 64 256 1024

DDP's bucketing, in the installed PyTorch (2.13), torch/nn/parallel/distributed.py:
``_BucketCapacityConfig.create`` (lines 86–110) sets the caps: ``first_bucket_bytes_cap``
is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) only when ``bucket_cap_mb`` is not given,
else the cap itself; ``compute_bucket_size_limits`` (lines 153–154) makes the first
iteration send one bucket (``[sys.maxsize]`` when ``static_graph`` or not
``find_unused_parameters``; with ``static_graph`` the rebuild comes one iteration later,
with ``find_unused_parameters=True`` nothing is rebuilt, and ``bucket_cap_mb_list``,
lines 145–148, overrides both); both caps go to ``dist.Reducer`` (lines 1437–1459), which
records the order the gradients arrive in and rebuilds the buckets at the start of the
next forward (``_pre_forward`` calls ``reducer._rebuild_buckets()``, lines 1769–1777) with
``compute_bucket_assignment_by_size``
and the limits ``[first_bucket_bytes_cap, bucket_bytes_cap]`` (C++,
torch/csrc/distributed/c10d/reducer.cpp; Python sees it as
``dist._compute_bucket_assignment_by_size``). tests/test_lab6_ddp.py compares that function
with Lab 6's ``make_buckets``, and this script's buckets with DDP's.

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    equivalence: bug, bucket_kb, steps, buckets, ddp_buckets, weight_rel_err,
        grad_rel_err, procs
    timing: procs, bucket_kb, caps, repeats, variants, psi_bytes, backward_s,
        no_comm_step_s, allreduce_s, allreduce_bytes, allreduce_sent_bytes,
        allreduce_fit_s, alpha_s, beta_s_per_byte
    buckets: procs, caps
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, paths, profile

# DDP's bucket assignment, as torch's reducer makes it (notebook 5's exercise writes it)
from lab_utils.buckets import make_buckets

BUGS = ("none", "no_average", "early_bucket")


def ddp_bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(cap, first_cap) in bytes, as ``DistributedDataParallel(bucket_cap_mb=...)`` sets
    them (torch/nn/parallel/distributed.py, lines 86–110): 25 MiB and
    ``dist._DEFAULT_FIRST_BUCKET_BYTES`` when ``bucket_cap_mb`` is None, else the given cap
    for the first bucket too."""
    if bucket_cap_mb is None:
        return 25 * 1024 * 1024, dist._DEFAULT_FIRST_BUCKET_BYTES
    cap = int(bucket_cap_mb * 1024 * 1024)
    return cap, cap


class HandDDP:
    """DistributedDataParallel by hand.

    [1] rank 0's weights are broadcast, so every rank starts equal;
    [2] each parameter gets a post-accumulate-grad hook. The first backward records the
        order the gradients arrive in and sends everything in one bucket after backward
        (DDP does the same); then the buckets are built in that order with DDP's rule
        (``make_buckets``). From the second step on, when the last gradient of a bucket
        has arrived the bucket is flattened and all-reduced asynchronously while
        backward goes on computing the earlier layers' gradients (overlap);
    [3] ``finish()`` waits for every bucket, divides by the number of ranks (the
        average) and copies the result back into the ``.grad`` tensors.
    ``overlap=False`` is the naive version: nothing is sent until backward has ended.
    ``bug`` makes one deliberate mistake (to show that the equivalence check catches it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cap: int,
        first_cap: int | None = None,
        *,
        overlap: bool = True,
        bug: str = "none",
    ) -> None:
        self.model, self.overlap, self.bug = model, overlap, bug
        self.world_size = dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # [1] everybody starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.caps = (cap, cap if first_cap is None else first_cap)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.order: list[int] = []  # [2] the order the gradients arrived in, first backward
        self.rebuilt = False
        self._use_buckets([list(range(len(self.params)))])  # one bucket until then
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        for p in self.params:  # [2]
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _use_buckets(self, buckets: list[list[int]]) -> None:
        self.bucket_indices = buckets
        self.buckets = [[self.params[i] for i in b] for b in buckets]
        self.bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.rebuilt:  # [2] first backward: only record the order
            self.order.append(self.index[id(p)])
            return
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
        if not self.overlap or not self.rebuilt:  # naive, or the first step: send now
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
        if not self.rebuilt:  # [2] DDP's buckets, in the order the gradients arrived
            self._use_buckets(make_buckets(self.sizes, self.order, *self.caps))
            self.rebuilt = True


def parse_args(argv=None) -> argparse.Namespace:
    S = paths.lab_module("lab6", "settings").DDP_BY_HAND.of()  # notebook 5's sizes
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--bucket-kb",
        nargs="+",
        type=float,
        default=S.bucket_kb,
        help="bucket sizes (KiB) timed; the first is used for the equivalence check",
    )
    p.add_argument(
        "--compare-mb",
        nargs="*",
        default=["0.01", "0.05", "0.25", "default"],
        help="more DDP bucket_cap_mb values (default: DDP's own, 25 MiB with a 1 MiB first "
        "bucket) whose buckets are compared with HandDDP's; 0.01 0.05 0.25 are notebook 4's",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=S.repeats,
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
    cap_mb = args.bucket_kb[0] / 1024
    hand = HandDDP(mine, *ddp_bucket_caps(cap_mb), bug=bug)
    ref = DDP(
        parallel.build_model(args).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cap_mb,
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
        "ddp_buckets": len(ddp_buckets(ref)),
        "bucket_kb": args.bucket_kb[0],
        "grad_rel_err": grad_err,
        "weight_rel_err": weight_err,
    }


def ddp_buckets(ddp: DDP) -> list[list[int]]:
    """The buckets DDP made, as parameter indices in the order it sends them (after its
    first step it has rebuilt them in the order the gradients arrived). Notebook 4 counts
    them the same way."""
    index = {p.data_ptr(): i for i, p in enumerate(ddp.module.parameters())}
    return [
        [index[q.data_ptr()] for q in b.parameters()]
        for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def compare_buckets(args: argparse.Namespace, data, device: torch.device) -> list[dict]:
    """For every cap: two steps of DDP and of HandDDP from the same model; the buckets
    each made and the order in which the gradients arrived."""
    caps: list[float | None] = [kb / 1024 for kb in args.bucket_kb]
    caps += [None if c == "default" else float(c) for c in args.compare_mb]
    out = []
    for cap_mb in caps:
        ddp = DDP(
            parallel.build_model(args).to(device),
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cap_mb,
        )
        hand = HandDDP(parallel.build_model(args).to(device), *ddp_bucket_caps(cap_mb))
        for step in range(2):  # DDP rebuilds its buckets after the first
            x, y = my_batch(args, data, step, device)
            for m in (ddp, hand.model):
                parallel.lm_loss(m(x), y).backward()
            hand.finish()
        cap, first_cap = ddp_bucket_caps(cap_mb)
        out.append(
            {
                "bucket_cap_mb": cap_mb,
                "cap": cap,
                "first_cap": first_cap,
                "nbytes": hand.sizes,
                "order": hand.order,
                "hand": hand.bucket_indices,
                "ddp": ddp_buckets(ddp),
            }
        )
    return out


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
        elif kind in ("naive", "overlap"):  # the same buckets as DDP with this cap
            self.hand = HandDDP(
                model, *ddp_bucket_caps(bucket_kb / 1024), overlap=kind == "overlap"
            )
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
    """Median seconds of one all-reduce of each size (bytes of float32). Each round times
    every size once, the order reversed every other round, so that a machine getting
    busier during the measurement favours no size."""
    tensors = [torch.ones(max(1, nbytes // 4), device=device) for nbytes in sizes]
    for t in tensors:
        dist.all_reduce(t)  # warm-up
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(repeats):
        order = range(len(sizes)) if r % 2 == 0 else reversed(range(len(sizes)))
        for i in order:
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            dist.all_reduce(tensors[i])
            sync(device)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def ring_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: a reduce-scatter and an
    all-gather, (N−1)/N of the data each."""
    return 2 * (world_size - 1) / world_size * nbytes


def fit_alpha_beta(sent: list[float], seconds: list[float]) -> tuple[float, float]:
    """α (s) and β (s per byte sent by a rank) of t = α + β·sent, fitted on relative
    errors (weights 1/t): plain least squares would let the largest sizes decide
    everything and leave α to noise."""
    t = np.asarray(seconds, float)
    beta, alpha = np.polyfit(np.asarray(sent, float), t, 1, w=1 / np.maximum(t, 1e-12))
    return float(max(alpha, 0.0)), float(max(beta, 0.0))


def replay_exposed(sent: list[float], backward_s: float, alpha: float, beta: float) -> float:
    """Communication left after backward ends, when bucket i (``sent[i]`` bytes per rank)
    is ready once backward has produced its share of the gradient bytes and the
    all-reduces run one after another (α + β·bytes each) on cores of their own."""
    total, done, free = sum(sent), 0.0, 0.0
    for b in sent:
        done += b
        ready = backward_s * done / total
        free = max(free, ready) + alpha + beta * b
    return max(0.0, free - backward_s)


def replay_serial(sent: list[float], alpha: float, beta: float) -> float:
    """Communication time when it cannot hide behind backward (the all-reduces share the
    cores with it): every all-reduce adds its α + β·bytes to the step."""
    return sum(alpha + beta * b for b in sent)


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
    """For each --bucket-kb: its measured step times and the two α–β replays."""
    per_cap = []
    n = dist.get_world_size()
    for b, v in zip(args.bucket_kb, caps, strict=True):
        bb = bucket_bytes(v.hand)
        sent = [ring_bytes(x, n) for x in bb]
        per_cap.append(
            {
                "bucket_kb": b,
                "buckets": len(bb),
                "bucket_bytes": bb,
                "step_s": v.seconds,
                "predicted_exposed_s": replay_exposed(sent, backward_s, alpha, beta),
                "predicted_serial_s": replay_serial(sent, alpha, beta),
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
    # the sizes the buckets have: from the smallest bucket to the largest, 8 on a log scale
    used = [x for v in caps for x in bucket_bytes(v.hand)]
    lo, hi = max(4, min(used)), max(used)
    sizes = sorted({4 * max(1, round(x / 4)) for x in np.geomspace(lo, hi, 8)})
    ar = allreduce_times(device, sizes, max(5 * args.repeats, 20))  # a few ms each: cheap
    sent = [ring_bytes(x, dist.get_world_size()) for x in sizes]
    alpha, beta = fit_alpha_beta(sent, ar)
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
            "allreduce_sent_bytes": sent,
            "allreduce_s": ar,
            "allreduce_fit_s": [alpha + beta * x for x in sent],
            "backward_s": backward_s,
            "no_comm_step_s": alone.seconds,
            "caps": predict_buckets(caps, args, backward_s, alpha, beta),
        }
    )
    med = {v.name: statistics.median(v.seconds) * 1e3 for v in side}
    labdist.print0("median step (ms): " + ", ".join(f"{k} {t:.1f}" for k, t in med.items()))
    bandwidth = f"1/β = {1 / beta / 1e9:.2f} GB/s" if beta > 0 else "β = 0"
    labdist.print0(f"all-reduce fit: α = {alpha * 1e6:.0f} µs, {bandwidth} (bytes each rank sends)")


def main() -> None:
    args = parse_args()
    parallel.require_batch_split(args.batch_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    data = parallel.corpus(args)
    check_equivalence(args, data, info.device)
    buckets = compare_buckets(args, data, info.device)
    metrics.emit({"event": "buckets", "procs": dist.get_world_size(), "caps": buckets})
    for c in buckets:
        same = "the same" if c["hand"] == c["ddp"] else "DIFFERENT"
        labdist.print0(
            f"bucket_cap_mb {c['bucket_cap_mb']}: DDP made {len(c['ddp'])} bucket(s), HandDDP "
            f"{len(c['hand'])}: {same}"
        )
    if not args.no_timing:
        timing(args, data, info.device)
    labdist.shutdown()


if __name__ == "__main__":
    main()
