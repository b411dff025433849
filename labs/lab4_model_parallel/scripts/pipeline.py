"""Pipeline-parallel training of a character transformer with torch.distributed.pipelining.

Each rank holds one stage (a contiguous slice of the layers). For every schedule
(GPipe, 1F1B) and micro-batch count m it times real steps, records a per-rank F/B
timeline, measures the bubble and compares the gradients with the unsplit model;
then it trains --steps steps and saves the whole model (rank 0).

    torchrun --standalone --nproc-per-node 2 pipeline.py --schedules gpipe 1f1b --microbatches 1 2 4 8
"""

import argparse
import copy
import time

import torch
import torch.distributed as tdist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lab_utils import dist, metrics, models, parallel, timeline

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["gpipe", "1f1b"])
    p.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8],
                   help="micro-batch counts m to measure (each must divide --batch-size)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per (schedule, m) after a "
                   "warm-up; the least disturbed one (shortest) is kept")
    p.add_argument("--crash-stage", type=int, default=-1,
                   help="make this stage raise during its first timed step (a failure drill)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    p = dist.detect().world_size  # one stage per process
    parallel.require(p <= args.layers, f"{p} processes cannot each hold a stage of a "
                     f"{args.layers}-layer model: use at most {args.layers} processes or more --layers")
    bad = [m for m in args.microbatches if m < 1 or args.batch_size % m]
    parallel.require(not bad, f"--batch-size {args.batch_size} cannot be cut into {bad} micro-batches")
    parallel.require(args.repeats >= 1, "--repeats must be at least 1 (the first step of a "
                     "schedule also infers shapes, so it is never the one measured)")
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

    x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step=0, seed=args.seed))
    ref_grads = None
    if rank == 0:  # gradients and time of one process running the whole model on the batch
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up, as for the schedules
            reference.zero_grad()
            start = time.perf_counter()
            parallel.lm_loss(reference(x), y).backward()
            times.append(time.perf_counter() - start)
        serial_s = min(times[1:])
        ref_grads = {n: q.grad for n, q in reference.named_parameters()}
        metrics.emit({"event": "serial", "step_s": serial_s, "batch": args.batch_size})

    for name in args.schedules:
        for m in args.microbatches:
            if name == "1f1b" and m < p:
                dist.print0(f"1f1b m={m}: skipped, 1F1B needs at least as many micro-batches as stages")
                continue
            stage = PipelineStage(stage_module, rank, p, device)
            schedule = SCHEDULES[name](stage, n_microbatches=m, loss_fn=parallel.lm_loss)
            best = None
            for r in range(args.repeats + 1):  # the first is a warm-up
                model.zero_grad()
                stage_module.reset()
                tdist.barrier() if info.distributed else None
                if r == 1 and rank == args.crash_stage:
                    raise RuntimeError(f"stage {rank}: deliberate crash (--crash-stage)")
                start = time.perf_counter()
                run_step(schedule, x, y)
                step_s = time.perf_counter() - start
                events = [e.as_dict() for e in stage_module.events]
                gathered = [None] * p if info.distributed else [events]
                if info.distributed:
                    tdist.all_gather_object(gathered, events)
                all_events = [e for ev in gathered for e in ev]
                step_s = dist.average(step_s) if info.distributed else step_s
                if r > 0 and (best is None or step_s < best[0]):
                    best = (step_s, all_events)
            grads = parallel.gather_on_rank0({n: q.grad for n, q in owned.items()})
            step_s, all_events = best
            if rank == 0:
                err = parallel.relative_error(grads, ref_grads)
                bubble = timeline.bubble_fraction(all_events)
                flight = timeline.in_flight(all_events)
                metrics.emit({"event": "pipeline", "schedule": name, "stages": p, "microbatches": m,
                              "step_s": step_s, "bubble": bubble,
                              "ideal_bubble": timeline.ideal_bubble(p, m), "grad_rel_err": err,
                              "in_flight": {str(k): v for k, v in flight.items()},
                              "events": all_events})
                print(f"{name:5s} m={m}: step {step_s * 1e3:7.1f} ms, bubble {bubble:.2f} "
                      f"(ideal {timeline.ideal_bubble(p, m):.2f}), grad error {err:.1e}, "
                      f"peak in flight per rank {[flight[k][0] for k in sorted(flight)]}", flush=True)

    # Train: the last schedule and micro-batch count, Adam on this stage's parameters.
    stage = PipelineStage(stage_module, rank, p, device)
    m = max(args.microbatches[-1], p) if args.schedules[-1] == "1f1b" else args.microbatches[-1]
    schedule = SCHEDULES[args.schedules[-1]](stage, n_microbatches=m,
                                             loss_fn=parallel.lm_loss)
    optimizer = torch.optim.Adam(owned.values(), lr=args.lr)
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        optimizer.zero_grad()
        losses: list = []
        if last:
            schedule.step(*([x] if first else []), target=y, losses=losses)
            dist.print0(f"step {step}: loss {torch.stack(losses).mean():.3f}") if first else print(
                f"step {step}: loss {torch.stack(losses).mean():.3f}", flush=True)
        else:
            run_step(schedule, x, y)
        optimizer.step()
    state = parallel.gather_on_rank0({n: t for n, t in model.state_dict().items()
                                      if n.startswith(tuple(names))})
    if rank == 0 and args.checkpoint:
        model.load_state_dict(state)
        models.save(args.checkpoint, model, steps=args.steps, stages=p)
        print(f"saved {args.checkpoint}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
