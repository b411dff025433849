"""Interleaved and zero-bubble pipeline schedules, timed block by block, against 1F1B.

Each rank holds v stages of the character transformer (interleaved: stages r, r+p, ...;
the V schedules: stages r and 2p−1−r). For every schedule and micro-batch count m it
times real steps (the schedules interleaved, round after round, in alternating order),
records every F (forward), B (backward for the inputs, or the whole backward) and W
(backward for the weights) block of every stage, measures the bubble, replays the
schedule's own order from the run's block times, counts activations in flight, and
compares the gradients with the unsplit model; then it trains --steps steps with the
last schedule and saves the whole model (rank 0).

    torchrun --standalone --nproc-per-node 2 pipeline_schedules.py --schedules 1f1b interleaved zbv

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    schedule: schedule, stages, virtual, microbatches, order, step_s, samples, bubble,
        every_step_bubble, replay_bubble, replay_noise, formula_ratio, plan_ratio,
        stage_ratio, in_flight, peak_held, events, grad_rel_err (one per schedule and
        micro-batch count)
"""

import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, parallel, profile, timeline

# name: (schedule class, stages per rank (None: --virtual), V-shaped placement)
SCHEDULES = {
    "1f1b": (Schedule1F1B, 1, False),
    "looped_bfs": (ScheduleLoopedBFS, None, False),
    "interleaved": (ScheduleInterleaved1F1B, None, False),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, None, False),
    "zbv": (ScheduleZBVZeroBubble, 2, True),
    "dualpipev": (ScheduleDualPipeV, 2, True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument(
        "--schedules",
        nargs="+",
        choices=sorted(SCHEDULES),
        default=["1f1b", "interleaved", "interleaved_zb", "zbv"],
        help="schedules to compare (1f1b is the baseline)",
    )
    p.add_argument(
        "--virtual",
        type=int,
        default=2,
        help="stages per rank v of the interleaved schedules (the V schedules use 2)",
    )
    p.add_argument(
        "--microbatches",
        nargs="+",
        type=int,
        default=[4, 8],
        help="micro-batch counts m (multiples of the process count that divide --batch-size)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed steps per schedule and m after a warm-up; the bubble check "
        "takes the least disturbed of them",
    )
    return p.parse_args(argv)


def virtual_stages(name: str, args: argparse.Namespace) -> int:
    """Stages per rank of the schedule ``name``."""
    return SCHEDULES[name][1] or args.virtual


def stage_ids(name: str, rank: int, world_size: int, v: int) -> list[int]:
    """The stages rank ``rank`` holds, with p = world_size: looped r, r+p, …; V-shaped r
    and 2p−1−r."""
    if SCHEDULES[name][2]:
        return [rank, 2 * world_size - 1 - rank]
    return [rank + i * world_size for i in range(v)]


def formula_ratio(name: str, world_size: int, m: int, v: int) -> float | None:
    """Idle time / compute time of the schedule's plan with F, B and W blocks of equal
    length and free messages, on a step that starts and ends together on all p =
    world_size ranks: 1F1B (p−1)/m; interleaved 1F1B (p−1)/(v·m); torch's interleaved
    zero bubble (the paper's ZB1P, W filling the cool-down), ZB-V and DualPipeV (its
    overlapped F and B pairs run one after the other, as on a CPU) all (p−1)/(3·v·m),
    the V schedules once m ≥ 2p. None where the plan has no such closed form (looped
    BFS, ZB-V with m < 2p). ``tests/test_lab4_schedules.py`` checks each against torch's
    own plan (:func:`lab_utils.timeline.plan_ratio`)."""
    p = world_size
    if name == "1f1b":
        return (p - 1) / m
    if name == "interleaved":
        return (p - 1) / (v * m)
    if name == "interleaved_zb" or (name in ("zbv", "dualpipev") and m >= 2 * p):
        return (p - 1) / (3 * v * m)
    return None


class Runner:
    """One schedule on this rank's stages, with the timer of its blocks."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        rank: int,
        world_size: int,
        m: int,
        args: argparse.Namespace,
        device: torch.device,
    ) -> None:
        self.name, self.m = name, m
        self.v = virtual_stages(name, args)
        n_stages = world_size * self.v
        self.ids = stage_ids(name, rank, world_size, self.v)
        layer_ids = [i for s in self.ids for i in model.stage_layers(s, n_stages)]
        self.prefixes = tuple(f"layers.{i}." for i in layer_ids)
        stages = [
            PipelineStage(
                nn.Sequential(*[model.layers[i] for i in model.stage_layers(s, n_stages)]),
                s,
                n_stages,
                device,
            )
            for s in self.ids
        ]
        self.timer = timeline.StageTimer(stages, rank)
        cls = SCHEDULES[name][0]
        self.schedule = cls(
            stages[0] if self.v == 1 else stages, n_microbatches=m, loss_fn=parallel.lm_loss
        )
        self.first, self.last = 0 in self.ids, n_stages - 1 in self.ids

    def step(self, x: torch.Tensor, y: torch.Tensor, losses: list | None = None) -> None:
        args = [x] if self.first else []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)


def make_runner(
    name: str,
    model: nn.Module,
    rank: int,
    world_size: int,
    m: int,
    args: argparse.Namespace,
    device: torch.device,
) -> Runner | None:
    """The schedule on this rank, or None (said once) when it rejects this world_size and
    m: every rank decides the same from the same arguments (DualPipeV wants m ≥ 2p, with
    p = world_size)."""
    try:
        return Runner(name, model, rank, world_size, m, args, device)
    except ValueError as exc:
        labdist.print0(f"{name} m={m}: skipped, {exc}")
        return None


def main() -> None:
    args = parse_args()
    world_size = labdist.detect().world_size
    parallel.require(
        world_size >= 2, "a pipeline needs at least 2 processes (torchrun --nproc-per-node 2)"
    )
    most = max(world_size * virtual_stages(n, args) for n in args.schedules)
    parallel.require(
        most <= args.layers,
        f"{world_size} processes × {most // world_size} stages each need at least "
        f"{most} transformer blocks: pass --layers {most} or use fewer processes",
    )
    bad = [m for m in args.microbatches if m < world_size or m % world_size or args.batch_size % m]
    parallel.require(
        not bad,
        f"micro-batch counts {bad} do not fit: each m must be a multiple of "
        f"the {world_size} processes and divide --batch-size {args.batch_size}",
    )
    parallel.require(args.repeats >= 1, "--repeats must be at least 1")
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    rank, device = info.rank, info.device

    model = parallel.build_model(args).to(device)
    reference = copy.deepcopy(model) if rank == 0 else None
    data = parallel.corpus(args)
    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed))
    ref_grads = None
    if rank == 0:  # the unsplit model on the whole batch
        parallel.lm_loss(reference(x), y).backward()
        ref_grads = {n: q.grad.clone() for n, q in reference.named_parameters()}

    for m in args.microbatches:
        runners = [
            r
            for n in args.schedules
            if (r := make_runner(n, model, rank, world_size, m, args, device))
        ]
        for r in runners:  # warm-up: also infers the shapes sent between stages
            model.zero_grad()
            r.step(x, y)
        samples: dict[str, list] = {r.name: [] for r in runners}
        for rnd in range(args.repeats):  # the schedules interleaved, alternating order
            for r in runners if rnd % 2 == 0 else runners[::-1]:
                model.zero_grad()
                samples[r.name].append(timed_step(r, x, y, world_size))
        for r in runners:  # gradients of one more step of each, against the unsplit model
            model.zero_grad()
            r.step(x, y)
            owned = {n: q.grad for n, q in model.named_parameters() if n.startswith(r.prefixes)}
            grads = parallel.gather_on_rank0(owned)
            if rank == 0:
                report(r, world_size, samples[r.name], parallel.relative_error(grads, ref_grads))

    train(args, model, rank, world_size, device, data)
    labdist.shutdown()


def timed_step(
    r: Runner, x: torch.Tensor, y: torch.Tensor, world_size: int
) -> tuple[float, list[dict]]:
    """One step of a schedule on all ranks: its wall-clock seconds (mean over ranks) and
    every rank's blocks."""
    r.timer.reset()
    dist.barrier()
    start = time.perf_counter()
    r.step(x, y)
    step_s = time.perf_counter() - start
    events = [e.as_dict() for e in r.timer.events]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, events)
    return labdist.average(step_s), [e for ev in gathered for e in ev]


