"""Megatron-style tensor parallelism of a character transformer: by hand, then with DTensor.

1. One MLP block split by hand: rank r holds a block of fc1's output columns and the
   matching rows of fc2; one all-reduce forward, one backward. Compared with the
   unsplit block (outputs and gradients) and with parallelize_module.
2. The whole transformer split with parallelize_module (q, k, v and fc1 by columns,
   i.e. attention by heads; proj and fc2 by rows), trained --steps steps and compared
   with one process training the unsplit model; the whole model is saved (rank 0).
   CommDebugMode counts the collectives of a training step: four all-reduces per block
   with the attention's input prepared once, six with q, k, v each on their own.

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    mlp_block: procs, err_hand, err_dtensor, hand_bytes, dtensor_comm_counts,
        activation_bytes
    tp_train: procs, layers, steps, step_s, one_process_step_s, weights_rel_err,
        comm_counts, comm_counts_separate_qkv, activation_bytes
"""

import argparse
import contextlib
import copy
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn import functional as F

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, parallel, profile

# CommDebugMode's module tracker hooks the embedding, whose input (character ids) needs no gradient.
warnings.filterwarnings("ignore", message="Full backward hook is firing")
SENT = {"forward": 0, "backward": 0}  # bytes all-reduced by the hand-written split


