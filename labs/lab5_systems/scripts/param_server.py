"""A parameter server over torch.distributed.rpc: synchronous or asynchronous SGD.

The first ``--shards`` processes are servers: each owns a slice of the parameters and
the optimizer state for it. The other processes are stateless workers: they pull the
weights, compute a gradient on their own batch of Fashion-MNIST and push it.

- ``--mode sync``: a shard waits for every worker's push, averages, steps once and
  answers all workers with the new weights (``@rpc.functions.async_execution``).
- ``--mode async``: a shard applies each push as it arrives and answers at once;
  the *staleness* of a gradient is how many updates the shard applied between the
  worker's pull and this push.

``--delay D`` adds D seconds of simulated compute to every step (a sleep, as if each
worker had its own accelerator: sleeping frees the core, so workers overlap even on a
2-core laptop); ``--straggler K`` makes the last worker K times slower and gives it
``steps // K`` gradients, so every worker computes for the same time.

    torchrun --standalone --nproc-per-node 3 param_server.py --mode async   # 1 server, 2 workers
    torchrun --standalone --nproc-per-node 4 param_server.py --shards 2     # 2 servers, 2 workers

Rank 0 (shard 0) emits JSON records: ``ps_summary`` (throughput, staleness, every push's
worker and versions, server busy fraction) and ``ps_eval`` (test accuracy of the server's
own model at evenly spaced update counts, against wall time, ending at the final model).

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    ps_eval: mode, updates, t, acc
    ps_summary: mode, optimizer, workers, shards, steps, delay, straggler, updates,
        pushes, gradients, grads_per_s, wall_s, last_update_s, staleness,
        mean_staleness, max_staleness, server_busy, worker_compute, final_acc
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from lab_utils import gloo_exit, metrics, models, profile, tensordata


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = profile.script_parser(__doc__)
    add_training_args(p)
    add_timing_args(p)
    add_run_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The job: servers and workers, the model, the data and the servers' optimizer."""
    p.add_argument(
        "--mode",
        choices=("sync", "async"),
        default="async",
        help="sync: one averaged update per round; async: one update per push",
    )
    p.add_argument("--shards", type=int, default=1, help="server processes (the rest are workers)")
    p.add_argument("--steps", type=int, default=100, help="gradients each worker pushes")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the servers' optimizer")
    p.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="the update the servers apply (state kept on the servers)",
    )
    p.add_argument("--hidden", type=int, default=128, help="hidden units of the MLP")
    p.add_argument("--n-train", type=int, default=10000, help="Fashion-MNIST training images")
    p.add_argument("--n-test", type=int, default=2000, help="test images for the accuracy")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches")


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """Simulated compute, a straggler, and the points of the accuracy-vs-time curve."""
    p.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds of simulated compute per step (a sleep: workers overlap)",
    )
    p.add_argument(
        "--straggler",
        type=int,
        default=1,
        help="the last worker is this many times slower and pushes steps // K "
        "gradients (async only)",
    )
    p.add_argument(
        "--snapshots",
        type=int,
        default=8,
        help="points of the accuracy-vs-time curve: the server's model at evenly "
        "spaced update counts",
    )


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Timeouts, fault injection and where the final weights go."""
    p.add_argument(
        "--rpc-timeout",
        type=float,
        default=60.0,
        help="seconds an RPC may take before the caller gives up",
    )
    p.add_argument(
        "--job-timeout",
        type=float,
        default=600.0,
        help="seconds shard 0 waits for every worker to finish before giving up",
    )
    p.add_argument(
        "--crash",
        default="",
        help="fault injection: 'worker:STEP' (worker 1 dies at that step) or "
        "'server:VERSION' (shard 0 dies at that version)",
    )
    p.add_argument("--save", default="", help="write the final weights here (rank 0)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with a usage error on values that cannot make a job."""
    if args.shards < 1:
        p.error("--shards must be >= 1")
    if args.delay < 0:
        p.error("--delay must be >= 0")
    if args.straggler < 1 or args.straggler > args.steps:
        p.error("--straggler must be between 1 and --steps")
    if args.straggler > 1 and args.mode == "sync":
        p.error("--straggler needs --mode async (a synchronous round needs every worker's push)")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # every process builds the same initial weights
    return models.build("mlp", hidden=(args.hidden,))


def worker_steps(args: argparse.Namespace, wid: int, workers: int) -> int:
    """Gradients worker ``wid`` pushes: the straggler (the last worker) pushes 1/K of them."""
    return args.steps // args.straggler if wid == workers - 1 else args.steps


