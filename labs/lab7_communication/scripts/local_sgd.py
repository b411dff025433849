"""Local SGD against DDP: each rank takes H steps on its own, then the models are averaged.

The character transformer (Labs 4 and 6), plain SGD (no momentum), the same initial
weights and the same global batches, trained

- by DDP (every step all-reduces the gradients: DDP's all-reduce made from Python,
  ``default_hooks.allreduce_hook``, so that it can be counted), and
- for each H in --periods, by local SGD with PyTorch's own pieces:
  ``PostLocalSGDOptimizer(SGD, PeriodicModelAverager(period=H, warmup_steps=H - 1))``
  on the bare model. The averager counts its calls from 0 and averages when
  ``step >= warmup_steps and (step - warmup_steps) % period == 0``
  (torch/distributed/algorithms/model_averaging/averagers.py lines 121–128 in torch
  2.13): with ``warmup_steps=0`` it would average after steps 1, H + 1, 2H + 1 …, so
  "every H steps" needs ``warmup_steps=H - 1``. (The averager's docstring, lines 76–77,
  means ``warmup_steps`` to equal ``start_localSGD_iter`` of DDP's
  ``post_localSGD_hook``: the DDP steps before post-local SGD starts, not an offset of
  the period; here there is no DDP phase, so it only sets where the averages fall.)

Every ``torch.distributed`` all-reduce is counted per step (``lab_utils.traffic``). With
H = 1 and plain SGD, local SGD is DDP: averaging θ − lr·gᵢ over the ranks is θ − lr·mean(gᵢ).

Inside a slow link (``lab_utils.slow_link``), --rates runs every method at each rate in
turn (rank 0 changes the job's own link between them: ``steps.switch``), and each step's
bytes on the link are counted too (the qdisc's counter). What a method all-reduces does
not depend on the rate; its time does. Each step's time is the span from the first
rank's start to the last rank's end.

    torchrun --standalone --nproc-per-node 2 scripts/local_sgd.py --periods 1 4 16
    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 scripts/local_sgd.py --rates none 50

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, numel, param_bytes, steps, lr, tokens_per_step
    link: shaped, counted, burst_bytes, latency_ms, mtu, rates
    run: rate, method, period, bytes_by_step, link_bytes_by_step, losses, seconds (one
        per method at each rate: ddp, then local for each period)
    agreement: rate, period, max_abs_diff, max_abs_weight (the final weights of local
        SGD against DDP's, for each period at each rate)
"""

import argparse
import warnings

import torch
from steps import add_rates_arg, link_and_rates, link_event, rates_to_run, run_steps, switch
from steps import batches as lab7_batches
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, profile

# H = 1 on purpose: it is the check that local SGD is DDP (torch warns that DDP is cheaper)
warnings.filterwarnings("ignore", message="When period is 1, no need to use model averaging")


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.set_defaults(lr=0.5)  # plain SGD: a larger step than Adam's default
    p.add_argument("--periods", nargs="+", type=int, default=[1, 4], help="the H of local SGD")
    add_rates_arg(p)
    return p.parse_args(argv)


def train(method: str, period: int, args, batches: list, device) -> tuple[dict, dict]:
    """One run: losses, all-reduce bytes and seconds of each step, and the final weights."""
    model = parallel.build_model(args).to(device)
    if method == "ddp":
        net = DDP(model)
        net.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    else:
        net = model
        averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr), averager)
    steps = run_steps(net, opt, batches)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = {
        "method": method,
        "period": period,
        **steps,
    }
    return run, weights


def main() -> None:
    args = parse_args()
    link, rates = link_and_rates(args, "local_sgd.py")
    # [1] Gloo's threads can abort or hang a rank at exit: lab_utils/gloo_exit.py says why
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    batches = lab7_batches(args, info.device)
    numel = sum(p.numel() for p in parallel.build_model(args).parameters())
    metrics.emit(
        {
            "event": "model",
            "procs": info.world_size,
            "numel": numel,
            "param_bytes": 4 * numel,
            "steps": args.steps,
            "lr": args.lr,
            "tokens_per_step": args.batch_size * args.seq_len,
        }
    )
    metrics.emit({"event": "link", **link_event(link, rates)})
    for rate in rates_to_run(rates, link):
        here = switch(rate, rates, link)
        if here is not None:
            labdist.print0(f"link: {here.label}")
        ddp_run, ddp_weights = train("ddp", 1, args, batches, info.device)
        metrics.emit({"event": "run", "rate": rate, **ddp_run})
        for period in args.periods:
            run, weights = train("local", period, args, batches, info.device)
            metrics.emit({"event": "run", "rate": rate, **run})
            diff = max(float((weights[k] - ddp_weights[k]).abs().max()) for k in weights)
            scale = max(float(w.abs().max()) for w in ddp_weights.values())
            metrics.emit(
                {
                    "event": "agreement",
                    "rate": rate,
                    "period": period,
                    "max_abs_diff": diff,
                    "max_abs_weight": scale,
                }
            )
            labdist.print0(
                f"local H={period:<3d} bytes {sum(run['bytes_by_step']):,} in {args.steps} "
                f"steps (DDP {sum(ddp_run['bytes_by_step']):,}); loss {run['losses'][-1]:.4f} "
                f"(DDP {ddp_run['losses'][-1]:.4f}); weights differ from DDP's by {diff:.2e}; "
                f"{sum(run['seconds']):.2f} s (DDP {sum(ddp_run['seconds']):.2f} s)"
            )
    labdist.shutdown()


if __name__ == "__main__":
    main()
