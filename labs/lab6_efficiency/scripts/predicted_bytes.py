"""Count the bytes one training step hands to communication, for six ways of splitting one model.

The same character transformer, the same global batch, on N processes:
- ddp: DistributedDataParallel, gradients all-reduced;
- zero1_torch: PyTorch's ZeroRedundancyOptimizer beside DDP (Lab 4's wrapping): the same
  all-reduce, then every rank broadcasts the parameters it updated
  (torch/distributed/optim/zero_redundancy_optimizer.py in torch 2.13: ``step``, lines
  1124–1153, calls ``_sync_params``, 813–826, which calls ``_broadcast_params_from_rank``,
  760–811, for every rank);
- zero2: ZeRO stage 2's communication pattern as Rajbhandari et al. 2020 define it (§5.2;
  bytes §7.2.1, which stage 1 shares) without its gradient-memory saving, written here with torch.distributed's collectives: the
  gradients reduce-scattered, each rank's Adam steps its shard, the updated parameters
  all-gathered (Gloo runs reduce-scatter and all-gather on CPU tensors in torch 2.13);
- fsdp: FSDP2 (ZeRO stage 3), weights all-gathered in forward and again in backward,
  gradients reduce-scattered;
- tp: Megatron's all-reduces of activations, counted from DTensor's collectives;
- pp: a pipeline, one stage per rank, activations and their gradients sent point to point.
For each, one step after a warm-up is counted: the size of every collective's full
tensor by kind, and every point-to-point send. Rank 0 emits the counts; the notebook
turns them into bytes sent per rank and compares them with the student's prediction.

    torchrun --standalone --nproc-per-node 2 predicted_bytes.py
    mpirun -np 2 python predicted_bytes.py --strategies ddp zero2 fsdp

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, psi, d_model, layers, batch_size, seq_len, microbatches,
        bytes_per_value
    counted: strategy, bytes, calls, comm_debug_counts, p2p_per_rank, weight_rel_err
        (one per strategy)
"""

import argparse
import contextlib
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, profile, traffic

# Lab 4's scripts: the DDP / ZeRO-1 / FSDP wrapping and the Megatron plan, reused as they are.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab4_model_parallel" / "scripts"))
from sharded import wrap
from tensor_parallel import comm_counts, tp_plan

STRATEGIES = ("ddp", "zero1_torch", "zero2", "fsdp", "tp", "pp")
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


class FunctionalBytes(TorchDispatchMode):
    """Bytes of the functional collectives DTensor runs (``_c10d_functional.*``), which
    go to the process group from C++ and so past :func:`lab_utils.traffic.count`: the
    full tensor of each, by kind, as ``traffic`` counts them."""

    KINDS = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
    }

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size, self.bytes, self.calls = world_size, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in self.KINDS:
            t = args[0]
            size = (
                t.numel()
                * t.element_size()
                * (self.world_size if name.startswith("all_gather") else 1)
            )
            self.bytes[self.KINDS[name]] += size
            self.calls[self.KINDS[name]] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def sends() -> Counter:
    """Bytes this rank sends point to point (``isend``/``send``, also inside
    ``batch_isend_irecv``), while the block runs."""
    sent = Counter()
    originals = {"isend": c10d.isend, "send": c10d.send}

    def counting(name: str):
        original = originals[name]

        def call(tensor, *args, **kwargs):
            sent["p2p"] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        call.__name__ = original.__name__
        return call

    wrapped = {name: counting(name) for name in originals}
    for name, fn in wrapped.items():  # P2POp and batch_isend_irecv compare ops with c10d's own
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    try:
        yield sent
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