def worker_delay(args: argparse.Namespace, wid: int, workers: int) -> float:
    """Seconds of simulated compute per step of worker ``wid``."""
    return args.delay * (args.straggler if wid == workers - 1 else 1)


def total_updates(args: argparse.Namespace, workers: int) -> int:
    """Updates a shard applies in the whole run: one per round (sync) or per push (async)."""
    if args.mode == "sync":
        return args.steps
    return sum(worker_steps(args, w, workers) for w in range(workers))


def snapshot_versions(total: int, snapshots: int) -> set[int]:
    """Versions at which a shard keeps its weights: evenly spaced, always the last."""
    n = max(1, min(snapshots, total))
    return {round(total * j / n) for j in range(1, n + 1)}


def partition(params: list[torch.Tensor], shards: int) -> list[list[int]]:
    """Parameter indices per shard, balanced by size (largest first onto the lightest)."""
    owned: list[list[int]] = [[] for _ in range(shards)]
    load = [0] * shards
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        k = load.index(min(load))
        owned[k].append(i)
        load[k] += params[i].numel()
    return [sorted(o) for o in owned]


# ============================================================ server side
class Shard:
    """The state one server owns: its parameters, their optimizer, a version counter."""

    def __init__(self, params: list[torch.Tensor], args: argparse.Namespace, workers: int) -> None:
        self.params = [p.detach().clone() for p in params]
        opt = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
        self.optimizer = opt(self.params, lr=args.lr)
        self.workers, self.mode = workers, args.mode
        self.lock = threading.Lock()
        self.version = 0
        self.staleness: list[int] = []  # one entry per applied gradient
        self.pushes: list[tuple[int, int, int]] = []  # (worker, version pulled, version at apply)
        self.snap_at = snapshot_versions(total_updates(args, workers), args.snapshots)
        self.snapshots: list[tuple[int, float, list[torch.Tensor]]] = []  # (version, time, weights)
        self.busy_s = 0.0  # time spent applying updates, under the lock
        self.first = self.last = 0.0
        self.pending: list[list[torch.Tensor]] = []
        self.future: torch.futures.Future = torch.futures.Future()
        self.crash_at = int(args.crash.split(":")[1]) if args.crash.startswith("server:") else -1
        self.reports: dict[int, dict] = {}

    def weights(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.params]

    def apply(self, grads: list[torch.Tensor]) -> None:
        """One optimizer step with ``grads`` (called under the lock)."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        self.optimizer.step()
        self.version += 1
        if self.version in self.snap_at:  # the server's own model, for the accuracy curve
            self.snapshots.append((self.version, time.time(), self.weights()))
        if self.version == self.crash_at:
            print(f"server: simulated crash at version {self.version}", flush=True)
            os._exit(3)


SHARD: Shard | None = None  # set in the server processes


def pull() -> tuple[int, list[torch.Tensor]]:
    """RPC: the current version and weights of this shard."""
    with SHARD.lock:
        return SHARD.version, SHARD.weights()


def push_async(
    grads: list[torch.Tensor], pulled: int, worker: int
) -> tuple[int, list[torch.Tensor]]:
    """RPC (async mode): apply one worker's gradient now; answer with the new weights."""
    s = SHARD
    with s.lock:
        t0 = time.perf_counter()
        s.first = s.first or t0
        s.staleness.append(s.version - pulled)  # updates applied since this worker pulled
        s.pushes.append((worker, pulled, s.version))
        s.apply(grads)
        out = s.version, s.weights()
        s.last = time.perf_counter()
        s.busy_s += s.last - t0
    return out


@rpc.functions.async_execution
def push_sync(grads: list[torch.Tensor], pulled: int, worker: int) -> torch.futures.Future:
    """RPC (sync mode): hold every worker's push until all have arrived, then step once
    with the average and answer all of them with the same new weights."""
    s = SHARD
    with s.lock:
        t0 = time.perf_counter()
        s.first = s.first or t0
        fut = s.future
        s.pending.append(grads)
        s.staleness.append(s.version - pulled)  # 0: nobody can step before all pushed
        s.pushes.append((worker, pulled, s.version))
        result = None
        if len(s.pending) == s.workers:
            mean = [torch.stack(gs).mean(0) for gs in zip(*s.pending, strict=True)]
            s.apply(mean)
            s.pending, s.future = [], torch.futures.Future()
            result = (s.version, s.weights())
        s.last = time.perf_counter()
        s.busy_s += s.last - t0
    if result is not None:
        fut.set_result(result)  # outside the lock: this wakes the waiting answers
    return fut


