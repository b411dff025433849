"""DDP with PyTorch's communication hooks: the bytes each step all-reduces, and the loss.

The character transformer (Labs 4 and 6) trained by ``DistributedDataParallel`` with each
--hooks in turn, from the same initial weights on the same batches:

- ``none``: DDP's own all-reduce of every bucket (``default_hooks.allreduce_hook``, the
  same all-reduce made from Python, so that it can be counted);
- ``fp16``: ``default_hooks.fp16_compress_hook`` (the bucket cast to float16, summed,
  cast back);
- ``bf16``: ``default_hooks.bf16_compress_hook`` (the same in bfloat16). DDP's
  ``register_comm_hook`` refuses a hook of that name unless torch is a CUDA (or ROCm)
  build with NCCL 2.10+, or XPU with XCCL (TypeError; torch/nn/parallel/distributed.py
  lines 2485–2503 in torch 2.13): the script skips it elsewhere and says so;
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

    torchrun --standalone --nproc-per-node 2 scripts/compressed_ddp.py --hooks none fp16 powersgd
    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 scripts/compressed_ddp.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, backend, shapes, numel, grad_bytes
    hook: hook, buckets, shapes_by_bucket, bytes_by_step, losses, step_s, rank,
        start_iter (one per hook that ran)
    skipped: hook, reason (bf16 where DDP refuses it)
"""

import argparse
import statistics

import torch
import torch.distributed as dist
from steps import batches as lab7_batches
from steps import run_steps
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


def train(hook: str, args: argparse.Namespace, batches: list, device) -> dict:
    """--steps steps of DDP with ``hook``: loss, step time and all-reduce bytes of each."""
    model = parallel.build_model(args).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb(hook, grad_bytes, args))
    register(ddp, hook, args)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    steps = run_steps(ddp, opt, batches)
    buckets = [
        [list(g.shape) for g in b.gradients()] for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]
    return {
        "hook": hook,
        "buckets": len(buckets),
        "shapes_by_bucket": buckets,
        "bytes_by_step": steps["bytes_by_step"],
        "losses": steps["losses"],
        "step_s": statistics.median(steps["seconds"][1:] or steps["seconds"]),
        "rank": args.rank,
        "start_iter": args.start_iter,
    }


def main() -> None:
    args = parse_args()
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
    for hook in args.hooks:
        if hook == "bf16" and dist.get_backend() != "nccl":
            reason = "DDP takes bf16_compress_hook only with CUDA and NCCL 2.10+ (or XPU and XCCL)"
            metrics.emit({"event": "skipped", "hook": hook, "reason": reason})
            labdist.print0(f"bf16      skipped: {reason}")
            continue
        run = train(hook, args, batches, info.device)
        metrics.emit({"event": "hook", **run})
        labdist.print0(
            f"{hook:9s} {run['buckets']} bucket(s), all-reduce bytes per step "
            f"{run['bytes_by_step'][-1]:,}, loss {run['losses'][0]:.3f} -> "
            f"{run['losses'][-1]:.3f}, step {run['step_s'] * 1e3:.1f} ms"
        )
    labdist.shutdown()


if __name__ == "__main__":
    main()
