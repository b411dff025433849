"""Self-checks for Lab 2: the exercises, and the claims the notebooks make.

Exercise checks run the student's function on hidden cases (collectives in simulated
ranks, see :func:`lab_utils.collectives.simulate`) and try to say *what* is wrong:
a missing phase, a deadlock, a message to the wrong neighbour. Science checks take
numbers a notebook measured and raise :class:`~lab_utils.checks.CheckFailed` when the
claim does not hold, so a broken experiment fails the notebook under nbval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import lab2_solutions as reference
from lab_utils import collectives, metrics
from lab_utils.checks import close, fail, passed, that


# --------------------------------------------------------------------- exercises
def _ring_case(n: int, length: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * n + length)
    if dtype.is_floating_point:
        return [torch.randn(length, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(-50, 50, (length,), generator=g, dtype=dtype) for _ in range(n)]


def _diagnose_ring(
    outputs: Sequence[Any], inputs: Sequence[torch.Tensor], expected: torch.Tensor, what: str
) -> None:
    n = len(inputs)
    sizes = collectives.chunk_sizes(expected.numel(), n)
    for r, out in enumerate(outputs):
        if out is None:
            fail(what, f"rank {r} returned None", "return the reduced tensor")
        if not isinstance(out, torch.Tensor):
            fail(what, f"rank {r} returned a {type(out).__name__}", "return a torch.Tensor")
        if out.numel() != expected.numel():
            fail(
                what,
                f"rank {r} returned {out.numel()} elements instead of {expected.numel()}",
                "return the whole reduced tensor, not only this rank's chunk",
            )
        got = out.reshape(-1).to(expected.dtype)
        if torch.equal(got, expected) or (
            expected.is_floating_point() and torch.allclose(got, expected, atol=1e-5)
        ):
            continue
        if torch.equal(got, inputs[r].reshape(-1)):
            fail(
                what,
                f"rank {r} returned its input unchanged",
                "add the chunk received from the left neighbour to your own copy",
            )
        good = [
            bool(torch.allclose(c_got.double(), c_exp.double(), atol=1e-5))
            for c_got, c_exp in zip(
                torch.split(got, sizes), torch.split(expected, sizes), strict=True
            )
        ]
        if good[(r + 1) % n] and sum(good) < n:
            fail(
                what,
                f"rank {r} has only chunk {(r + 1) % n} fully reduced",
                "the reduce-scatter works; now run the all-gather phase: N-1 more steps "
                "in which each rank passes on a complete chunk and overwrites its own copy",
            )
        fail(
            what,
            f"rank {r} has {sum(good)} of {n} chunks right (N={n}, length {expected.numel()})",
            "at step s rank r sends chunk (r - s) mod N to rank r+1 and adds the chunk "
            "(r - s - 1) mod N that arrives from rank r-1",
        )


def check_ring_all_reduce(fn: Callable) -> None:
    """``fn(x, comm)`` computes the sum over all ranks with a ring (N = 2, 3, 4)."""
    what = "ring_all_reduce"
    cases = 0
    for n in (2, 3, 4):
        for length in dict.fromkeys((4 * n, 4 * n + 1, n - 1 or 1, 1)):
            for dtype in (torch.float32, torch.int64):
                inputs = _ring_case(n, length, dtype)
                expected = torch.stack(inputs).sum(0)
                try:
                    outputs, traffic = collectives.simulate(fn, inputs, timeout=3.0)
                except collectives.DeadlockError as exc:
                    fail(
                        what,
                        f"deadlock with N={n}: {exc}",
                        "each rank must post its isend() before it blocks in recv()",
                    )
                except NotImplementedError:
                    raise
                except Exception as exc:
                    fail(
                        what,
                        f"N={n}, length {length}, {dtype}: {type(exc).__name__}: {exc}",
                        "split into N chunks whose sizes differ by at most one "
                        "(collectives.chunk_sizes); skip empty chunks",
                    )
                _diagnose_ring(outputs, inputs, expected, what)
                element = inputs[0].element_size()
                allowed = collectives.ring_bytes_per_rank(length * element, n) + 2 * n * element
                busiest = max(traffic, key=lambda t: t.bytes_sent)
                if busiest.bytes_sent > allowed:
                    fail(
                        what,
                        f"the sums are right but rank {busiest.rank} sent "
                        f"{busiest.bytes_sent} bytes for a {length * element}-byte tensor "
                        f"(a ring sends {2 * (n - 1)}/{n} of it)",
                        "send one chunk per step, to the right neighbour only",
                    )
                cases += 1
    passed(
        what,
        f"{cases} cases: N = 2, 3, 4, lengths divisible and not by N, float and int, "
        "2(N−1)/N·S bytes per rank",
    )


def check_ring_time(fn: Callable) -> None:
    """``fn(nbytes, world_size, latency_s, bandwidth)`` is the α–β ring model."""
    what = "ring_time"
    for nbytes, n, a, b in [(4e6, 2, 1e-4, 1e9), (1e3, 8, 5e-5, 1e10), (1e8, 4, 0.0, 2e9)]:
        got, exp = float(fn(nbytes, n, a, b)), reference.ring_time(nbytes, n, a, b)
        if abs(got - exp) <= 1e-9 * max(exp, 1e-12):
            continue
        if abs(got - 2 * exp) < 1e-9 * exp or abs(2 * got - exp) < 1e-9 * exp:
            hint = "a factor of 2 is off: there are two phases of N−1 steps each"
        elif a == 0.0:
            hint = "the bandwidth term: each rank sends 2(N−1)/N · S bytes"
        else:
            hint = "the latency term: 2(N−1) messages, each costing α"
        fail(
            what, f"ring_time({nbytes:g}, {n}, {a:g}, {b:g}) = {got:.4g}, expected {exp:.4g}", hint
        )
    if float(fn(1e6, 1, 1e-3, 1e9)) != 0.0:
        fail(
            what,
            f"ring_time(1e6, 1, ...) = {fn(1e6, 1, 1e-3, 1e9):.4g}",
            "a single rank has nothing to send: return 0",
        )
    passed(what, "2(N−1)·α + 2(N−1)/N·S/B, and 0 for one rank")


def check_shard_indices(fn: Callable) -> None:
    """``fn(n, rank, world_size, epoch, seed)``: equal, covering, per-epoch shuffled shards."""
    what = "shard_indices"
    for n, world in [(10, 3), (12, 4), (7, 2), (2, 3)]:
        shards = [torch.as_tensor(fn(n, r, world, 0, 0)).reshape(-1) for r in range(world)]
        sizes = [len(s) for s in shards]
        if len(set(sizes)) != 1:
            fail(
                what,
                f"n={n}, {world} ranks: shard sizes {sizes}",
                "every rank needs the same number of samples, or one rank waits forever "
                "in the all-reduce of a batch the others never run: pad by wrapping round",
            )
        if sizes[0] != -(-n // world):
            fail(
                what,
                f"n={n}, {world} ranks: {sizes[0]} samples per rank, expected "
                f"ceil(n / world_size) = {-(-n // world)}",
            )
        union = torch.cat(shards)
        if union.min() < 0 or union.max() >= n:
            fail(what, f"indices outside 0..{n - 1}")
        if len(set(union.tolist())) != n:
            fail(
                what,
                f"n={n}, {world} ranks: the shards cover {len(set(union.tolist()))} of {n} samples",
                "all ranks must shuffle with the same generator seed, then take "
                "perm[rank::world_size]; different seeds make shards overlap",
            )
    one = [torch.as_tensor(fn(50, 0, 1, e, 0)).tolist() for e in (0, 0, 1)]
    if one[0] != one[1]:
        fail(
            what,
            "two calls with the same epoch gave different orders",
            "seed a torch.Generator with seed + epoch instead of using the global RNG",
        )
    if one[0] == one[2]:
        fail(
            what,
            "epoch 1 has the same order as epoch 0",
            "reshuffle every epoch: seed the generator with seed + epoch",
        )
    if sorted(one[0]) != list(range(50)):
        fail(what, "one rank does not get a permutation of all samples")
    passed(what, "equal sizes, full coverage, same order on every rank, new order every epoch")


def check_scaling_efficiency(fn: Callable) -> None:
    """``fn({N: throughput})`` returns ``{N: throughput_N / (N · throughput_1)}``."""
    what = "scaling_efficiency"
    case = {1: 100.0, 2: 180.0, 4: 200.0}
    got = fn(dict(case))
    exp = reference.scaling_efficiency(case)
    if not isinstance(got, Mapping) or set(got) != set(exp):
        fail(what, f"returned {got!r}", "return a dict {processes: efficiency}")
    if abs(got[2] - 1.8) < 1e-9:
        fail(
            what,
            "efficiency(2) = 1.8: that is the speed-up",
            "divide the speed-up by the number of processes",
        )
    close([got[k] for k in sorted(exp)], [exp[k] for k in sorted(exp)], rtol=1e-9, what=what)


def check_time_to_target(fn: Callable) -> None:
    """``fn(evals, target)``: the training seconds of the FIRST evaluation at or above
    ``target``, ``None`` if no evaluation reached it."""
    what = "time_to_target"
    evals = [
        {"step": 10, "seconds": 2.0, "val_acc": 0.70},
        {"step": 20, "seconds": 4.5, "val_acc": 0.86},
        {"step": 30, "seconds": 7.0, "val_acc": 0.84},
        {"step": 40, "seconds": 9.5, "val_acc": 0.88},
    ]
    got = fn([dict(e) for e in evals], 0.85)
    if got == 9.5:
        fail(
            what,
            "returned the seconds of the last evaluation above the target",
            "accuracy wobbles: the target is reached at the FIRST evaluation above it",
        )
    if got == 20:
        fail(what, "returned a step count", "return the evaluation's 'seconds', not its 'step'")
    never = fn([dict(e) for e in evals], 0.95)
    if never is not None:
        fail(
            what,
            f"returned {never!r} for a target no evaluation reached",
            "return None: an unreached target has no time (not 0, not the run's length)",
        )
    close(got, 4.5, rtol=1e-9, what=what)


# Accuracy after the same epochs may fall by at most this much (points) on N processes
# with linear scaling and warm-up (the scripts' rule); tests/test_lab2_scaling.py asserts
# it on the cpu profile, where it holds.
ACCURACY_MARGIN = {2: 1.0, 4: 1.0, 8: 2.0}


def check_accuracy_holds(val_acc: Mapping[int, float]) -> None:
    """``{N: val_acc}`` after the same epochs: every N within ``ACCURACY_MARGIN`` of N=1."""
    base = val_acc[1]
    for n in sorted(k for k in val_acc if k > 1):
        margin = ACCURACY_MARGIN.get(n, max(ACCURACY_MARGIN.values()))
        drop = 100 * (base - val_acc[n])
        that(
            drop <= margin,
            what=f"{n} processes reach the accuracy of 1 (within {margin} points)",
            detail=f"{val_acc[n]:.2%} vs {base:.2%}: {drop:+.2f} points lost",
            hint="check the learning-rate rule: N × lr with a warm-up (Lab 3)",
        )


# ---------------------------------------------------------------- science claims
def check_ring_matches(records: Sequence[Mapping[str, Any]], tol: float = 1e-5) -> None:
    """The ring's result equals ``dist.all_reduce``'s for every group size and length."""
    checked = metrics.events(records, "ring_check")
    that(
        bool(checked),
        what="the job reported ring checks",
        hint="look at the job's output above for an error",
    )
    worst = max(checked, key=lambda r: r["max_rel_err"])
    sizes = sorted({r["world_size"] for r in checked})
    that(
        worst["max_rel_err"] <= tol,
        what=f"ring all-reduce equals dist.all_reduce for N = {sizes}",
        detail=f"{len(checked)} cases, largest relative error {worst['max_rel_err']:.1e}",
        hint=f"worst case: {worst}",
    )


def check_server_bottleneck(
    ring: Sequence[collectives.Traffic], server: Sequence[collectives.Traffic], nbytes: int
) -> float:
    """The server's link carries about N/2 times what the busiest ring link carries."""
    n = len(ring)
    busiest_ring = max(t.bytes_total for t in ring)
    busiest_server = max(t.bytes_total for t in server)
    ratio = busiest_server / busiest_ring
    close(
        busiest_ring,
        2 * collectives.ring_bytes_per_rank(nbytes, n),
        rtol=2 * n / nbytes + 1e-9,
        what=f"ring, N={n}: each link carries 2 · 2(N−1)/N · S bytes",
    )
    close(
        busiest_server,
        2 * collectives.server_bytes(nbytes, n),
        rtol=1e-9,
        what=f"server, N={n}: its link carries 2 · (N−1) · S bytes",
    )
    that(
        abs(ratio - n / 2) <= 0.05 * n,
        what=f"the server carries N/2 = {n / 2:g}× the ring's busiest link",
        detail=f"measured {ratio:.2f}×",
    )
    return ratio