def report(worker: int, stats: dict) -> None:
    """RPC: a worker hands its statistics (and snapshots) to shard 0 before it leaves."""
    with SHARD.lock:
        SHARD.reports[worker] = stats


def shard_stats() -> dict:
    """RPC: what a shard measured (asked by shard 0 at the end)."""
    s = SHARD
    with s.lock:
        return {
            "version": s.version,
            "staleness": list(s.staleness),
            "pushes": list(s.pushes),
            "busy_s": s.busy_s,
            "span_s": s.last - s.first,
            "weights": s.weights(),
            "snapshots": list(s.snapshots),
        }


# ============================================================ worker side
def work(
    args: argparse.Namespace,
    wid: int,
    workers: int,
    servers: list[str],
    owned: list[list[int]],
    data: tensordata.Tensors,
) -> None:
    device = profile.device()
    model = build_model(args).to(device)
    params = list(model.parameters())
    x, y = data.x_train.to(device), data.y_train.to(device)
    push = push_sync if args.mode == "sync" else push_async
    crash_at = int(args.crash.split(":")[1]) if args.crash.startswith("worker:") else -1
    timeout = args.rpc_timeout

    def install(answers: list[tuple[int, list[torch.Tensor]]]) -> list[int]:
        with torch.no_grad():
            for idx, (_, ws) in zip(owned, answers, strict=True):
                for i, w in zip(idx, ws, strict=True):
                    params[i].copy_(w)
        return [v for v, _ in answers]

    steps, delay = worker_steps(args, wid, workers), worker_delay(args, wid, workers)
    versions = install([rpc.rpc_sync(s, pull, timeout=timeout) for s in servers])
    start, compute_s = time.time(), 0.0
    for step in range(steps):
        if wid == 1 and step == crash_at:
            print(f"worker {wid}: simulated crash at step {step}", flush=True)
            os._exit(3)
        t0 = time.perf_counter()
        idx = tensordata.batch_indices(
            len(x), args.batch_size, seed=args.seed, worker=wid, step=step
        )
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        grads = [p.grad.detach().cpu() for p in params]
        time.sleep(delay)  # simulated compute: the core is free for the others meanwhile
        compute_s += time.perf_counter() - t0
        futs = [
            rpc.rpc_async(s, push, args=([grads[i] for i in idx_k], v, wid), timeout=timeout)
            for s, idx_k, v in zip(servers, owned, versions, strict=True)
        ]
        versions = install([f.wait() for f in futs])
    rpc.rpc_sync(
        servers[0],
        report,
        args=(wid, {"start": start, "end": time.time(), "steps": steps, "compute_s": compute_s}),
        timeout=timeout,
    )


# ============================================================ the job
def finish(
    args: argparse.Namespace, servers: list[str], owned: list[list[int]], data: tensordata.Tensors
) -> None:
    """Shard 0, after every worker has left: gather, evaluate, emit."""
    stats = [shard_stats()] + [rpc.rpc_sync(s, shard_stats) for s in servers[1:]]
    reports = SHARD.reports
    start = min(r["start"] for r in reports.values())
    model = build_model(args)
    accuracy_curve(args, model, stats, owned, data, start)
    load(list(model.parameters()), owned, [st["weights"] for st in stats])  # the final weights
    final_acc = tensordata.accuracy(model, data.x_test, data.y_test)
    if args.save:
        models.save(args.save, model, mode=args.mode, optimizer=args.optimizer)
    summarize(args, stats, reports, final_acc)


def accuracy_curve(
    args: argparse.Namespace,
    model: torch.nn.Module,
    stats: list[dict],
    owned: list[list[int]],
    data: tensordata.Tensors,
    start: float,
) -> None:
    """Emit the test accuracy of the initial weights and of every snapshot."""
    params = list(model.parameters())
    metrics.emit(
        {
            "event": "ps_eval",
            "mode": args.mode,
            "updates": 0,
            "t": 0.0,
            "acc": tensordata.accuracy(model, data.x_test, data.y_test),
        }
    )
    # Every shard kept its slice at the same versions; shard 0's clock dates them.
    for (version, t, _), *slices in zip(
        stats[0]["snapshots"], *(st["snapshots"] for st in stats), strict=True
    ):
        load(params, owned, [ws for _, _, ws in slices])
        acc = tensordata.accuracy(model, data.x_test, data.y_test)
        metrics.emit(
            {"event": "ps_eval", "mode": args.mode, "updates": version, "t": t - start, "acc": acc}
        )


