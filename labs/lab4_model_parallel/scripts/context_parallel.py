"""Sequence and context parallelism: torch's sequence parallelism against tensor
parallelism alone, and ring attention over the processes against full attention.

Part 1 (sequence parallelism): one transformer block split by heads and MLP columns
(tensor parallelism), then with ``SequenceParallel`` on the LayerNorms (the sequence
split over the ranks between the attention and the MLP): the collectives of a forward
and backward and their bytes, the activation bytes each rank saves in the block's
forward (``lab_utils.saved_bytes``: each storage once), and the outputs against the
unsplit block. Unlike Megatron-LM's form (Korthikanti et al. 2022, §4.2.2), q, k, v and
fc1 save the all-gathered input whole on every rank (``lab_utils.planner``'s "torch").
Part 2 (context parallelism): each rank holds a share of the sequence of q, k and v,
one contiguous chunk or the load-balanced zig-zag pair of chunks (i and 2n−1−i of 2n);
ring attention passes the K/V blocks around the ring (send/recv) and keeps an online
softmax. Outputs and gradients against full causal attention on one process (both
layouts), the activation bytes and the attention FLOPs per rank at several sequence
lengths against one process, the time of a forward and backward against one process,
and whether torch's own ``context_parallel`` runs on this device and backend.

    torchrun --standalone --nproc-per-node 4 context_parallel.py --seq-lens 256 512 1024

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    sequence_parallel: sequence_parallel (on or off), world, counts, bytes, wire_bytes,
        activation_bytes, activation_elems, out_rel_err, grad_rel_err
    ring_equal: layout, world, seq_len, out, dq, dk, dv (errors against full attention)
    ring_memory: world, seq_len, per_rank, per_rank_zigzag, one_process, flops,
        block_flops (one per --seq-lens value)
    ring_time: world, seq_len, one_samples, ring_samples, zigzag_samples
    torch_context_parallel: world, device, ran, out_rel_err, error
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lab_utils import dist as labdist
from lab_utils import gloo_exit, memory, metrics, models, parallel, paths, profile
from lab_utils import ring_attention as ring

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def parse_args(argv=None) -> argparse.Namespace:
    m = parallel.MODEL.of()
    S = paths.lab_module("lab4", "settings").CONTEXT.of()  # notebook 7's sizes
    p = profile.script_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--d-model",
        type=int,
        default=m.d_model,
        help="width d of the block (part 1) and heads × head width (part 2)",
    )
    p.add_argument("--heads", type=int, default=m.heads, help="attention heads")
    p.add_argument("--batch-size", type=int, default=2, help="sequences")
    p.add_argument(
        "--seq-len",
        type=int,
        default=S.seq_len,
        help="sequence length of part 1 and of the equivalence check of part 2",
    )
    p.add_argument(
        "--seq-lens",
        nargs="+",
        type=int,
        default=S.seq_lens,
        help="sequence lengths at which part 2 measures activation bytes per rank",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=S.repeats,
        help="timed (one process, ring) pairs, in the order A B B A ...",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights")
    return p.parse_args(argv)


# ------------------------------------------------------------ part 1: sequence parallelism
class CollectiveBytes(TorchDispatchMode):
    """Counts the collectives DTensor runs (its functional collectives) and the size of
    each one's full tensor: an all-reduce's input, an all-gather's output, a
    reduce-scatter's input."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.counts = dict.fromkeys(COLLECTIVES, 0)
        self.bytes = dict.fromkeys(COLLECTIVES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        kind = next((k for k in COLLECTIVES if name.startswith(k)), None)
        if kind is not None and "_c10d_functional" in str(func.namespace):
            size = args[0].numel() * args[0].element_size()
            self.counts[kind] += 1
            self.bytes[kind] += size * (self.world_size if kind == "all_gather" else 1)
        return func(*args, **(kwargs or {}))

    def wire_bytes(self) -> float:
        """Bytes each rank sends with ring algorithms: 2(n−1)/n of an all-reduce's size,
        (n−1)/n of an all-gather's or a reduce-scatter's."""
        n = self.world_size
        return ((n - 1) / n) * (
            2 * self.bytes["all_reduce"] + self.bytes["all_gather"] + self.bytes["reduce_scatter"]
        )


def block_saved(split: torch.nn.Module) -> memory.SavedTensorCounter:
    """The meter of the activations this rank saves for the block's backward (each
    storage once; a DTensor counts its local shard; the weights are not activations)."""
    return memory.SavedTensorCounter(split.parameters())


def tp_plan(sequence_parallel: bool) -> dict:
    """Heads and MLP columns split; with ``sequence_parallel`` the LayerNorms run on
    the rank's chunk of the sequence, the attention and the MLP gather it
    (all-gather) and hand back a chunk (reduce-scatter instead of all-reduce)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn": PrepareModuleInput(
            input_layouts=seq, desired_input_layouts=Replicate(), use_local_output=False
        ),
        "mlp": PrepareModuleInput(
            input_layouts=seq, desired_input_layouts=Replicate(), use_local_output=False
        ),
    }
    for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
        plan[name] = ColwiseParallel()
    for name in ("attn.proj", "mlp.fc2"):
        plan[name] = RowwiseParallel(output_layouts=seq)
    if sequence_parallel:
        plan["ln1"] = SequenceParallel()
        plan["ln2"] = SequenceParallel()
    return plan


def sequence_parallel_part(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> None:
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(args.seed)
    block = models.Block(args.d_model, args.heads).to(device)
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, device=device)
    weight = torch.randn_like(x)
    xf = x.clone().requires_grad_()
    full = block(xf)
    (full * weight).sum().backward()
    want_grad = xf.grad
    for sp in (False, True):
        torch.manual_seed(args.seed)
        split = parallelize_module(
            models.Block(args.d_model, args.heads).to(device), mesh, tp_plan(sp)
        )
        mine = (ring.chunk(x, rank, world_size, dim=1) if sp else x).clone().requires_grad_()
        w = ring.chunk(weight, rank, world_size, dim=1) if sp else weight
        counter = block_saved(split)
        with CollectiveBytes(world_size) as comm:
            with counter:  # the block's forward only: the loss's weight w is no activation
                out = split(mine)
            (out * w).sum().backward()
        out_full, grad_full = (
            _gather_seq(t, world_size) if sp else t for t in (out.detach(), mine.grad)
        )
        saved = _all(counter.bytes, world_size)
        if rank == 0:
            metrics.emit(
                {
                    "event": "sequence_parallel",
                    "sequence_parallel": sp,
                    "world": world_size,
                    "counts": comm.counts,
                    "bytes": comm.bytes,
                    "wire_bytes": comm.wire_bytes(),
                    "activation_bytes": saved,
                    "activation_elems": args.batch_size * args.seq_len * args.d_model,
                    "out_rel_err": parallel.relative_error({"o": out_full}, {"o": full.detach()}),
                    "grad_rel_err": parallel.relative_error({"g": grad_full}, {"g": want_grad}),
                }
            )
            print(
                f"{'TP + SP' if sp else 'TP alone'}: collectives {comm.counts}, "
                f"{comm.wire_bytes() / 2**10:.1f} KiB sent per rank; activations saved per rank "
                f"{[f'{b / 2**10:.0f} KiB' for b in saved]}",
                flush=True,
            )


def _gather_seq(t: torch.Tensor, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def _all(value: int, world_size: int) -> list[int]:
    out = [None] * world_size
    dist.all_gather_object(out, int(value))
    return out


# ------------------------------------------------------------ part 2: context parallelism
def qkv(args: argparse.Namespace, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    """The same q, k, v, ``(batch, heads, seq_len, head_dim)``, on every rank."""
    g = torch.Generator().manual_seed(args.seed + seq_len)
    shape = (args.batch_size, args.heads, seq_len, args.d_model // args.heads)
    return [torch.randn(shape, generator=g).to(device) for _ in range(4)]  # q, k, v, weight


# layout: (this rank's share of the sequence, ring attention on that layout)
LAYOUTS = {
    "contiguous": (ring.chunk, ring.ring_attention),
    "zigzag": (ring.zigzag_chunk, ring.zigzag_ring_attention),
}


def ring_step(q, k, v, w, rank: int, world_size: int, layout: str = "contiguous"):
    """Ring attention on this rank's share (``layout``), forward and backward: output and
    gradients."""
    cut, attend = LAYOUTS[layout]
    mine = [cut(t, rank, world_size).clone().requires_grad_() for t in (q, k, v)]
    passes = ring.Ring()
    out = passes.tie(attend(*mine, rank, world_size, passes))
    (out * cut(w, rank, world_size)).sum().backward()
    return out.detach(), [t.grad for t in mine]


def context_parallel_part(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> None:
    q, k, v, w = qkv(args, args.seq_len, device)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    (want * w).sum().backward()
    for layout in LAYOUTS:
        out, grads = ring_step(q, k, v, w, rank, world_size, layout)
        got = [_gather_seq2(t, world_size, layout) for t in (out, *grads)]
        errors = {
            name: parallel.relative_error({"t": g}, {"t": r})
            for name, g, r in zip(
                ("out", "dq", "dk", "dv"), got, (want.detach(), *(t.grad for t in full))
            )
        }
        if rank == 0:
            metrics.emit(
                {
                    "event": "ring_equal",
                    "layout": layout,
                    "world": world_size,
                    "seq_len": args.seq_len,
                    **errors,
                }
            )
            print(
                f"ring attention ({layout}) on {world_size} ranks vs full causal attention: "
                + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()),
                flush=True,
            )

    for seq_len in args.seq_lens:  # activation bytes and attention FLOPs per rank
        q, k, v, _ = qkv(args, seq_len, device)
        saved, flops = {}, {}
        for layout, (cut, attend) in LAYOUTS.items():
            # a copy, as ring_step makes: a view would keep (and meter) the whole sequence
            mine = [cut(t, rank, world_size).clone().requires_grad_() for t in (q, k, v)]
            counter = memory.SavedTensorCounter()
            with counter.hooks(), FlopCounterMode(display=False) as flop_counter:
                attend(*mine, rank, world_size, ring.Ring())
            saved[layout] = _all(counter.bytes, world_size)
            flops[layout] = _all(flop_counter.get_total_flops(), world_size)
        one = one_process_bytes(q, k, v)
        if rank == 0:
            b, h, _, d = q.shape
            metrics.emit(
                {
                    "event": "ring_memory",
                    "world": world_size,
                    "seq_len": seq_len,
                    "per_rank": saved["contiguous"],
                    "per_rank_zigzag": saved["zigzag"],
                    "one_process": one,
                    "flops": flops,
                    # FLOPs of one (T/2n)² block of scores: QKᵀ and PV, 2·b·h·d each per score
                    "block_flops": 4 * b * h * d * (seq_len // (2 * world_size)) ** 2,
                }
            )
            print(
                f"T={seq_len}: activations saved per rank {[f'{b / 2**20:.2f} MiB' for b in saved['contiguous']]} "
                f"(zig-zag {[f'{b / 2**20:.2f} MiB' for b in saved['zigzag']]}), "
                f"one process {one / 2**20:.2f} MiB; attention MFLOP per rank "
                f"{[round(f / 1e6, 1) for f in flops['contiguous']]} "
                f"(zig-zag {[round(f / 1e6, 1) for f in flops['zigzag']]})",
                flush=True,
            )

    time_ring(args, rank, world_size, device)
    torch_context_parallel(args, rank, world_size, device)


def one_process_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Activation bytes of the same attention on one process (a ring of one)."""
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    return memory.activation_bytes(lambda: ring.ring_attention(*whole, 0, 1, None))


def _gather_seq2(t: torch.Tensor, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=2) if layout == "contiguous" else ring.zigzag_unchunk(parts)


def time_ring(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    """Forward and backward of attention at the longest --seq-lens: one process (rank 0,
    the others wait), the contiguous ring and the zig-zag ring, in the order A B C C B A
    ...; wall-clock seconds."""
    q, k, v, w = qkv(args, max(args.seq_lens), device)
    one_s, ring_s, zigzag_s = [], [], []
    kinds = ("one", "ring", "zigzag")
    for r in range(args.repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            dist.barrier()
            start = time.perf_counter()
            if kind != "one":
                layout = "zigzag" if kind == "zigzag" else "contiguous"
                ring_step(q, k, v, w, rank, world_size, layout)
                dist.barrier()
                (zigzag_s if kind == "zigzag" else ring_s).append(time.perf_counter() - start)
            else:
                if rank == 0:
                    full = [t.clone().requires_grad_() for t in (q, k, v)]
                    (F.scaled_dot_product_attention(*full, is_causal=True) * w).sum().backward()
                one_s.append(time.perf_counter() - start)
    if rank == 0:
        metrics.emit(
            {
                "event": "ring_time",
                "world": world_size,
                "seq_len": max(args.seq_lens),
                "one_samples": one_s,
                "ring_samples": ring_s,
                "zigzag_samples": zigzag_s,
            }
        )
        print(
            f"T={max(args.seq_lens)}: forward+backward one process {statistics.median(one_s) * 1e3:.1f} ms, "
            f"ring on {world_size} ranks {statistics.median(ring_s) * 1e3:.1f} ms, zig-zag ring "
            f"{statistics.median(zigzag_s) * 1e3:.1f} ms (medians)",
            flush=True,
        )


def _all_floats(values: list[float], world_size: int) -> list[list[float]]:
    out = [None] * world_size
    dist.all_gather_object(out, values)
    return out


def torch_context_parallel(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> None:
    """Try torch's own context parallelism (experimental) on this device and backend:
    its sharded causal attention against full attention, or the error it raised."""
    q, k, v, _ = qkv(args, args.seq_len, device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    result: dict = {"event": "torch_context_parallel", "world": world_size, "device": device.type}
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        mesh = init_device_mesh(device.type, (world_size,))
        bufs = [t.clone() for t in (q, k, v)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(*bufs, is_causal=True)
        (out,) = context_parallel_unshard(mesh, [out], [2])
        result.update(ran=True, out_rel_err=parallel.relative_error({"o": out}, {"o": want}))
    except Exception as exc:
        result.update(ran=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    verdicts = _all_floats([result["ran"]], world_size)
    result["ran"] = all(v[0] for v in verdicts)
    if rank == 0:
        metrics.emit(result)
        print(
            "torch context_parallel: "
            + (
                f"ran, output error {result['out_rel_err']:.1e}"
                if result["ran"]
                else f"did not run ({result.get('error')})"
            ),
            flush=True,
        )


def main() -> None:
    args = parse_args()
    world_size = labdist.detect().world_size
    parallel.require(
        world_size >= 2,
        "context parallelism needs at least 2 processes (torchrun --nproc-per-node 2)",
    )
    lengths = [args.seq_len, *args.seq_lens]
    parallel.require(
        all(t % world_size == 0 for t in lengths),
        f"every sequence length ({lengths}) must be a multiple of the {world_size} processes",
    )
    parallel.require(
        args.heads % world_size == 0 and args.d_model % args.heads == 0,
        f"--heads {args.heads} must be a multiple of the {world_size} processes and divide "
        f"--d-model {args.d_model}",
    )
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    sequence_parallel_part(args, info.rank, world_size, info.device)
    context_parallel_part(args, info.rank, world_size, info.device)
    labdist.shutdown()


if __name__ == "__main__":
    main()
