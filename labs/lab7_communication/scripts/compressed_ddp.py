"""DDP with PyTorch's communication hooks: the bytes each step all-reduces, and the loss.

The character transformer (Labs 4 and 6) trained by ``DistributedDataParallel`` with each
--hooks in turn, from the same initial weights on the same batches:

- ``none``: DDP's own all-reduce of every bucket (``default_hooks.allreduce_hook``, the
  same all-reduce made from Python, so that it can be counted);
- ``fp16``: ``default_hooks.fp16_compress_hook`` (the bucket cast to float16, summed,
  cast back);
- ``bf16``: ``default_hooks.bf16_compress_hook`` (the same in bfloat16). DDP's
  ``register_comm_hook`` refuses a hook of that name unless torch is a CUDA (or ROCm)
  BUILD with NCCL 2.10+, or XPU with XCCL — it looks at the build, not at the group's
  backend (TypeError; torch/nn/parallel/distributed.py lines 2485–2503 in torch 2.13):
  the script tries to register it and, where DDP raises that TypeError, skips it and
  reports torch's own message;
- ``powersgd``: ``powerSGD_hook.powerSGD_hook`` with ``PowerSGDState(rank=--rank,
  error feedback, warm start, start_powerSGD_iter=--start-iter)``.

Every ``torch.distributed`` all-reduce a step issues is counted (``lab_utils.traffic``
wraps the functions, so the all-reduces PowerSGD issues from Gloo's callback threads are
seen too, which ``CommDebugMode`` does not). On Gloo, PowerSGD is given ONE bucket: its
callbacks wait for an all-reduce on the thread that runs them (``powerSGD_hook.py`` lines
584–589 and 606–611 in torch 2.13), which on Gloo is one of the group's two worker
threads; with two buckets both threads can end up waiting so, and the job hangs (a race;
seen here in 7 runs at the first compressed step, never with one bucket). The script
gives DDP a bucket cap above the gradients' size for PowerSGD on Gloo, and says so.

Inside a slow link (``lab_utils.slow_link``), --rates runs every hook at each rate in
turn (rank 0 changes the job's own link between them: ``steps.switch``), and each step's
bytes on the link are counted too (the qdisc's counter). What a hook all-reduces does not
depend on the rate; its time does. Each step's time is the span from the first rank's
start to the last rank's end.

    torchrun --standalone --nproc-per-node 2 scripts/compressed_ddp.py --hooks none fp16 powersgd
    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 scripts/compressed_ddp.py --rates none 50

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, backend, shapes, numel, grad_bytes
    link: shaped, counted, burst_bytes, latency_ms, mtu, rates
    hook: rate, hook, buckets, shapes_by_bucket, bytes_by_step, link_bytes_by_step,
        losses, seconds, step_s (the median of steps 2 on), rank, start_iter (one per
        hook that ran, at each rate)
    skipped: hook, reason (bf16 where DDP refuses it: torch's TypeError message)
"""

import argparse
import statistics

import torch
import torch.distributed as dist
from steps import add_rates_arg, link_and_rates, link_event, rates_to_run, run_steps, switch
from steps import batches as lab7_batches
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, profile

HOOKS = ("none", "fp16", "bf16", "powersgd")


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--hooks", nargs="+", choices=HOOKS, default=["none", "fp16", "powersgd"])
    p.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix approximation rank")
    p.add_argument(
        "--start-iter", type=int, default=2, help="PowerSGD's first compressed step (from 0)"
    )
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap")
    add_rates_arg(p)
    return p.parse_args(argv)


def register(ddp: DDP, hook: str, args: argparse.Namespace) -> None:
    """Put ``hook`` on ``ddp`` (the process group: None, the whole job)."""
    if hook == "none":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.start_iter,
            use_error_feedback=True,
            warm_start=True,
            random_seed=args.seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def refused(hook: str, device) -> str | None:
    """torch's own message where DDP's ``register_comm_hook`` refuses ``hook`` (it
    decides by torch's build, distributed.py lines 2485–2503), else None. Every rank
    builds the same one-weight DDP (its construction is a collective) and tries."""
    probe = DDP(torch.nn.Linear(1, 1).to(device))
    try:
        register(probe, hook, argparse.Namespace(rank=1, start_iter=0, seed=0))
    except TypeError as e:
        return str(e)
    return None


