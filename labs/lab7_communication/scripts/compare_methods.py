"""Five ways to train over one link: DDP, bf16 DDP, PowerSGD DDP, local SGD and DiLoCo.

The character transformer (Labs 4 and 6), the same initial weights and the same global
batches, trained --steps steps by each of --methods in turn, at each link rate of
--rates (rank 0 changes the job's own link between rates with ``slow_link.set_rate``,
through ``steps.switch``; ``none`` is the same loopback unshaped). Each
method is the lab's own script's training function, imported, not copied:

- ``ddp``: ``compressed_ddp.train("none", optimizer="adamw")`` — DDP's all-reduce made
  from Python (``default_hooks.allreduce_hook``), AdamW (as local SGD's and DiLoCo's
  inner steps: the same optimizer, so that the losses compare communication);
- ``bf16``: DDP all-reducing in bfloat16, AdamW. Where DDP takes it (it decides by
  torch's build: asked with ``compressed_ddp.refused``), torch's own
  ``bf16_compress_hook`` (``compressed_ddp.train("bf16")``). Elsewhere DDP refuses a hook
  *of that name* (torch/nn/parallel/distributed.py lines 2485–2503 in torch 2.13: a
  deliberate guard, which this sidesteps), so :func:`bf16_allreduce_hook` calls the
  function torch's hook calls, ``default_hooks._compress_hook(torch.bfloat16, ...)``
  (default_hooks.py line 134) — a *private* torch function, with no API guarantee —
  under another name. It works here because Gloo in torch 2.13 all-reduces bfloat16
  tensors (the counts show 2 bytes an element); the reduction is Gloo's, not NCCL's;
- ``powersgd``: ``compressed_ddp.train("powersgd")`` — PyTorch's ``powerSGD_hook``
  (rank --rank, error feedback, warm start, compressing from step --start-iter; one
  bucket on Gloo, as compressed_ddp.py says why), AdamW;
- ``local``: ``diloco.train_local(period=H)`` — PyTorch's ``PostLocalSGDOptimizer``
  with a ``PeriodicModelAverager`` averaging every H = --period steps, around AdamW (not
  ``local_sgd.train``'s plain SGD: with it, the comparison would be SGD against Adam);
- ``diloco``: ``diloco.train_diloco(period=H)`` — inner AdamW for H steps, then an
  outer Nesterov step on the averaged pseudo-gradient (scripts/diloco.py).

Every ``torch.distributed`` all-reduce of every step is counted (``lab_utils.traffic``,
through ``steps.run_steps``), and every step timed. The counts do not depend on the rate.

    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 scripts/compare_methods.py --rates 50 none
    torchrun --standalone --nproc-per-node 2 scripts/compare_methods.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, backend, shaped, counted, burst_bytes, latency_ms, mtu, rates, methods,
        numel, grad_bytes, shapes, steps, batch_size, seq_len, period, rank, start_iter,
        lr
    run: rate_mbit, method, optimizer, period, bytes_by_step, losses, seconds,
        link_bytes_by_step, shapes_by_bucket, held_out_loss (one per rate and method;
        held_out_loss: the final model's loss on --eval-batches batches after the
        training ones; seconds: each
        step from the first rank's start to the last rank's end; link_bytes_by_step: the
        bytes the job's link carried in each step, None off a link of its own;
        shapes_by_bucket: DDP's buckets' gradient shapes for ddp, bf16 and powersgd,
        else None)
"""

import argparse

import torch
import torch.distributed as dist
from compressed_ddp import refused
from compressed_ddp import train as train_with_hook
from diloco import train_diloco, train_local
from steps import add_rates_arg, link_and_rates, link_event, rates_to_run, run_steps, switch
from steps import batches as lab7_batches
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, paths, profile

METHODS = ("ddp", "bf16", "powersgd", "local", "diloco")
OPTIMIZER = {
    "ddp": "AdamW",
    "bf16": "AdamW",
    "powersgd": "AdamW",
    "local": "AdamW",
    "diloco": "AdamW + outer Nesterov SGD",
}


def parse_args(argv=None) -> argparse.Namespace:
    S = paths.lab_module("lab7", "settings").COMPARE.of()
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.set_defaults(d_model=S.d_model, layers=S.layers, steps=S.steps)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    add_rates_arg(p)
    p.add_argument("--period", type=int, default=S.period, help="H of local SGD and DiLoCo")
    p.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix approximation rank")
    p.add_argument(
        "--start-iter", type=int, default=2, help="PowerSGD's first compressed step (from 0)"
    )
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        help="held-out batches the final models are scored on",
    )
    return p.parse_args(argv)


