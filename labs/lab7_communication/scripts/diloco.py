"""DiLoCo and Streaming DiLoCo against DDP: H inner AdamW steps, then an outer Nesterov
step on the averaged pseudo-gradient.

The character transformer (Labs 4 and 6), the same initial weights and the same global
batches (each rank its share), trained

- by DDP with AdamW (the baseline: every step all-reduces every gradient, through
  ``default_hooks.allreduce_hook`` so that it is counted);
- for each H in --periods, by DiLoCo: each rank takes H AdamW steps on its own share
  from the global weights θ, then the pseudo-gradient Δ = θ − θᵢ is averaged over the
  ranks (one all-reduce) and an outer optimizer, ``torch.optim.SGD(lr=--outer-lr,
  momentum=--outer-momentum, nesterov=True)`` on a copy of θ, takes one step with
  ``.grad = mean Δ``; every rank restarts from the new θ and keeps its own AdamW state
  (as torchft does: ``torchft/local_sgd.py``, ``perform_sync`` restores the global
  weights and steps the outer optimizer, lines 447-470, and never touches the inner
  optimizer);
- with --fragments F > 1 (for each H that F divides), by Streaming DiLoCo: the parameters
  split into F fragments (contiguous in the model's order, balanced by size), one
  fragment synchronised every H/F steps, in turn, so fragment f is synchronised after
  (f + 1)·H/F of every H steps (torchft: ``_sync_every = sync_every //
  len(model_fragments)``, line 635; the fragment is the manager's step, one per
  committed sync, modulo F, lines 739-744): one sync sends one fragment, about 1/F of
  the bytes;
- and the check that DiLoCo with outer lr 1 and no momentum is local SGD: PyTorch's
  ``PostLocalSGDOptimizer(AdamW, PeriodicModelAverager(H, warmup_steps=H - 1))`` at H =
  --check-period, against DiLoCo (1, 0) — θ − 1·mean(θ − θᵢ) = mean θᵢ — and against the
  wrong answers (--outer-lr, 0) and (1, --outer-momentum).

Every ``torch.distributed`` all-reduce is counted per step (``lab_utils.traffic``).
Helper H2's comparison script (notebook 5) imports :func:`train_diloco`.

    torchrun --standalone --nproc-per-node 2 scripts/diloco.py --periods 1 8 32 --fragments 4
    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 scripts/diloco.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    model: procs, numel, param_bytes, steps, inner_lr, outer_lr, outer_momentum,
        fragments, fragment_numel (the F fragments' sizes), check_period
    run: method (ddp, diloco or local), period, fragments, outer_lr, outer_momentum,
        fragment_numel, bytes_by_step, losses, seconds, eval_loss (the final global
        weights on an unseen batch); one per training: ddp, then diloco for each period
        (fragments 1, then --fragments where it divides the period), then the check's
        local SGD at --check-period (its three DiLoCo runs emit only their agreement)
    agreement: period, outer_lr, outer_momentum, first_sync_diff (the largest weight
        difference from local SGD after H steps: one outer step), max_abs_diff (after
        --steps), max_abs_weight (one per outer setting of the check)
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from steps import batches as lab7_batches
from steps import run_steps
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, parallel, paths, profile

# H = 1 is a DiLoCo period like any other (torch warns that DDP is cheaper)
warnings.filterwarnings("ignore", message="When period is 1, no need to use model averaging")

S = paths.lab_module("lab7", "settings").DILOCO.of()  # notebook 4's sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--inner-lr", dest="lr", type=float, help="AdamW's lr (the same as --lr)")
    p.set_defaults(lr=S.inner_lr, steps=S.steps, d_model=S.d_model, layers=S.layers)
    p.add_argument("--periods", nargs="+", type=int, default=S.periods, help="DiLoCo's H")
    p.add_argument(
        "--fragments", type=int, default=S.fragments, help="Streaming DiLoCo's fragments F"
    )
    p.add_argument("--outer-lr", type=float, default=S.outer_lr, help="the outer SGD's lr")
    p.add_argument(
        "--outer-momentum", type=float, default=S.outer_momentum, help="its Nesterov momentum"
    )
    p.add_argument(
        "--check-period",
        type=int,
        default=S.check_period,
        help="H of the check outer lr 1, no momentum = local SGD (0: no check)",
    )
    args = p.parse_args(argv)
    for h in [*args.periods, args.check_period]:
        if h and (h < 1 or args.steps % h):
            p.error(f"every period must divide --steps {args.steps} (not {h})")
    if args.fragments < 1:
        p.error("--fragments must be >= 1")
    return args


def split(params: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """The parameters in ``fragments`` contiguous groups of about equal numel (none empty)."""
    if fragments > len(params):
        raise ValueError(f"{fragments} fragments of {len(params)} parameters")
    total = sum(p.numel() for p in params)
    groups: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    seen, k = 0, 0
    for i, p in enumerate(params):
        left = len(params) - i  # tensors not placed yet, this one included
        # move on once this group holds its share, or when each later group needs one
        if (
            groups[k]
            and k < fragments - 1
            and (seen >= (k + 1) * total / fragments or left == fragments - 1 - k)
        ):
            k += 1
        groups[k].append(p)
        seen += p.numel()
    return groups


def pseudo_gradient(
    before: list[torch.Tensor], after: list[torch.Tensor], world_size: int
) -> list[torch.Tensor]:
    """mean over ranks of θ_before − θ_after, in one all-reduce of the flat deltas (the
    notebook's exercise; the script keeps its own copy: scripts import no solutions)."""
    flat = torch.cat([(b - a).reshape(-1) for b, a in zip(before, after, strict=True)])
    dist.all_reduce(flat)
    flat /= world_size
    return [d.view_as(b) for d, b in zip(flat.split([b.numel() for b in before]), before)]


class DiLoCo:
    """An optimizer-like wrapper: ``step()`` is the inner step, then, every H/F steps, the
    next fragment's sync (pseudo-gradient all-reduced, outer step, restart from θ)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        period: int,
        fragments: int,
        outer_lr: float,
        outer_momentum: float,
    ) -> None:
        if period % fragments:
            raise ValueError(f"{fragments} fragments do not divide the period {period}")
        self.inner = inner
        self.local = split(list(model.parameters()), fragments)
        self.glob = [[p.detach().clone() for p in group] for group in self.local]
        # one outer optimizer per fragment: each steps only when its fragment syncs
        self.outer = [
            torch.optim.SGD(g, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
            for g in self.glob
        ]
        self.every = period // fragments
        self.steps = 0
        self.syncs = 0

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()
        self.steps += 1
        if self.steps % self.every == 0:
            self.sync(self.syncs % len(self.local))
            self.syncs += 1

    @torch.no_grad()
    def sync(self, f: int) -> None:
        delta = pseudo_gradient(self.glob[f], self.local[f], dist.get_world_size())
        for g, d in zip(self.glob[f], delta):
            g.grad = d
        self.outer[f].step()
        self.outer[f].zero_grad()
        for p, g in zip(self.local[f], self.glob[f]):
            p.copy_(g)  # the worker restarts from the new global weights

    @torch.no_grad()
    def load_global(self) -> None:
        """Put the global weights into the model (fragments synced earlier drifted since).
        This drops the inner steps taken after each fragment's last sync: with F > 1 the
        earlier fragments lose some, so a held-out loss of these weights tilts against
        Streaming DiLoCo (notebook 4 says so)."""
        for group, glob in zip(self.local, self.glob):
            for p, g in zip(group, glob):
                p.copy_(g)


def eval_loss(model: torch.nn.Module, args: argparse.Namespace, device) -> float:
    """The loss on a batch no run trains on (the batch of step --steps)."""
    data = parallel.corpus(args)
    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, args.steps, args.seed))
    with torch.no_grad():
        return float(parallel.lm_loss(model(x), y))


def fragment_numel(model: torch.nn.Module, fragments: int) -> list[int]:
    return [sum(p.numel() for p in g) for g in split(list(model.parameters()), fragments)]


def _result(model, args, device, steps: dict, **fields) -> tuple[dict, dict]:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = {**fields, **steps, "eval_loss": eval_loss(model, args, device)}
    return run, weights


def train_ddp(args: argparse.Namespace, batches: list, device) -> tuple[dict, dict]:
    """DDP with AdamW: every step all-reduces every gradient."""
    model = parallel.build_model(args).to(device)
    net = DDP(model)
    net.register_comm_hook(None, default_hooks.allreduce_hook)
    steps = run_steps(net, torch.optim.AdamW(net.parameters(), lr=args.lr), batches)
    return _result(model, args, device, steps, method="ddp", period=1, fragments=1)


def train_local(args: argparse.Namespace, batches: list, device, period: int) -> tuple[dict, dict]:
    """Local SGD with AdamW inside, PyTorch's pieces: the weights averaged every H steps."""
    model = parallel.build_model(args).to(device)
    averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
    opt = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr), averager)
    steps = run_steps(model, opt, batches)
    return _result(model, args, device, steps, method="local", period=period, fragments=1)


