"""Pipeline-parallel training of a character transformer with torch.distributed.pipelining.

Each rank holds one stage (a contiguous slice of the layers). For every schedule
(GPipe, 1F1B) and micro-batch count m it times real steps, interleaved with one
process running the whole model on the same batch (A B B A ...), records a per-rank
F/B timeline, measures the bubble, replays the schedule from the run's own block
durations and overheads, and compares the gradients with the unsplit model; then it
trains --steps steps and saves the whole model (rank 0).

    torchrun --standalone --nproc-per-node 2 pipeline.py --schedules gpipe 1f1b --microbatches 1 2 4 8

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    serial: step_s, batch (the whole model on one process)
    pipeline: schedule, stages, microbatches, step_s, bubble, ideal_bubble,
        every_step_bubble, replay_bubble, replay_noise, in_flight, events, grad_rel_err,
        pipe_samples, pipe_cpu_samples, serial_samples, serial_cpu_samples (one per
        schedule and micro-batch count)
"""

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, parallel, profile, text, timeline

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["gpipe", "1f1b"])
    p.add_argument(
        "--microbatches",
        nargs="+",
        type=int,
        default=[1, 2, 4, 8],
        help="micro-batch counts m to measure (each must divide --batch-size)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed (one process, pipeline) pairs "
        "per (schedule, m) after a warm-up, in the order A B B A ...; the timeline "
        "shown is that of the shortest pipeline step",
    )
    p.add_argument(
        "--crash-stage",
        type=int,
        default=-1,
        help="make this stage raise during its first timed step (a failure drill)",
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Stop with a message, before any process group, on a split that cannot work."""
    parallel.require(
        world_size <= args.layers,
        f"{world_size} processes cannot each hold a stage of a {args.layers}-layer model: "
        f"use at most {args.layers} processes or more --layers",
    )
    bad = [m for m in args.microbatches if m < 1 or args.batch_size % m]
    parallel.require(
        not bad, f"--batch-size {args.batch_size} cannot be cut into {bad} micro-batches"
    )
    parallel.require(
        args.repeats >= 1,
        "--repeats must be at least 1 (the first step of a "
        "schedule also infers shapes, so it is never the one measured)",
    )


def interleaved(repeats: int) -> list[str]:
    """A B B A A B ...: one process (A) and the pipeline (B) equally often early and late,
    so a machine that gets busier or quieter during the run favours neither."""
    return [
        k
        for r in range(repeats)
        for k in (("serial", "pipe") if r % 2 == 0 else ("pipe", "serial"))
    ]


@dataclass
class Layers:
    """This rank's contiguous slice of the model, wrapped to record its F/B blocks."""

    module: timeline.TimedStage
    prefixes: tuple[str, ...]  # names of its parameters start with one of these
    owned: dict[str, nn.Parameter]
    rank: int
    world_size: int
    device: torch.device

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1


def split_model(model: models.CharTransformer, info: labdist.DistInfo) -> Layers:
    """Cut the model into one stage per rank and keep this rank's layers."""
    ids = model.stage_layers(info.rank, info.world_size)
    prefixes = tuple(f"layers.{i}." for i in ids)
    owned = {n: q for n, q in model.named_parameters() if n.startswith(prefixes)}
    module = timeline.TimedStage([model.layers[i] for i in ids], info.rank)
    return Layers(module, prefixes, owned, info.rank, info.world_size, info.device)


def build_stage(layers: Layers) -> PipelineStage:
    """This rank's stage of the pipeline: its layers, and where the others are."""
    return PipelineStage(layers.module, layers.rank, layers.world_size, layers.device)


def make_schedule(name: str, stage: PipelineStage, m: int) -> PipelineScheduleSingle:
    """The schedule that runs m micro-batches through the stages and sums their loss."""
    return SCHEDULES[name](stage, n_microbatches=m, loss_fn=parallel.lm_loss)


def run_step(
    schedule: PipelineScheduleSingle, layers: Layers, x: torch.Tensor, y: torch.Tensor, **kw
) -> None:
    """One schedule step: the first stage feeds the inputs, the last one the targets."""
    inputs = [x] if layers.first else []
    if layers.last:
        kw["target"] = y
    schedule.step(*inputs, **kw)


def serial_step(reference: nn.Module | None, x, y) -> tuple[float, float]:
    """One process (rank 0) runs the whole model on the batch while the others wait:
    its wall-clock seconds and the CPU seconds it got in them."""
    labdist.barrier()
    if reference is None:
        return 0.0, 0.0
    reference.zero_grad()
    start, cpu = time.perf_counter(), time.process_time()
    parallel.lm_loss(reference(x), y).backward()
    return time.perf_counter() - start, time.process_time() - cpu


def gather_events(events: list[dict], world_size: int) -> list[dict]:
    """Every rank's F/B blocks, on every rank."""
    if not dist.is_initialized():
        return events
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, events)
    return [e for ev in gathered for e in ev]


