"""Pipeline-parallel training of a character transformer with torch.distributed.pipelining.

Each rank holds one stage (a contiguous slice of the layers). For every schedule
(GPipe, 1F1B) and micro-batch count m it times real steps, interleaved with one
process running the whole model on the same batch (A B B A ...), records a per-rank
F/B timeline, measures the bubble, replays the schedule from the run's own block
durations and overheads, and compares the gradients with the unsplit model; then it
trains --steps steps and saves the whole model (rank 0).

    torchrun --standalone --nproc-per-node 2 pipeline.py --schedules gpipe 1f1b --microbatches 1 2 4 8
"""

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as tdist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lab_utils import dist, metrics, models, parallel, profile, timeline

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


def interleaved(repeats: int) -> list[str]:
    """A B B A A B ...: one process (A) and the pipeline (B) equally often early and late,
    so a machine that gets busier or quieter during the run favours neither."""
    return [
        k
        for r in range(repeats)
        for k in (("serial", "pipe") if r % 2 == 0 else ("pipe", "serial"))
    ]


def main() -> None:
    args = parse_args()
    p = dist.detect().world_size  # one stage per process
    parallel.require(
        p <= args.layers,
        f"{p} processes cannot each hold a stage of a "
        f"{args.layers}-layer model: use at most {args.layers} processes or more --layers",
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
    info = dist.init()
    rank, device = info.rank, info.device

    model = parallel.build_model(args).to(device)
    reference = copy.deepcopy(model) if rank == 0 else None  # the unsplit model, for checks
    ids = model.stage_layers(rank, p)
    names = [f"layers.{i}." for i in ids]
    owned = {n: q for n, q in model.named_parameters() if n.startswith(tuple(names))}
    stage_module = timeline.TimedStage([model.layers[i] for i in ids], rank)
    data = parallel.corpus(args)
    first, last = rank == 0, rank == p - 1
    dist.print0(f"{p} stages; stage layers: {[model.stage_layers(s, p) for s in range(p)]}")

    def run_step(schedule, x, y) -> None:
        if first and last:
            schedule.step(x, target=y)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()

    def sync() -> None:
        tdist.barrier() if info.distributed else None

    def serial_step() -> tuple[float, float]:
        """One process (rank 0) runs the whole model on the batch while the others wait:
        its wall-clock seconds and the CPU seconds it got in them."""
        sync()
        if rank != 0:
            return 0.0, 0.0
        reference.zero_grad()
        start, cpu = time.perf_counter(), time.process_time()
        parallel.lm_loss(reference(x), y).backward()
        return time.perf_counter() - start, time.process_time() - cpu

    def pipeline_step(schedule) -> tuple[float, float, list[dict]]:
        """One step of the schedule on all stages: its wall-clock seconds (mean over
        ranks), the CPU seconds all stages got together, and every rank's F/B blocks."""
        model.zero_grad()
        stage_module.reset()
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        run_step(schedule, x, y)
        step_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
        events = [e.as_dict() for e in stage_module.events]
        gathered = [None] * p if info.distributed else [events]
        if info.distributed:
            tdist.all_gather_object(gathered, events)
            step_s, cpu_s = dist.average(step_s), dist.average(cpu_s) * p
        return step_s, cpu_s, [e for ev in gathered for e in ev]

    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed))
    serial_step()  # warm-up; its gradients are the reference
    ref_grads = {n: q.grad.clone() for n, q in reference.named_parameters()} if rank == 0 else None
    all_serial: list[float] = []

    for name in args.schedules:
        for m in args.microbatches:
            if name == "1f1b" and m < p:
                dist.print0(
                    f"1f1b m={m}: skipped, 1F1B needs at least as many micro-batches as stages"
                )
                continue
            stage = PipelineStage(stage_module, rank, p, device)
            schedule = SCHEDULES[name](stage, n_microbatches=m, loss_fn=parallel.lm_loss)
            pipeline_step(schedule)  # warm-up: also infers the shapes sent between stages
            serial_s, steps = [], []
            for kind in interleaved(args.repeats):
                if kind == "serial":
                    serial_s.append(serial_step())
                    all_serial.append(serial_s[-1][0])
                    continue
                if rank == args.crash_stage:
                    raise RuntimeError(f"stage {rank}: deliberate crash (--crash-stage)")
                steps.append(pipeline_step(schedule))
            grads = parallel.gather_on_rank0({n: q.grad for n, q in owned.items()})
            if rank == 0:
                report(name, p, m, serial_s, steps, parallel.relative_error(grads, ref_grads))

    if rank == 0 and all_serial:  # the shortest one-process step, for a whole-run summary
        metrics.emit({"event": "serial", "step_s": min(all_serial), "batch": args.batch_size})

    # Train: the last schedule and micro-batch count, Adam on this stage's parameters.
    stage = PipelineStage(stage_module, rank, p, device)
    m = max(args.microbatches[-1], p) if args.schedules[-1] == "1f1b" else args.microbatches[-1]
    schedule = SCHEDULES[args.schedules[-1]](stage, n_microbatches=m, loss_fn=parallel.lm_loss)
    optimizer = torch.optim.Adam(owned.values(), lr=args.lr)
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        optimizer.zero_grad()
        losses: list = []
        if last:
            schedule.step(*([x] if first else []), target=y, losses=losses)
            dist.print0(f"step {step}: loss {torch.stack(losses).mean():.3f}") if first else print(
                f"step {step}: loss {torch.stack(losses).mean():.3f}", flush=True
            )
        else:
            run_step(schedule, x, y)
        optimizer.step()
    state = parallel.gather_on_rank0(
        {n: t for n, t in model.state_dict().items() if n.startswith(tuple(names))}
    )
    if rank == 0 and args.checkpoint:
        model.load_state_dict(state)
        models.save(args.checkpoint, model, steps=args.steps, stages=p)
        print(f"saved {args.checkpoint}", flush=True)
    dist.shutdown()


def report(
    name: str,
    p: int,
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
            "stages": p,
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
            "ideal_bubble": timeline.ideal_bubble(p, m),
            "grad_rel_err": grad_err,
            "in_flight": {str(k): v for k, v in flight.items()},
            "events": events,
        }
    )
    speedup = statistics.median(s[0] for s in serial_s) / statistics.median(s[0] for s in steps)
    print(
        f"{name:5s} m={m}: step {step_s * 1e3:7.1f} ms, bubble {bubble:.2f} measured, "
        f"{rep.bubble:.2f} replayed, {timeline.ideal_bubble(p, m):.2f} formula; "
        f"{speedup:.2f}× one process (interleaved medians); grad error {grad_err:.1e}; "
        f"peak in flight per rank {[flight[k][0] for k in sorted(flight)]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
