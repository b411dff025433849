"""Hybrid parallelism on a 2-D device mesh: data parallel × tensor parallel.

The processes form a (dp, tp) mesh. Along "tp" each block is split Megatron-style
with parallelize_module (attention by heads, MLP column then row); along "dp" the
model is sharded and its gradients averaged with FSDP2's fully_shard. The job trains
--steps Adam steps on a global batch split over the dp groups, compares the weights
with one process training the unsplit model, and saves the whole model (rank 0).

    torchrun --standalone --nproc-per-node 4 hybrid.py --tp 2      # 2 data × 2 tensor

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    hybrid: dp, tp, psi, layers, steps, per_rank, comm_bytes, comm_counts, step_s,
        one_process_step_s, weights_rel_err
"""

import argparse
import contextlib
import copy
import logging
import time
import warnings

import torch
from tensor_parallel import tp_plan  # the plan of tensor_parallel.py, next to this script
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from lab_utils import dist as labdist
from lab_utils import gloo_exit, memory, metrics, models, parallel, profile, traffic

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # no in-place ops on outputs
warnings.filterwarnings("ignore", message="Full backward hook is firing")  # stage 0 takes ids
# Gathering a 2-D-sharded weight for the checkpoint takes two all-gathers; torch says so per tensor.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel ranks per data-parallel group"
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> int:
    """Stop with a message, before any process group, on a mesh that cannot be built;
    return the number of data-parallel groups."""
    parallel.require(
        args.tp >= 1 and world_size % args.tp == 0,
        f"--tp {args.tp} does not divide the process count {world_size}: a (data × tensor) "
        f"mesh needs a multiple of {args.tp} processes",
    )
    dp = world_size // args.tp
    parallel.require(
        args.heads % args.tp == 0, f"--tp {args.tp} does not divide --heads {args.heads}"
    )
    parallel.require(
        args.batch_size % dp == 0,
        f"--batch-size {args.batch_size} does not split over {dp} data-parallel groups",
    )
    return dp


def split(model: torch.nn.Module, mesh, args: argparse.Namespace) -> torch.nn.Module:
    """Split every block along "tp" (tensor_parallel.py's plan), then shard the layers
    along "dp" with FSDP2 (when there is more than one data-parallel group)."""
    model = parallelize_module(model, mesh["tp"], tp_plan(args.layers))
    if mesh["dp"].size() > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def train_hybrid(model, opt, batches: list, mine: slice) -> dict:
    """Train on this data-parallel group's part of each batch: the step times, the bytes
    of the last step's collectives, and the collectives of the first step."""
    seconds, comm, debug = [], {}, CommDebugMode()
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        # CommDebugMode counts the collectives of the first step; the others are timed bare
        with traffic.count() as seen, debug if step == 0 else contextlib.nullcontext():
            opt.zero_grad()
            loss = parallel.lm_loss(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
        seconds.append(time.perf_counter() - start)
        comm = dict(seen)
        labdist.print0(f"step {step}: loss {loss.item():.3f}")
    counts = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    return {"seconds": seconds, "comm": comm, "counts": counts}


def whole_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit weights on every rank (every rank joins the gathers)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in model.state_dict().items()
    }


def train_one_process(reference: torch.nn.Module, batches: list, lr: float) -> float:
    """The unsplit model trained on the whole batches: its best step time."""
    ref_opt = torch.optim.Adam(reference.parameters(), lr=lr)
    one_s = []
    for x, y in batches:
        start = time.perf_counter()
        ref_opt.zero_grad()
        parallel.lm_loss(reference(x), y).backward()
        ref_opt.step()
        one_s.append(time.perf_counter() - start)
    return min(one_s)


def report(args, dp: int, run: dict, reference: torch.nn.Module, one_s: float) -> None:
    """Rank 0: the weights against one process, the state held, times and collectives."""
    err = parallel.relative_error(
        run["state"], {k: v.cpu() for k, v in reference.state_dict().items()}
    )
    psi = sum(q.numel() for q in reference.parameters())
    comm, counts, step_s, per_rank = run["comm"], run["counts"], run["step_s"], run["per_rank"]
    metrics.emit(
        {
            "event": "hybrid",
            "dp": dp,
            "tp": args.tp,
            "steps": args.steps,
            "weights_rel_err": err,
            "psi": psi,
            "per_rank": per_rank,
            "layers": args.layers,
            "comm_bytes": comm,
            "comm_counts": counts,
            "step_s": step_s,
            "one_process_step_s": one_s,
        }
    )
    print(
        f"mesh dp={dp} × tp={args.tp}: weights vs one process {err:.1e}; rank 0 holds "
        f"{sum(per_rank.values()) / 2**20:.2f} MiB of state; {step_s * 1e3:.1f} ms per step "
        f"(one process {one_s * 1e3:.1f} ms); collectives {counts}, bytes {comm}",
        flush=True,
    )


def save(args: argparse.Namespace, state: dict, dp: int) -> None:
    """Rank 0 saves the gathered weights as a plain, unsplit model."""
    plain = parallel.build_model(args)
    plain.load_state_dict(state)
    models.save(args.checkpoint, plain, steps=args.steps, dp=dp, tp=args.tp)
    print(f"saved {args.checkpoint}", flush=True)


def main() -> None:
    args = parse_args()
    dp = check_args(args, labdist.detect().world_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    # a group even alone: init_device_mesh would otherwise make one with no backend named
    # (torch 2.13, device_mesh.py line 441: init_process_group(); distributed_c10d.py
    # line 1843: "undefined", made per device when first used), and a CPU tensor's
    # all-reduce (labdist.average) then finds none under CUDA ("No backend type
    # associated with device type cpu", seen on an H200)
    info = labdist.init(group_if_alone=True)
    mesh = init_device_mesh(info.device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(info.device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]
    model = parallel.build_model(args).to(info.device)
    reference = copy.deepcopy(model) if info.rank == 0 else None
    model = split(model, mesh, args)
    # foreach=False: the model mixes DTensors (split layers) and plain tensors, and the
    # fused multi-tensor kernels used on GPUs refuse such a mix (tensor_parallel.py too).
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False)
    mine = slice(dp_rank * args.batch_size // dp, (dp_rank + 1) * args.batch_size // dp)
    run = train_hybrid(model, opt, batches, mine)
    run["per_rank"] = memory.state_bytes(model, opt)
    run["state"] = whole_state(model)
    run["step_s"] = labdist.average(min(run["seconds"][1:] or run["seconds"]))  # step 0 counted
    if reference is not None:
        report(args, dp, run, reference, train_one_process(reference, batches, args.lr))
        if args.checkpoint:
            save(args, run["state"], dp)
    labdist.shutdown()


if __name__ == "__main__":
    main()