def summarize(args: argparse.Namespace, stats: list[dict], reports: dict, final_acc: float) -> None:
    """Emit and print the job's throughput, staleness and server load."""
    start = min(r["start"] for r in reports.values())
    wall = max(r["end"] for r in reports.values()) - start
    workers = len(reports)
    grads = sum(r["steps"] for r in reports.values())
    staleness = stats[0]["staleness"]
    summary = {
        "event": "ps_summary",
        "mode": args.mode,
        "workers": workers,
        "shards": len(stats),
        "optimizer": args.optimizer,
        "steps": args.steps,
        "delay": args.delay,
        "straggler": args.straggler,
        "gradients": grads,
        "updates": stats[0]["version"],
        "pushes": stats[0]["pushes"],
        "last_update_s": stats[0]["snapshots"][-1][1] - start,
        "wall_s": wall,
        "grads_per_s": grads / wall,
        "final_acc": final_acc,
        "staleness": staleness,
        "mean_staleness": sum(staleness) / len(staleness),
        "max_staleness": max(staleness),
        "server_busy": [st["busy_s"] / wall for st in stats],
        "worker_compute": sum(r["compute_s"] for r in reports.values()) / (workers * wall),
    }
    metrics.emit(summary)
    print(
        f"{args.mode} PS, {len(stats)} shard(s), {workers} workers: {grads} gradients in "
        f"{wall:.2f} s = {grads / wall:.0f}/s; {stats[0]['version']} updates; staleness mean "
        f"{summary['mean_staleness']:.2f} max {summary['max_staleness']}; server busy "
        f"{', '.join(f'{b:.0%}' for b in summary['server_busy'])}; test accuracy {final_acc:.3f}",
        flush=True,
    )


def load(
    params: list[torch.Tensor], owned: list[list[int]], slices: list[list[torch.Tensor]]
) -> None:
    """Copy each shard's slice of the weights into the full model's parameters."""
    with torch.no_grad():
        for idx, ws in zip(owned, slices, strict=True):
            for i, w in zip(idx, ws, strict=True):
                params[i].copy_(w)


def main(argv: list[str] | None = None) -> None:
    global SHARD
    warnings.filterwarnings("ignore", message="You are using a Backend")  # rpc's own init
    args = parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size <= args.shards:
        sys.exit(
            f"param_server.py needs more processes than --shards={args.shards} "
            f"(got {world_size}): start it with torchrun --nproc-per-node N"
        )
    profile.configure_threads()
    servers = [f"ps{k}" for k in range(args.shards)]
    workers = world_size - args.shards
    name = servers[rank] if rank < args.shards else f"worker{rank - args.shards}"
    template = list(build_model(args).parameters())
    owned = partition(template, args.shards)
    if rank < args.shards:
        SHARD = Shard([template[i] for i in owned[rank]], args, workers)
    # Load the data first: init_rpc waits for every process, so the workers then start
    # their loops together (a late starter would see no concurrency, hence no staleness).
    data = tensordata.load(args.n_train, args.n_test, seed=args.seed)
    opts = rpc.TensorPipeRpcBackendOptions(
        rpc_timeout=args.rpc_timeout, num_worker_threads=16, init_method="env://"
    )
    # RPC's agent holds a Gloo group and threads, which can abort or hang the rank at Python's
    # exit (torch 2.13): from here on it ends by os._exit with Python's own status (sys.exit,
    # atexit.register and destroy_process_group are wrapped for it; lab_utils/gloo_exit.py)
    gloo_exit.arm()
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    try:
        if rank >= args.shards:
            work(args, rank - args.shards, workers, servers, owned, data)
        else:
            # A server only answers RPCs; shard 0 waits until every worker has reported.
            deadline = time.monotonic() + args.job_timeout
            while rank == 0 and len(SHARD.reports) < workers:
                if time.monotonic() > deadline:
                    sys.exit("server: the workers did not all report in time")
                time.sleep(0.02)
            if rank == 0:
                finish(args, servers, owned, data)
    except RuntimeError as exc:  # a peer died or an RPC timed out
        print(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        sys.exit(
            f"{name}: lost contact with the job ({exc.__class__.__name__}); "
            "see the failing process above"
        )
    rpc.shutdown()  # graceful: waits until every process is done with its RPCs


if __name__ == "__main__":
    main()