class CopyToRanks(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the input's gradient
    (each rank's columns contributed a part of it)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        SENT["backward"] += grad.numel() * grad.element_size()
        dist.all_reduce(grad)
        return grad


class SumOverRanks(torch.autograd.Function):
    """Megatron's g: forward all-reduces the partial outputs; identity backward."""

    @staticmethod
    def forward(ctx, partial):
        partial = partial.contiguous()
        SENT["forward"] += partial.numel() * partial.element_size()
        dist.all_reduce(partial)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad


def mlp_by_hand(x, fc1, fc2, rank: int, world_size: int):
    """gelu(x W1ᵀ + b1) W2ᵀ + b2 with this rank's slice of fc1's rows and fc2's columns."""
    cols = fc1.weight.shape[0] // world_size
    part = slice(rank * cols, (rank + 1) * cols)
    x = CopyToRanks.apply(x)
    partial = F.gelu(x @ fc1.weight[part].T + fc1.bias[part]) @ fc2.weight[:, part].T
    return SumOverRanks.apply(partial) + fc2.bias


def tp_plan(n_layers: int, *, one_f_per_attention: bool = True) -> dict:
    """Attention by heads (q, k, v by columns, proj by rows); MLP column then row.

    q, k and v read the same input. As three ColwiseParallel modules each all-reduces
    its own part of that input's gradient: three backward all-reduces where Megatron
    has one. PrepareModuleInput makes the attention's input a replicated DTensor once,
    so the three partial gradients add up on each rank and one all-reduce carries the
    sum: Megatron's f once per attention, four all-reduces per block in all."""
    plan = {}
    for i in range(1, n_layers + 1):  # layers[0] is the embedding
        if one_f_per_attention:  # keep the DTensor (use_local_output=False) for q, k and v
            plan[f"layers.{i}.attn"] = PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False
            )
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.fc2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def comm_counts(debug: CommDebugMode) -> dict[str, int]:
    """{"all_reduce": 8, ...}: the collectives CommDebugMode saw, by short name."""
    return {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}


def counted_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """The collectives of one forward and backward of ``model`` (its gradients are dropped)."""
    with CommDebugMode() as debug:
        parallel.lm_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return comm_counts(debug)


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Stop with a message, before any process group, on heads that cannot be split."""
    parallel.require(
        args.heads % world_size == 0,
        f"{world_size} processes cannot split {args.heads} attention heads "
        f"evenly: use a process count that divides --heads {args.heads}",
    )


def backward(out: torch.Tensor, h: torch.Tensor) -> None:
    """Backward of a loss on a block's output, from a fresh gradient of its input."""
    h.grad = None
    out.square().mean().backward()


def grads_of(h: torch.Tensor, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the block's input and parameters (whole tensors, also DTensors)."""
    return {"x": h.grad.clone(), **{k: full(q.grad) for k, q in module.named_parameters()}}


def mlp_split_by_hand(mlp: torch.nn.Module, h: torch.Tensor, info: labdist.DistInfo) -> tuple:
    """The block with Megatron's f and g written out: output and gradients."""
    hand = copy.deepcopy(mlp)
    out = mlp_by_hand(h, hand.fc1, hand.fc2, info.rank, info.world_size)
    backward(out, h)
    grads = grads_of(h, hand)
    for name, g in grads.items():  # each rank has the gradient of its slice only: add them up
        if name not in ("x", "fc2.bias"):
            dist.all_reduce(g)
    return out, grads


def mlp_split_by_dtensor(mlp: torch.nn.Module, h: torch.Tensor, mesh) -> tuple:
    """The block split by parallelize_module: output, gradients and the collectives run."""
    lib = parallelize_module(
        copy.deepcopy(mlp), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    with CommDebugMode() as comm:
        out = lib(h)
        backward(out, h)
    return out, grads_of(h, lib), comm_counts(comm)


def error(out: torch.Tensor, grads: dict, out_ref: torch.Tensor, grads_ref: dict) -> float:
    """The larger relative error of the output and of the gradients."""
    return max(
        parallel.relative_error({"out": out}, {"out": out_ref}),
        parallel.relative_error(grads, grads_ref),
    )


def compare_mlp_block(model, x: torch.Tensor, mesh, info: labdist.DistInfo) -> int:
    """Part 1: one MLP block split by hand and with DTensor against the unsplit block.
    Returns the bytes of the block's output (one activation)."""
    block = model.layers[1]
    h = block.ln2(model.layers[0](x)).detach().requires_grad_()
    ref = copy.deepcopy(block.mlp)
    out_ref = ref(h)
    backward(out_ref, h)
    grads_ref = grads_of(h, ref)
    err_hand = error(*mlp_split_by_hand(block.mlp, h, info), out_ref, grads_ref)
    out_lib, grads_lib, counts = mlp_split_by_dtensor(block.mlp, h, mesh)
    err_lib = error(out_lib, grads_lib, out_ref, grads_ref)
    act_bytes = out_ref.numel() * out_ref.element_size()
    metrics.emit(
        {
            "event": "mlp_block",
            "procs": info.world_size,
            "err_hand": err_hand,
            "err_dtensor": err_lib,
            "hand_bytes": dict(SENT),
            "dtensor_comm_counts": counts,
            "activation_bytes": act_bytes,
        }
    )
    labdist.print0(
        f"MLP block on {info.world_size} ranks: by hand error {err_hand:.1e}, parallelize_module "
        f"error {err_lib:.1e}; all-reduced by hand {SENT}; DTensor collectives {counts}"
    )
    return act_bytes


def train_tensor_parallel(model, mesh, args: argparse.Namespace, data, device) -> dict:
    """Part 2: the whole transformer split by tp_plan, trained --steps steps. Returns the
    whole weights, the best step time (mean over ranks) and the collectives of a step."""
    tp = parallelize_module(model, mesh, tp_plan(args.layers))
    # foreach=False: the model mixes DTensors (split layers) and plain tensors, and the
    # fused multi-tensor kernels used on GPUs refuse such a mix.
    opt = torch.optim.Adam(tp.parameters(), lr=args.lr, foreach=False)
    tp_s, debug = [], CommDebugMode()
    for step in range(args.steps):
        xs, ys = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        start = time.perf_counter()
        with debug if step == 0 else contextlib.nullcontext():  # count one step, time the rest bare
            opt.zero_grad()
            loss = parallel.lm_loss(tp(xs), ys)
            loss.backward()
            opt.step()
        tp_s.append(time.perf_counter() - start)
        labdist.print0(f"step {step}: loss {loss.item():.3f}")
    state = {k: full(v) for k, v in tp.state_dict().items()}  # every rank joins the gathers
    bare = tp_s[1:] or tp_s  # step 0 ran under CommDebugMode
    return {"state": state, "step_s": labdist.average(min(bare)), "counts": comm_counts(debug)}


def train_one_process(reference, args: argparse.Namespace, data, device) -> float:
    """The unsplit model trained on the same batches: its best step time."""
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    one_s = []
    for step in range(args.steps):
        xs, ys = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        start = time.perf_counter()
        ref_opt.zero_grad()
        parallel.lm_loss(reference(xs), ys).backward()
        ref_opt.step()
        one_s.append(time.perf_counter() - start)
    return min(one_s)


def report_training(
    args: argparse.Namespace,
    tp: dict,
    reference: torch.nn.Module,
    one_s: float,
    counts_separate: dict[str, int],
    act_bytes: int,
) -> None:
    """Rank 0: how far the split training ended from one process's, and its collectives."""
    err = parallel.relative_error(tp["state"], reference.state_dict())
    world_size = labdist.world_size()
    metrics.emit(
        {
            "event": "tp_train",
            "procs": world_size,
            "steps": args.steps,
            "layers": args.layers,
            "weights_rel_err": err,
            "step_s": tp["step_s"],
            "one_process_step_s": one_s,
            "comm_counts": tp["counts"],
            "comm_counts_separate_qkv": counts_separate,
            "activation_bytes": act_bytes,
        }
    )
    print(
        f"after {args.steps} Adam steps: weights differ from one process by {err:.1e} "
        f"(relative); step {tp['step_s'] * 1e3:.1f} ms on {world_size} ranks vs "
        f"{one_s * 1e3:.1f} ms on one; collectives of a step {tp['counts']} (q, k, v each "
        f"on their own: {counts_separate})",
        flush=True,
    )


def save(args: argparse.Namespace, state: dict) -> None:
    """Rank 0 saves the gathered weights as a plain, unsplit model."""
    plain = parallel.build_model(args)
    plain.load_state_dict(state)
    models.save(args.checkpoint, plain, steps=args.steps, tensor_parallel=labdist.world_size())
    print(f"saved {args.checkpoint}", flush=True)


def main() -> None:
    args = parse_args()
    check_args(args, labdist.detect().world_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    device = info.device
    data = parallel.corpus(args)
    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed))
    model = parallel.build_model(args).to(device)
    mesh = init_device_mesh(device.type, (info.world_size,))
    act_bytes = compare_mlp_block(model, x, mesh, info)

    reference = copy.deepcopy(model) if info.rank == 0 else None
    separate = parallelize_module(
        copy.deepcopy(model), mesh, tp_plan(args.layers, one_f_per_attention=False)
    )
    counts_separate = counted_step(separate, x, y)  # the plan without the shared f, not trained
    del separate
    tp = train_tensor_parallel(model, mesh, args, data, device)
    if reference is not None:
        one_s = train_one_process(reference, args, data, device)
        report_training(args, tp, reference, one_s, counts_separate, act_bytes)
        if args.checkpoint:
            save(args, tp["state"])
    labdist.shutdown()


if __name__ == "__main__":
    main()