def bf16_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bfloat16 compression hook under a name DDP accepts without NCCL: the
    bucket cast to bfloat16, then divided by the ranks (default_hooks.py line 71, in
    that order), all-reduced by the backend, copied back into the float32 bucket (DDP
    checks the return annotation: exactly ``Future[Tensor]``). ``_compress_hook`` is
    private to torch: no API guarantee, it may change or go in any release."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def train_bf16_own(args: argparse.Namespace, batches: list, device) -> tuple[dict, dict]:
    """``compressed_ddp.train("bf16")`` where DDP refuses torch's hook by its name: the
    run and the final weights."""
    model = parallel.build_model(args).to(device)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    ddp.register_comm_hook(None, bf16_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)  # as the other methods
    run = run_steps(ddp, opt, batches)
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run["shapes_by_bucket"] = [[list(g.shape) for g in b.gradients()] for b in buckets]
    return run, weights


def held_out_loss(weights: dict, args: argparse.Namespace, device) -> float:
    """The loss of the final model (rank 0's copy: the averaged one for local SGD and
    DiLoCo, whose last step averages) on --eval-batches batches no method trained on."""
    model = parallel.build_model(args).to(device)
    model.load_state_dict(weights)
    data = parallel.corpus(args)
    losses = []
    with torch.no_grad():
        for i in range(args.eval_batches):
            x, y = data.batch(args.batch_size, args.seq_len, args.steps + i, args.seed)
            losses.append(float(parallel.lm_loss(model(x.to(device)), y.to(device))))
    return sum(losses) / len(losses)


def train(method: str, args: argparse.Namespace, batches: list, device) -> dict:
    """One method's run from the same weights on the same batches: its losses, and the
    all-reduce bytes and seconds of every step."""
    if method in ("ddp", "powersgd") or (method == "bf16" and refused("bf16", device) is None):
        hook = {"ddp": "none"}.get(method, method)
        run, weights = train_with_hook(hook, args, batches, device, optimizer="adamw")
    elif method == "bf16":
        run, weights = train_bf16_own(args, batches, device)
    elif method == "local":
        run, weights = train_local(args, batches, device, args.period)
    else:
        run, weights = train_diloco(args, batches, device, args.period)
    return {
        "method": method,
        "optimizer": OPTIMIZER[method],
        "period": args.period if method in ("local", "diloco") else 1,
        "bytes_by_step": run["bytes_by_step"],
        "losses": run["losses"],
        "seconds": run["seconds"],
        "link_bytes_by_step": run["link_bytes_by_step"],
        "shapes_by_bucket": run.get("shapes_by_bucket"),
        "held_out_loss": held_out_loss(weights, args, device),
    }


def main() -> None:
    args = parse_args()
    link, rates = link_and_rates(args, "compare_methods.py")
    parallel.require_batch_split(args.batch_size)
    # [1] Gloo's threads can abort or hang a rank at exit: lab_utils/gloo_exit.py says why
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    batches = lab7_batches(args, info.device)
    shapes = [list(p.shape) for p in parallel.build_model(args).parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    here = rates_to_run(rates, link)
    metrics.emit(
        {
            "event": "model",
            "procs": info.world_size,
            "backend": dist.get_backend(),
            **link_event(link, rates),
            "methods": args.methods,
            "numel": numel,
            "grad_bytes": 4 * numel,
            "shapes": shapes,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "period": args.period,
            "rank": args.rank,
            "start_iter": args.start_iter,
            "lr": args.lr,
        }
    )
    for rate in here:
        switch(rate, rates, link)
        name = "this job's link" if link is None else f"{rate:g} Mbit/s" if rate else "unshaped"
        for method in args.methods:
            run = train(method, args, batches, info.device)
            metrics.emit({"event": "run", "rate_mbit": rate, **run})
            labdist.print0(
                f"{name}: {method:8s} {sum(run['bytes_by_step']) / args.steps:12,.0f} B/step, "
                f"{sum(run['seconds']):7.2f} s in {args.steps} steps, "
                f"loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}, held out "
                f"{run['held_out_loss']:.3f}"
            )
    labdist.shutdown()


if __name__ == "__main__":
    main()
