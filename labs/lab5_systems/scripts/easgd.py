"""Elastic averaging SGD (EASGD) against SGD with periodic model averaging.

Each process is a worker with its own weights x_i; every process also keeps a copy of
the centre variable x~ (all copies stay equal: they see the same messages). Every
``tau`` local steps the workers communicate:

- ``easgd``     (synchronous EASGD, all workers at once, one all-reduce):
                x_i <- x_i - alpha (x_i - x~)        x~ <- x~ + alpha sum_i (x_i - x~)
- ``easgd-rr``  (round-robin, EASGD's multi-GPU algorithm): at round r only worker
                r mod N meets the centre (one broadcast), the others keep training;
- ``sgd``       (periodic model averaging, "local SGD"): after every tau-th local step
                x_i <- mean_j x_j (one all-reduce). The workers start from the same
                weights, so at tau = 1 every gradient is taken at the shared weights and
                the average of the x_i - eta g_i is x - eta mean_i g_i(x): synchronous SGD.

with alpha = eta * rho = beta / N. Between rounds each worker takes plain SGD steps on
its own batches of Fashion-MNIST. EASGD's round uses x_i^t, before the local step (as
its equations say); averaging comes after it. Rank 0 evaluates the centre (``sgd``: the
average) after every round and emits ``easgd`` records: method, tau, round, local steps,
test accuracy; ``--save`` writes the last run's centre.

    torchrun --standalone --nproc-per-node 2 scripts/easgd.py --methods easgd sgd --taus 1 4 16

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    easgd: method, tau, alpha, workers, round, step, acc (after every round)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, profile, tensordata

METHODS = ("easgd", "easgd-rr", "sgd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = profile.script_parser(__doc__)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument(
        "--taus",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="communication periods (local steps between rounds)",
    )
    p.add_argument("--steps", type=int, default=400, help="local steps per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="eta")
    p.add_argument("--beta", type=float, default=0.9, help="alpha = eta*rho = beta / N")
    p.add_argument("--eval-every", type=int, default=1, help="rounds between evaluations")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--n-train", type=int, default=10000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="write the last run's centre weights here (rank 0)")
    args = p.parse_args(argv)
    if min(args.taus) < 1 or args.steps < 1:
        p.error("--taus and --steps must be >= 1")
    return args


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def load_flat(model: torch.nn.Module, vec: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(vec, model.parameters())


def communicate(
    method: str,
    x: torch.Tensor,
    center: torch.Tensor,
    alpha: float,
    rnd: int,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of communication; returns this worker's new x and the new centre."""
    if method == "sgd":
        total = x.clone()
        dist.all_reduce(total)  # sum of the workers' weights
        avg = total / world_size
        return avg, avg.clone()
    if method == "easgd":
        total = x.clone()
        dist.all_reduce(total)
        diff = x - center
        # x~ + alpha * sum_i (x_i - x~) = x~ + alpha * (sum_i x_i - N x~)
        new_center = center + alpha * (total - world_size * center)
        return x - alpha * diff, new_center
    # easgd-rr: worker k = rnd mod N alone meets the centre this round
    k = rnd % world_size
    xk = x.clone()
    dist.broadcast(xk, src=k)
    diff = xk - center
    return (x - alpha * diff if rank == k else x), center + alpha * diff


def run(
    method: str,
    tau: int,
    args: argparse.Namespace,
    data: tensordata.Tensors,
    info: labdist.DistInfo,
) -> tuple[float, torch.nn.Module]:
    """One training run; returns the last test accuracy and a model holding the centre."""
    world_size, rank, dev = info.world_size, info.rank, info.device
    torch.manual_seed(args.seed)
    model = models.build("mlp", hidden=(args.hidden,)).to(dev)
    evaluator = models.build("mlp", hidden=(args.hidden,)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    alpha = args.beta / world_size
    center = flat(model).clone()
    x, y = data.x_train.to(dev), data.y_train.to(dev)
    acc, rnd = 0.0, 0

    def meet(step: int) -> None:  # a round of communication, then (sometimes) an evaluation
        nonlocal center, acc, rnd
        rnd += 1
        new_x, center = communicate(method, flat(model), center, alpha, rnd - 1, rank, world_size)
        load_flat(model, new_x)
        if rank == 0 and (rnd % args.eval_every == 0 or step + tau > args.steps):
            load_flat(evaluator, center)
            acc = tensordata.accuracy(evaluator, data.x_test, data.y_test)
            metrics.emit(
                {
                    "event": "easgd",
                    "method": method,
                    "tau": tau,
                    "round": rnd,
                    "step": step,
                    "acc": acc,
                    "workers": world_size,
                    "alpha": alpha,
                }
            )

    for step in range(1, args.steps + 1):
        idx = tensordata.batch_indices(
            len(x), args.batch_size, seed=args.seed, worker=rank, step=step
        ).to(dev)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()  # g_i at x_i^t
        rounds_now = step % tau == 0
        if rounds_now and method != "sgd":
            meet(step)  # EASGD's elastic move uses x_i^t, as the equations say
        opt.step()  # x_i <- x_i - eta g_i (after the elastic move: together the deck's update)
        if rounds_now and method == "sgd":
            meet(step)  # averaging after the local step: at tau = 1, synchronous SGD
    load_flat(evaluator, center)
    return acc, evaluator


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # NCCL wants one GPU per rank; ranks that share a GPU (or have none) talk through Gloo.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    share = torch.cuda.is_available() and local > torch.cuda.device_count()
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(backend="gloo" if share else None, group_if_alone=True)
    data = tensordata.load(args.n_train, args.n_test, seed=args.seed)
    for method in args.methods:
        for tau in args.taus:
            acc, centre = run(method, tau, args, data, info)
            labdist.print0(
                f"{method:>8} tau={tau:<3} {args.steps // tau:>4} rounds: centre test "
                f"accuracy {acc:.3f}",
                flush=True,
            )
    if args.save and info.rank == 0:
        models.save(args.save, centre, method=method, tau=tau)
    labdist.shutdown()


if __name__ == "__main__":
    main()
