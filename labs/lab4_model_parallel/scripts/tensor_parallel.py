"""Megatron-style tensor parallelism of a character transformer: by hand, then with DTensor.

1. One MLP block split by hand: rank r holds a block of fc1's output columns and the
   matching rows of fc2; one all-reduce forward, one backward. Compared with the
   unsplit block (outputs and gradients) and with parallelize_module.
2. The whole transformer split with parallelize_module (q, k, v and fc1 by columns,
   i.e. attention by heads; proj and fc2 by rows), trained --steps steps and compared
   with one process training the unsplit model; the whole model is saved (rank 0).

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py
"""

import argparse
import copy
import time

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from lab_utils import dist, metrics, models, parallel

SENT = {"forward": 0, "backward": 0}  # bytes all-reduced by the hand-written split


class CopyToRanks(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the input's gradient
    (each rank's columns contributed a part of it)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        grad = grad.contiguous()
        SENT["backward"] += grad.numel() * grad.element_size()
        tdist.all_reduce(grad)
        return grad


class SumOverRanks(torch.autograd.Function):
    """Megatron's g: forward all-reduces the partial outputs; identity backward."""

    @staticmethod
    def forward(ctx, partial):  # noqa: ANN001
        partial = partial.contiguous()
        SENT["forward"] += partial.numel() * partial.element_size()
        tdist.all_reduce(partial)
        return partial

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return grad


def mlp_by_hand(x, fc1, fc2, rank: int, n: int):  # noqa: ANN001, ANN201
    """gelu(x W1ᵀ + b1) W2ᵀ + b2 with this rank's slice of fc1's rows and fc2's columns."""
    cols = fc1.weight.shape[0] // n
    part = slice(rank * cols, (rank + 1) * cols)
    x = CopyToRanks.apply(x)
    partial = F.gelu(x @ fc1.weight[part].T + fc1.bias[part]) @ fc2.weight[:, part].T
    return SumOverRanks.apply(partial) + fc2.bias


def tp_plan(n_layers: int) -> dict:
    """Attention by heads (q, k, v by columns, proj by rows); MLP column then row."""
    plan = {}
    for i in range(1, n_layers + 1):  # layers[0] is the embedding
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.fc2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallel.add_model_args(p)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    n = dist.detect().world_size
    parallel.require(args.heads % n == 0, f"{n} processes cannot split {args.heads} attention heads "
                     f"evenly: use a process count that divides --heads {args.heads}")
    info = dist.init(group_if_alone=True)
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
                tdist.all_reduce(g)
    err_hand = max(parallel.relative_error({"out": out_hand}, {"out": out_ref}),
                   parallel.relative_error(grads_hand, grads_ref))

    mesh = init_device_mesh(device.type, (n,))
    lib = parallelize_module(copy.deepcopy(block.mlp), mesh,
                             {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    h.grad = None
    with CommDebugMode() as comm:
        out_lib = lib(h)
        out_lib.square().mean().backward()
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    grads_lib = {"x": h.grad.clone(), **{k: full(q.grad) for k, q in lib.named_parameters()}}
    err_lib = max(parallel.relative_error({"out": out_lib}, {"out": out_ref}),
                  parallel.relative_error(grads_lib, grads_ref))
    act_bytes = out_ref.numel() * out_ref.element_size()
    metrics.emit({"event": "mlp_block", "procs": n, "err_hand": err_hand, "err_dtensor": err_lib,
                  "hand_bytes": dict(SENT), "dtensor_comm_counts": counts,
                  "activation_bytes": act_bytes})
    dist.print0(f"MLP block on {n} ranks: by hand error {err_hand:.1e}, parallelize_module "
                f"error {err_lib:.1e}; all-reduced by hand {SENT}; DTensor collectives {counts}")

    # -- 2. the whole transformer, tensor-parallel, trained against one process
    reference = copy.deepcopy(model) if rank == 0 else None
    tp = parallelize_module(model, mesh, tp_plan(args.layers))
    # foreach=False: the model mixes DTensors (split layers) and plain tensors, and the
    # fused multi-tensor kernels used on GPUs refuse such a mix.
    opt = torch.optim.Adam(tp.parameters(), lr=args.lr, foreach=False)
    tp_s = []
    for step in range(args.steps):
        xs, ys = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        start = time.perf_counter()
        opt.zero_grad()
        loss = parallel.lm_loss(tp(xs), ys)
        loss.backward()
        opt.step()
        tp_s.append(time.perf_counter() - start)
        dist.print0(f"step {step}: loss {loss.item():.3f}")
    state = {k: full(v) for k, v in tp.state_dict().items()}  # every rank joins the gathers
    step_s = dist.average(min(tp_s)) if n > 1 else min(tp_s)
    if rank == 0:
        ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
        one_s = []
        for step in range(args.steps):
            xs, ys = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
            start = time.perf_counter()
            ref_opt.zero_grad()
            parallel.lm_loss(reference(xs), ys).backward()
            ref_opt.step()
            one_s.append(time.perf_counter() - start)
        err = parallel.relative_error(state, reference.state_dict())
        metrics.emit({"event": "tp_train", "procs": n, "steps": args.steps, "weights_rel_err": err,
                      "step_s": step_s, "one_process_step_s": min(one_s)})
        print(f"after {args.steps} Adam steps: weights differ from one process by {err:.1e} "
              f"(relative); step {step_s * 1e3:.1f} ms on {n} ranks vs {min(one_s) * 1e3:.1f} ms on one",
              flush=True)
        if args.checkpoint:
            plain = parallel.build_model(args)
            plain.load_state_dict(state)
            models.save(args.checkpoint, plain, steps=args.steps, tensor_parallel=n)
            print(f"saved {args.checkpoint}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