def pipeline_step(
    schedule: PipelineScheduleSingle, layers: Layers, x, y
) -> tuple[float, float, list[dict]]:
    """One step of the schedule on all stages: its wall-clock seconds (mean over
    ranks), the CPU seconds all stages got together, and every rank's F/B blocks."""
    layers.module.zero_grad()
    layers.module.reset()
    labdist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    run_step(schedule, layers, x, y)
    step_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    events = gather_events([e.as_dict() for e in layers.module.events], layers.world_size)
    return labdist.average(step_s), labdist.average(cpu_s) * layers.world_size, events


def crash_drill(layers: Layers, crash_stage: int) -> None:
    """--crash-stage: this stage fails mid-step; the launcher must end every rank."""
    if layers.rank == crash_stage:
        raise RuntimeError(f"stage {layers.rank}: deliberate crash (--crash-stage)")


def measure_schedule(
    name: str,
    m: int,
    layers: Layers,
    reference: nn.Module | None,
    batch: tuple[torch.Tensor, torch.Tensor],
    args: argparse.Namespace,
) -> list[float]:
    """Time one (schedule, m) interleaved with one process, and report it on rank 0:
    the one-process step times measured."""
    x, y = batch
    schedule = make_schedule(name, build_stage(layers), m)
    pipeline_step(schedule, layers, x, y)  # warm-up: also infers the shapes sent between stages
    serial_s, steps = [], []
    for kind in interleaved(args.repeats):
        if kind == "serial":
            serial_s.append(serial_step(reference, x, y))
        else:
            crash_drill(layers, args.crash_stage)
            steps.append(pipeline_step(schedule, layers, x, y))
    grads = parallel.gather_on_rank0({n: q.grad for n, q in layers.owned.items()})
    if reference is not None:  # its last step ran on the same batch: the gradients to match
        ref_grads = {n: q.grad for n, q in reference.named_parameters()}
        report(
            name, layers.world_size, m, serial_s, steps, parallel.relative_error(grads, ref_grads)
        )
    return [s[0] for s in serial_s]