def report(
    r: Runner, world_size: int, samples: list[tuple[float, list[dict]]], grad_err: float
) -> None:
    """Rank 0: emit and print one (schedule, m): time, measured and replayed bubble."""
    order = timeline.schedule_actions(r.schedule)
    every = []
    for _, ev in samples:
        rep = timeline.replay(ev, order)
        every.append([timeline.bubble_fraction(ev), rep.bubble, timeline.replay_noise(ev, rep)])
    step_s, events = min(samples, key=lambda s: s[0])
    rep = timeline.replay(events, order)
    bubble = timeline.bubble_fraction(events)
    flight = timeline.in_flight(events)
    ratio = formula_ratio(r.name, world_size, r.m, r.v)
    plan = {k: [tuple(a) for a in v] for k, v in order.items()}
    metrics.emit(
        {
            "event": "schedule",
            "schedule": r.name,
            "stages": world_size,
            "virtual": r.v,
            "microbatches": r.m,
            "step_s": step_s,
            "samples": [s[0] for s in samples],
            "bubble": bubble,
            "replay_bubble": rep.bubble,
            "replay_noise": timeline.replay_noise(events, rep),
            "every_step_bubble": every,
            "formula_ratio": ratio,
            "plan_ratio": timeline.plan_ratio(plan),
            "stage_ratio": timeline.stage_ratio(plan),
            "peak_held": timeline.peak_held(plan, r.v),
            "grad_rel_err": grad_err,
            "order": {str(k): v for k, v in order.items()},
            "in_flight": {str(k): v for k, v in flight.items()},
            "events": events,
        }
    )
    formula = f"{ratio / (1 + ratio):.2f}" if ratio is not None else "  - "
    print(
        f"{r.name:14s} v={r.v} m={r.m}: step {step_s * 1e3:7.1f} ms, bubble {bubble:.2f} "
        f"measured, {rep.bubble:.2f} replayed, {formula} formula; grad error {grad_err:.1e}; "
        f"peak in flight per rank {[flight[k][0] for k in sorted(flight)]}",
        flush=True,
    )


def train(
    args: argparse.Namespace,
    model: nn.Module,
    rank: int,
    world_size: int,
    device: torch.device,
    data,
) -> None:
    """--steps steps of the last schedule (1F1B if it rejects the last m) with Adam on this
    rank's stages; rank 0 saves the whole model."""
    m = args.microbatches[-1]
    r = make_runner(args.schedules[-1], model, rank, world_size, m, args, device) or Runner(
        "1f1b", model, rank, world_size, m, args, device
    )
    owned = [q for n, q in model.named_parameters() if n.startswith(r.prefixes)]
    optimizer = torch.optim.Adam(owned, lr=args.lr)
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        optimizer.zero_grad()
        losses: list = []
        r.step(x, y, losses)
        if r.last:
            print(f"step {step}: loss {torch.stack(losses).mean():.3f}", flush=True)
        optimizer.step()
    state = parallel.gather_on_rank0(
        {n: t for n, t in model.state_dict().items() if n.startswith(r.prefixes)}
    )
    if rank == 0 and args.checkpoint:
        model.load_state_dict(state)
        models.save(args.checkpoint, model, steps=args.steps, stages=world_size, schedule=r.name)
        print(f"saved {args.checkpoint}", flush=True)


if __name__ == "__main__":
    main()