def bucket_cap_mb(hook: str, grad_bytes: int, args: argparse.Namespace) -> float:
    """--bucket-cap-mb, raised above the gradients' size for PowerSGD on Gloo (one
    bucket: see the docstring). An explicit cap is also DDP's first bucket's cap."""
    if hook == "powersgd" and dist.get_backend() == "gloo":
        one_bucket = 2 * grad_bytes / 2**20
        if args.bucket_cap_mb < one_bucket:
            labdist.print0(
                f"powersgd on Gloo: bucket_cap_mb {args.bucket_cap_mb:g} -> {one_bucket:.2f} "
                "(one bucket: with two, Gloo's two worker threads both wait in the hook)"
            )
            return one_bucket
    return args.bucket_cap_mb


def train(
    hook: str, args: argparse.Namespace, batches: list, device, optimizer: str = "adam"
) -> tuple[dict, dict]:
    """--steps steps of DDP with ``hook`` on ``batches`` from the seeded initial weights:
    the run (loss, seconds, all-reduce bytes and link bytes of each step; the buckets) and
    the final weights (the bare model's ``state_dict``, cloned). ``optimizer``: ``"adam"``
    (this notebook's) or ``"adamw"`` (notebook 5's, as its local SGD and DiLoCo use)."""
    model = parallel.build_model(args).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb(hook, grad_bytes, args))
    register(ddp, hook, args)
    opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer](
        ddp.parameters(), lr=args.lr
    )
    steps = run_steps(ddp, opt, batches)
    buckets = [
        [list(g.shape) for g in b.gradients()] for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = {
        "hook": hook,
        "buckets": len(buckets),
        "shapes_by_bucket": buckets,
        **steps,
        # the first step builds DDP's buckets: the median of the others
        "step_s": statistics.median(steps["seconds"][1:] or steps["seconds"]),
        "rank": args.rank,
        "start_iter": args.start_iter,
    }
    return run, weights


def main() -> None:
    args = parse_args()
    link, rates = link_and_rates(args, "compressed_ddp.py")
    # [1] Gloo's threads can abort or hang a rank at exit: lab_utils/gloo_exit.py says why
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    batches = lab7_batches(args, info.device)
    shapes = [list(p.shape) for p in parallel.build_model(args).parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    metrics.emit(
        {
            "event": "model",
            "procs": info.world_size,
            "backend": dist.get_backend(),
            "shapes": shapes,
            "numel": numel,
            "grad_bytes": 4 * numel,
        }
    )
    metrics.emit({"event": "link", **link_event(link, rates)})
    hooks = list(args.hooks)
    reason = refused("bf16", info.device) if "bf16" in hooks else None
    if reason is not None:
        metrics.emit({"event": "skipped", "hook": "bf16", "reason": reason})
        labdist.print0(f"bf16      skipped: {reason}")
        hooks.remove("bf16")
    for rate in rates_to_run(rates, link):
        here = switch(rate, rates, link)
        if here is not None:
            labdist.print0(f"link: {here.label}")
        for hook in hooks:
            run, _ = train(hook, args, batches, info.device)
            metrics.emit({"event": "hook", "rate": rate, **run})
            labdist.print0(
                f"{hook:9s} {run['buckets']} bucket(s), all-reduce bytes per step "
                f"{run['bytes_by_step'][-1]:,}, loss {run['losses'][0]:.3f} -> "
                f"{run['losses'][-1]:.3f}, median step (2 on) {run['step_s'] * 1e3:.1f} ms"
            )
    labdist.shutdown()


if __name__ == "__main__":
    main()
