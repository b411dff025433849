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
from lab_utils import metrics, models, parallel, profile

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


def mlp_by_hand(x, fc1, fc2, rank: int, n: int):
    """gelu(x W1ᵀ + b1) W2ᵀ + b2 with this rank's slice of fc1's rows and fc2's columns."""
    cols = fc1.weight.shape[0] // n
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


def main() -> None:
    args = parse_args()
    n = labdist.detect().world_size
    parallel.require(
        args.heads % n == 0,
        f"{n} processes cannot split {args.heads} attention heads "
        f"evenly: use a process count that divides --heads {args.heads}",
    )
    info = labdist.init(group_if_alone=True)
    rank, device = info.rank, info.device
    data = parallel.corpus(args)
    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed))

    # -- 1. one MLP block, by hand and with DTensor, against the unsplit block
    model = parallel.build_model(args).to(device)
    block = model.layers[1]
    h = block.ln2(model.layers[0](x)).detach().requires_grad_()
    ref = copy.deepcopy(block.mlp)
    out_ref = ref(h)
    out_ref.square().mean().backward()
    grads_ref = {"x": h.grad.clone(), **{k: q.grad for k, q in ref.named_parameters()}}

    h.grad = None
    hand = copy.deepcopy(block.mlp)
    out_hand = mlp_by_hand(h, hand.fc1, hand.fc2, rank, n)
    out_hand.square().mean().backward()
    grads_hand = {"x": h.grad.clone(), **{k: q.grad for k, q in hand.named_parameters()}}
    if n > 1:  # each rank has the gradient of its slice only: add the slices up
        for g in grads_hand.values():
            if g is not grads_hand["x"] and g is not grads_hand["fc2.bias"]:
                dist.all_reduce(g)
    err_hand = max(
        parallel.relative_error({"out": out_hand}, {"out": out_ref}),
        parallel.relative_error(grads_hand, grads_ref),
    )

    mesh = init_device_mesh(device.type, (n,))
    lib = parallelize_module(
        copy.deepcopy(block.mlp), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    h.grad = None
    with CommDebugMode() as comm:
        out_lib = lib(h)
        out_lib.square().mean().backward()
    counts = comm_counts(comm)
    grads_lib = {"x": h.grad.clone(), **{k: full(q.grad) for k, q in lib.named_parameters()}}
    err_lib = max(
        parallel.relative_error({"out": out_lib}, {"out": out_ref}),
        parallel.relative_error(grads_lib, grads_ref),
    )
    act_bytes = out_ref.numel() * out_ref.element_size()
    metrics.emit(
        {
            "event": "mlp_block",
            "procs": n,
            "err_hand": err_hand,
            "err_dtensor": err_lib,
            "hand_bytes": dict(SENT),
            "dtensor_comm_counts": counts,
            "activation_bytes": act_bytes,
        }
    )
    labdist.print0(
        f"MLP block on {n} ranks: by hand error {err_hand:.1e}, parallelize_module "
        f"error {err_lib:.1e}; all-reduced by hand {SENT}; DTensor collectives {counts}"
    )

    # -- 2. the whole transformer, tensor-parallel, trained against one process
    reference = copy.deepcopy(model) if rank == 0 else None
    separate = parallelize_module(
        copy.deepcopy(model), mesh, tp_plan(args.layers, one_f_per_attention=False)
    )
    counts_separate = counted_step(separate, x, y)  # the plan without the shared f, not trained
    del separate
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
    step_s = labdist.average(min(bare)) if n > 1 else min(bare)
    if rank == 0:
        ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
        one_s = []
        for step in range(args.steps):
            xs, ys = (
                t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed)
            )
            start = time.perf_counter()
            ref_opt.zero_grad()
            parallel.lm_loss(reference(xs), ys).backward()
            ref_opt.step()
            one_s.append(time.perf_counter() - start)
        err = parallel.relative_error(state, reference.state_dict())
        metrics.emit(
            {
                "event": "tp_train",
                "procs": n,
                "steps": args.steps,
                "layers": args.layers,
                "weights_rel_err": err,
                "step_s": step_s,
                "one_process_step_s": min(one_s),
                "comm_counts": comm_counts(debug),
                "comm_counts_separate_qkv": counts_separate,
                "activation_bytes": act_bytes,
            }
        )
        print(
            f"after {args.steps} Adam steps: weights differ from one process by {err:.1e} "
            f"(relative); step {step_s * 1e3:.1f} ms on {n} ranks vs {min(one_s) * 1e3:.1f} "
            f"ms on one; collectives of a step {comm_counts(debug)} (q, k, v each on their own: "
            f"{counts_separate})",
            flush=True,
        )
        if args.checkpoint:
            plain = parallel.build_model(args)
            plain.load_state_dict(state)
            models.save(args.checkpoint, plain, steps=args.steps, tensor_parallel=n)
            print(f"saved {args.checkpoint}", flush=True)
    labdist.shutdown()


if __name__ == "__main__":
    main()