class ZeRO2:
    """ZeRO stage 2's communication pattern (Rajbhandari et al. 2020, §5.2; bytes as §7.2.1)
    on a model every rank holds whole, without its gradient-memory saving: every rank holds
    all Ψ of ``.grad`` through backward and ``_flat`` copies it before the reduce-scatter,
    where §5.2 reduces each bucket during backward and frees it. Same bytes, not same memory.

    [1] backward computes this rank's gradients (no communication during backward);
    [2] ``reduce_scatter_tensor``: rank r receives the sum over ranks of the r-th 1/N of
        the flat gradient (stage 2 keeps only this; here the full .grad lives until then);
    [3] Adam steps that shard alone, so each rank holds the optimizer state of 1/N of
        the parameters (stage 1);
    [4] ``all_gather_into_tensor``: every rank receives every updated shard.
    A reduce-scatter and an all-gather of Ψ values each: 2(N−1)/N·Ψ sent per rank, the
    bytes of DDP's all-reduce (§7.2.1). The flat vector is padded to a multiple of N."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.n, rank = dist.get_world_size(), dist.get_rank()
        self.total = sum(q.numel() for q in self.params)
        self.padded = -(-self.total // self.n) * self.n
        flat = self._flat([q.detach() for q in self.params])
        self.shard = torch.nn.Parameter(flat.view(self.n, -1)[rank].clone())
        self.opt = torch.optim.Adam([self.shard], lr=lr)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded, device=tensors[0].device, dtype=tensors[0].dtype)
        flat[: self.total] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    def zero_grad(self) -> None:
        for q in self.params:
            q.grad = None

    def step(self) -> None:
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in self.params]
        mine = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(mine, self._flat(grads))  # [2] sum of my shard
        self.shard.grad = mine / self.n  # the average, as DDP's
        self.opt.step()  # [3]
        full = torch.empty(self.padded, device=mine.device, dtype=mine.dtype)
        dist.all_gather_into_tensor(full, self.shard.detach())  # [4]
        offset = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(full[offset : offset + q.numel()].view_as(q))
                offset += q.numel()


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--microbatches", type=int, default=2, help="pipeline micro-batches per step")
    p.add_argument("--cpu-offload", action="store_true", help=argparse.SUPPRESS)  # used by wrap()
    return p.parse_args(argv)


def data_parallel_step(strategy: str, args: argparse.Namespace, batches, device) -> dict:
    """DDP, ZeroRedundancyOptimizer or FSDP (Lab 4's wrap), or ZeRO-2 (above): each rank
    its share of the batch. For ZeRO-2 also how far its weights are from one process
    training the whole model on the whole batches with Adam (the yardstick)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    if strategy == "zero2":
        model = parallel.build_model(args).to(device)
        opt = ZeRO2(model, args.lr)
    else:
        lab4_name = {"zero1_torch": "zero1"}.get(strategy, strategy)
        model, opt = wrap(lab4_name, parallel.build_model(args).to(device), args, device)
    counted: dict = {}
    for i, (x, y) in enumerate(batches):
        with traffic.count() as seen:
            opt.zero_grad()
            parallel.lm_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        if i == len(batches) - 1:  # the last step; the first also set things up
            counted = dict(seen)
    out = {"bytes": counted, "calls": {}}
    if strategy == "zero2":
        alone = parallel.build_model(args).to(device)
        adam = torch.optim.Adam(alone.parameters(), lr=args.lr)
        for x, y in batches:
            adam.zero_grad()
            parallel.lm_loss(alone(x), y).backward()
            adam.step()
        out["weight_rel_err"] = parallel.relative_error(
            dict(model.named_parameters()), dict(alone.named_parameters())
        )
    return out


def tensor_parallel_step(args: argparse.Namespace, batches, device) -> dict:
    """Megatron's plan (Lab 4): every rank the whole batch, half of each block."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    tp = parallelize_module(parallel.build_model(args).to(device), mesh, tp_plan(args.layers))
    opt = torch.optim.Adam(tp.parameters(), lr=args.lr, foreach=False)
    out: dict = {}
    for i, (x, y) in enumerate(batches):
        with CommDebugMode() as debug, FunctionalBytes(dist.get_world_size()) as seen:
            opt.zero_grad()
            parallel.lm_loss(tp(x), y).backward()
            opt.step()
        if i == len(batches) - 1:
            out = {
                "bytes": dict(seen.bytes),
                "calls": dict(seen.calls),
                "comm_debug_counts": comm_counts(debug),
            }
    return out


def pipeline_step(args: argparse.Namespace, batches, device) -> dict:
    """One stage per rank (contiguous layers), GPipe with --microbatches micro-batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = parallel.build_model(args).to(device)
    stage_module = torch.nn.Sequential(
        *[model.layers[i] for i in model.stage_layers(rank, world_size)]
    )
    stage = PipelineStage(stage_module, rank, world_size, device)
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=parallel.lm_loss)
    opt = torch.optim.Adam(stage_module.parameters(), lr=args.lr)
    sent: Counter = Counter()
    for i, (x, y) in enumerate(batches):
        with sends() as seen:
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world_size - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
        if i == len(batches) - 1:  # the first step also inferred the shapes
            sent = seen
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, sent["p2p"])
    return {"bytes": {"p2p": sum(per_rank)}, "calls": {}, "p2p_per_rank": per_rank}


def main() -> None:
    args = parse_args()
    world_size = labdist.detect().world_size
    parallel.require(world_size >= 2, "run on at least 2 processes: alone nothing is communicated")
    parallel.require(
        args.batch_size % world_size == 0 and args.batch_size % args.microbatches == 0,
        f"--batch-size {args.batch_size} must divide by {world_size} processes and by "
        f"--microbatches {args.microbatches}",
    )
    parallel.require(
        args.heads % world_size == 0,
        f"{world_size} processes cannot split {args.heads} heads evenly",
    )
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    device = info.device
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(2)
    ]
    model = parallel.build_model(args)
    shape = {
        "procs": world_size,
        "psi": sum(q.numel() for q in model.parameters()),
        "d_model": args.d_model,
        "layers": args.layers,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "microbatches": args.microbatches,
        "bytes_per_value": 4,
    }
    metrics.emit({"event": "model", **shape})
    for strategy in args.strategies:
        if strategy == "tp":
            counted = tensor_parallel_step(args, batches, device)
        elif strategy == "pp":
            counted = pipeline_step(args, batches, device)
        else:
            counted = data_parallel_step(strategy, args, batches, device)
        metrics.emit({"event": "counted", "strategy": strategy, **counted})
        labdist.print0(f"{strategy:5s}: one step handed {counted['bytes']} bytes to communication")
        dist.barrier()
    labdist.shutdown()


if __name__ == "__main__":
    main()