def check_equivalence(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, what: str, rtol: float = 1e-5
) -> float:
    """Two state dicts hold the same parameters (relative error over all of them)."""
    if set(a) != set(b):
        fail(what, f"different parameter names: {sorted(set(a) ^ set(b))[:4]}")
    keys = sorted(k for k in a if a[k].is_floating_point())
    flat_a = torch.cat([a[k].detach().double().reshape(-1) for k in keys])
    flat_b = torch.cat([b[k].detach().double().reshape(-1) for k in keys])
    return close(
        flat_a,
        flat_b,
        rtol=rtol,
        what=what,
        hint="same seed, same data order, no augmentation, no BatchNorm, the same "
        "effective learning rate, and the same number of steps?",
    )


def check_buckets(records: Sequence[Mapping[str, Any]]) -> None:
    """A smaller ``bucket_cap_mb`` splits the gradients into more all-reduce calls."""
    rows = sorted(metrics.events(records, "bucket"), key=lambda r: r["bucket_cap_mb"])
    that(len(rows) >= 2, what="at least two bucket sizes were measured")
    calls = [r["allreduce_calls_per_step"] for r in rows]
    that(
        all(x >= y for x, y in zip(calls, calls[1:], strict=False)) and calls[0] > calls[-1],
        what="smaller buckets mean more all-reduce calls per step",
        detail=", ".join(
            f"{r['bucket_cap_mb']:g} MB: {c:g}" for r, c in zip(rows, calls, strict=True)
        ),
    )


def check_no_sync(records: Sequence[Mapping[str, Any]]) -> None:
    """With ``no_sync`` over k micro-batches, DDP all-reduces once per k micro-batches."""
    rows = {r["accum"]: r for r in metrics.events(records, "accum")}
    that(1 in rows and len(rows) >= 2, what="accumulation 1 and k were measured")
    base = rows[1]["allreduce_calls_per_micro_batch"]
    for k, row in sorted(rows.items()):
        if k == 1:
            continue
        close(
            row["allreduce_calls_per_micro_batch"],
            base / k,
            rtol=1e-9,
            what=f"no_sync over {k} micro-batches: 1/{k} of the all-reduce calls",
        )


def check_job_stopped(result: Any, *, timeout: float, expect: str) -> None:
    """A failing job ended on its own, before ``timeout``, saying ``expect``."""
    that(not result.ok, what="the job failed (as it should)")
    that(
        result.elapsed < timeout,
        what=f"it ended within the {timeout:g}s budget",
        detail=f"{result.elapsed:.1f}s",
    )
    that(
        expect.lower() in result.output.lower(),
        what=f"its output says {expect!r}",
        hint="scroll up: the error message names the rank and the collective",
    )