# Helper H2's comparison script (notebook 5) imports this function: keep its signature.
def train_diloco(
    args: argparse.Namespace,
    batches: list,
    device,
    period: int,
    fragments: int = 1,
    outer_lr: float = S.outer_lr,
    outer_momentum: float = S.outer_momentum,
) -> tuple[dict, dict]:
    """One DiLoCo run (Streaming DiLoCo with ``fragments`` > 1) from the seeded weights:
    ``run`` (method, period, fragments, outer_lr, outer_momentum, fragment_numel,
    bytes_by_step, losses, seconds, eval_loss) and the final global weights."""
    model = parallel.build_model(args).to(device)
    opt = DiLoCo(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        period,
        fragments,
        outer_lr,
        outer_momentum,
    )
    steps = run_steps(model, opt, batches)
    opt.load_global()
    return _result(
        model,
        args,
        device,
        steps,
        method="diloco",
        period=period,
        fragments=fragments,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        fragment_numel=fragment_numel(model, fragments),
    )


def max_diff(a: dict, b: dict) -> tuple[float, float]:
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return diff, max(float(w.abs().max()) for w in b.values())


def main() -> None:
    args = parse_args()
    # [1] Gloo's threads can abort or hang a rank at exit: lab_utils/gloo_exit.py says why
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    batches = lab7_batches(args, info.device)
    model = parallel.build_model(args)
    numel = sum(p.numel() for p in model.parameters())
    metrics.emit(
        {
            "event": "model",
            "procs": info.world_size,
            "numel": numel,
            "param_bytes": 4 * numel,
            "steps": args.steps,
            "inner_lr": args.lr,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "fragments": args.fragments,
            "fragment_numel": fragment_numel(model, args.fragments),
            "check_period": args.check_period,
        }
    )
    ddp, _ = train_ddp(args, batches, info.device)
    metrics.emit({"event": "run", **ddp})
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    for period in args.periods:
        for f in sorted({1, args.fragments}):
            if period % f:
                continue
            run, _ = train_diloco(args, batches, info.device, period, f, **outer)
            metrics.emit({"event": "run", **run})
            labdist.print0(
                f"DiLoCo H={period:<3d} F={f}: {sum(run['bytes_by_step']):,} bytes, peak "
                f"{max(run['bytes_by_step']):,} a step (DDP {sum(ddp['bytes_by_step']):,}); "
                f"eval loss {run['eval_loss']:.4f} (DDP {ddp['eval_loss']:.4f})"
            )
    if args.check_period:
        h = args.check_period
        local, local_weights = train_local(args, batches, info.device, h)
        metrics.emit({"event": "run", **local})
        _, local_once = train_local(args, batches[:h], info.device, h)  # one average
        # the equivalence, then the two wrong answers it must tell apart: after one outer
        # step (the same AdamW steps before it, bit for bit: only the average's rounding
        # differs) and at the end (AdamW's normalised steps amplify that rounding)
        for lr, mu in ((1.0, 0.0), (args.outer_lr, 0.0), (1.0, args.outer_momentum)):
            _, once = train_diloco(args, batches[:h], info.device, h, 1, lr, mu)
            _, weights = train_diloco(args, batches, info.device, h, 1, lr, mu)
            first, _ = max_diff(once, local_once)
            diff, scale = max_diff(weights, local_weights)
            metrics.emit(
                {
                    "event": "agreement",
                    "period": h,
                    "outer_lr": lr,
                    "outer_momentum": mu,
                    "first_sync_diff": first,
                    "max_abs_diff": diff,
                    "max_abs_weight": scale,
                }
            )
            labdist.print0(
                f"H={h} outer lr {lr:g}, momentum {mu:g}: weights differ from local SGD's "
                f"by {first:.2e} after one outer step, {diff:.2e} after {args.steps} steps "
                f"(largest weight {scale:.2f})"
            )
    labdist.shutdown()


if __name__ == "__main__":
    main()
