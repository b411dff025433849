"""Profile DistributedDataParallel steps with torch.profiler: one Chrome trace per rank.

For each --bucket-cap-mb the character transformer is wrapped in DDP with that bucket
size and trained --warmup + --active steps inside ``torch.profiler.profile``; the
active steps are recorded and each rank writes ``<out>/ddp_b<cap>_rank<r>.json`` (open
it in Perfetto, https://ui.perfetto.dev, or chrome://tracing). Rank 0 reports where the
traces are; the notebook reads them with ``lab_utils.trace``.

    torchrun --standalone --nproc-per-node 2 profile_ddp.py --bucket-cap-mb 0.05 1 25
    mpirun -np 2 python profile_ddp.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    trace: procs, psi, bucket_cap_mb, buckets, active_steps, paths (one per bucket cap)
"""

import argparse
import os
import warnings
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no log line at each start and stop of a recording

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, paths
from lab_utils import profile as lab_profile

# One recording cycle per run: that its events are cleared at the cycle's end is what we want.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events")


def parse_args(argv=None) -> argparse.Namespace:
    p = lab_profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--bucket-cap-mb",
        nargs="+",
        type=float,
        default=[0.05, 25.0],
        help="DDP bucket sizes (MB) to profile, one trace per size and rank",
    )
    p.add_argument("--warmup", type=int, default=1, help="steps run before recording")
    p.add_argument("--active", type=int, default=2, help="steps recorded in the trace")
    p.add_argument("--out", default=None, help="folder of the traces (default runs/lab6/traces)")
    return p.parse_args(argv)


def activities(device: torch.device) -> list:
    """CPU operators always; the GPU's kernels (and NCCL's) where there is one."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def bucket_count(ddp: DDP) -> int:
    """How many buckets DDP made (after its first step it rebuilds them in the order
    gradients arrived); each is one all-reduce per step."""
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def profiled_run(
    args: argparse.Namespace, cap: float, device: torch.device, out: Path
) -> tuple[Path, int]:
    """Train warm-up + active DDP steps with bucket size ``cap`` MB under the profiler;
    return the path of this rank's Chrome trace and DDP's bucket count."""
    model = parallel.build_model(args).to(device)
    ddp = DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap
    )
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    data = parallel.corpus(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    steps = args.warmup + args.active
    path = out / f"ddp_b{cap:g}_rank{rank}.json"
    with profile(
        activities=activities(device),
        schedule=schedule(wait=0, warmup=args.warmup, active=args.active),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for step in range(steps):
            x, y = (
                t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed)
            )
            opt.zero_grad()
            parallel.lm_loss(ddp(x[mine]), y[mine]).backward()
            opt.step()
            prof.step()
    return path, bucket_count(ddp)


def main() -> None:
    args = parse_args()
    world_size = parallel.require_batch_split(args.batch_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    out = Path(args.out) if args.out else paths.runs_dir("lab6") / "traces"
    out.mkdir(parents=True, exist_ok=True)
    psi = None
    for cap in args.bucket_cap_mb:
        path, buckets = profiled_run(args, cap, info.device, out)
        psi = psi or sum(q.numel() for q in parallel.build_model(args).parameters())
        dist.barrier()
        metrics.emit(
            {
                "event": "trace",
                "bucket_cap_mb": cap,
                "procs": world_size,
                "psi": psi,
                "active_steps": args.active,
                "buckets": buckets,
                "paths": [str(out / f"ddp_b{cap:g}_rank{r}.json") for r in range(world_size)],
            }
        )
        labdist.print0(
            f"bucket_cap_mb {cap:g}: {buckets} buckets; traces "
            f"{path.name.replace('rank0', 'rank*')} in {out}"
        )
    labdist.shutdown()


if __name__ == "__main__":
    main()