def measure_schedules(
    args: argparse.Namespace,
    layers: Layers,
    reference: nn.Module | None,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Every (schedule, m) asked for, each against one process on the same batch (whose
    gradients are the reference), then the shortest one-process step for a summary."""
    all_serial: list[float] = []
    for name in args.schedules:
        for m in args.microbatches:
            if name == "1f1b" and m < layers.world_size:
                labdist.print0(
                    f"1f1b m={m}: skipped, 1F1B needs at least as many micro-batches as stages"
                )
                continue
            all_serial += measure_schedule(name, m, layers, reference, batch, args)
    if reference is not None and all_serial:
        metrics.emit({"event": "serial", "step_s": min(all_serial), "batch": args.batch_size})


def train(args: argparse.Namespace, layers: Layers, data: text.Corpus) -> None:
    """--steps steps of Adam on this stage's parameters, with the last schedule and
    micro-batch count (at least one micro-batch per stage for 1F1B)."""
    name, m = args.schedules[-1], args.microbatches[-1]
    if name == "1f1b":
        m = max(m, layers.world_size)
    schedule = make_schedule(name, build_stage(layers), m)
    optimizer = torch.optim.Adam(layers.owned.values(), lr=args.lr)
    for step in range(args.steps):
        x, y = (
            t.to(layers.device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed)
        )
        optimizer.zero_grad()
        losses: list = []
        run_step(schedule, layers, x, y, losses=losses)
        if layers.last:  # only the last stage sees the loss
            print(f"step {step}: loss {torch.stack(losses).mean():.3f}", flush=True)
        optimizer.step()


def save(args: argparse.Namespace, model: models.CharTransformer, layers: Layers) -> None:
    """Gather every stage's weights on rank 0, which saves the whole model."""
    state = parallel.gather_on_rank0(
        {n: t for n, t in model.state_dict().items() if n.startswith(layers.prefixes)}
    )
    if layers.rank == 0 and args.checkpoint:
        model.load_state_dict(state)
        models.save(args.checkpoint, model, steps=args.steps, stages=layers.world_size)
        print(f"saved {args.checkpoint}", flush=True)


def main() -> None:
    args = parse_args()
    check_args(args, labdist.detect().world_size)  # one stage per process
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init()
    model = parallel.build_model(args).to(info.device)
    reference = copy.deepcopy(model) if info.rank == 0 else None  # the unsplit model
    layers = split_model(model, info)
    stages = [model.stage_layers(s, info.world_size) for s in range(info.world_size)]
    labdist.print0(f"{info.world_size} stages; stage layers: {stages}")
    data = parallel.corpus(args)
    x, y = (
        t.to(info.device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed)
    )
    serial_step(reference, x, y)  # warm-up; its gradients are the reference
    measure_schedules(args, layers, reference, (x, y))
    train(args, layers, data)
    save(args, model, layers)
    labdist.shutdown()


def report(
    name: str,
    world_size: int,
    m: int,
    serial_s: list[tuple[float, float]],
    steps: list[tuple[float, float, list[dict]]],
    grad_err: float,
) -> None:
    """Rank 0: emit and print one (schedule, m): times, measured and replayed bubble."""
    step_s, _, events = min(steps, key=lambda s: s[0])  # the least disturbed step's timeline
    bubble = timeline.bubble_fraction(events)
    rep = timeline.replay(events, name)
    flight = timeline.in_flight(events)
    every = []  # measured and replayed bubble and the allowed noise of every timed step
    for _, _, ev in steps:
        r = timeline.replay(ev, name)
        every.append([timeline.bubble_fraction(ev), r.bubble, timeline.replay_noise(ev, r)])
    metrics.emit(
        {
            "event": "pipeline",
            "schedule": name,
            "stages": world_size,
            "microbatches": m,
            "step_s": step_s,
            "pipe_samples": [s[0] for s in steps],
            "pipe_cpu_samples": [s[1] for s in steps],
            "serial_samples": [s[0] for s in serial_s],
            "serial_cpu_samples": [s[1] for s in serial_s],
            "bubble": bubble,
            "replay_bubble": rep.bubble,
            "replay_noise": timeline.replay_noise(events, rep),
            "every_step_bubble": every,
            "ideal_bubble": timeline.ideal_bubble(world_size, m),
            "grad_rel_err": grad_err,
            "in_flight": {str(k): v for k, v in flight.items()},
            "events": events,
        }
    )
    speedup = statistics.median(s[0] for s in serial_s) / statistics.median(s[0] for s in steps)
    print(
        f"{name:5s} m={m}: step {step_s * 1e3:7.1f} ms, bubble {bubble:.2f} measured, "
        f"{rep.bubble:.2f} replayed, {timeline.ideal_bubble(world_size, m):.2f} formula; "
        f"{speedup:.2f}× one process (interleaved medians); grad error {grad_err:.1e}; "
        f"peak in flight per rank {[flight[k][0] for k in sorted(flight)]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
