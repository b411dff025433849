"""Self-checks of Lab 7 (training over a slow network): its exercise and its run's claims.

What a run asserts rests on counts (the bytes the link's qdisc counted), on the token
bucket's own bound (in t seconds at most burst + rate·t bytes pass), or on comparisons
inside one run with that run's spread (DESIGN.md §13); everything else is shown.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lab_utils.checks import fail, passed, spread, that
from lab_utils.exercises import reference

# Bytes a TCP/IPv4 packet on lo carries besides its payload, at the least: the Ethernet
# header lo's packets keep (14), the IPv4 header (20) and the TCP header (20) — 12 more
# with TCP timestamps, Linux's default, which the lower bound below leaves out.
MIN_HEADER_BYTES = 14 + 20 + 20


def min_link_bytes(payload: float, procs: int, mtu: int) -> float:
    """The fewest bytes the job's one link carries for an all-reduce of ``payload`` bytes
    on ``procs`` ranks, whatever the algorithm: every rank's result (the sum) depends on
    every value the others hold, so each rank receives at least ``payload`` bytes, and
    all N ranks do so over the same loopback; in packets of at most mtu − 40 payload
    bytes, each with at least :data:`MIN_HEADER_BYTES` of headers. (A ring all-reduce,
    Lab 6.6, sends 2(N−1)/N of the payload per rank: 2(N−1) × payload on the link, the
    same for N = 2.)"""
    if procs < 2:
        return 0.0  # alone, nothing is sent
    return procs * payload * (1 + MIN_HEADER_BYTES / (mtu - 40))


def _pair(result: Any) -> tuple[float, float] | None:
    try:
        alpha, beta = result
        alpha, beta = float(alpha), float(beta)
    except (TypeError, ValueError):
        return None
    if not (np.isfinite(alpha) and np.isfinite(beta)):
        return None
    return alpha, beta


def _same(a: tuple[float, float], b: tuple[float, float], scale: tuple[float, float]) -> bool:
    return all(abs(x - y) <= 1e-6 * s for x, y, s in zip(a, b, scale))


def _diagnose(got: tuple[float, float], x: np.ndarray, t: np.ndarray) -> str:
    """The likely mistake behind a wrong (α, β) for the points (x, t)."""
    ref = reference("lab7.fit_alpha_beta")(x, t)
    scale = (max(abs(ref[0]), float(np.max(t)) * 1e-3), abs(ref[1]))
    weighted = np.polyfit(x, t, 1, w=1 / t)
    through_origin = float(x @ t / (x @ x))
    if _same(got, (ref[1], ref[0]), (scale[1], scale[0])):
        return "α and β are swapped: np.polyfit(x, t, 1) returns the slope first, [β, α]"
    if got[0] == 0 and _same(got, (0.0, through_origin), scale):
        return "the line goes through the origin: t = β·bytes has no α; fit α too"
    if (
        _same(got, (0.0, float(np.mean(t / x))), scale)
        or abs(got[1] - np.mean(t / x)) < 1e-9 * scale[1]
    ):
        return (
            "β is the mean of t / bytes: that charges α to every byte; the slope of the "
            "least-squares line is what the extra bytes cost"
        )
    if _same(got, (float(weighted[1]), float(weighted[0])), scale):
        return (
            "this is a fit weighted by 1/t (Lab 6.5's): here every point counts the same, "
            "ordinary least squares"
        )
    if abs(got[1] * ref[1] - 1) < 1e-3 or abs(got[1] - 1 / ref[1]) < 1e-6 / ref[1]:
        return "β is seconds per byte; you returned its inverse, the rate in bytes per second"
    if abs(got[1] - 8 * ref[1]) < 1e-6 * scale[1] or abs(got[1] - ref[1] / 8) < 1e-6 * scale[1]:
        return "β is seconds per byte, not per bit"
    return (
        f"expected α = {ref[0]:.6g} s, β = {ref[1]:.6g} s/byte (ordinary least squares "
        "of t on bytes), got those above"
    )


def check_fit_alpha_beta(
    fit: Callable[[Sequence[float], Sequence[float]], tuple[float, float]],
    nbytes: Sequence[float] | None = None,
    seconds: Sequence[float] | None = None,
) -> tuple[float, float]:
    """``fit(nbytes, seconds)`` returns (α, β) of ordinary least squares: on a line it
    must give the line back, on scattered points the least-squares line, and on the
    run's points (when given) the reference's. Returns the fit of the run's points."""
    rng = np.random.default_rng(7)
    x = np.geomspace(2e5, 4e6, 7)
    cases = {
        "an exact line (α = 0.5 ms, 1/β = 50 Mbit/s)": 5e-4 + x / 6.25e6,
        "scattered points": (5e-4 + x / 6.25e6) * (1 + 0.05 * rng.standard_normal(x.size)),
    }
    if nbytes is not None and seconds is not None:
        cases["this run's points"] = np.asarray(seconds, float)
    out = (0.0, 0.0)
    for name, t in cases.items():
        xs = np.asarray(nbytes, float) if name == "this run's points" else x
        ref = reference("lab7.fit_alpha_beta")(xs, t)
        got = _pair(fit(xs, t))
        what = f"fit_alpha_beta on {name}"
        if got is None:
            fail(what, "did not return two finite numbers", "return (alpha, beta), two floats")
        scale = (max(abs(ref[0]), float(np.max(t)) * 1e-3), abs(ref[1]))
        if not _same(got, ref, scale):
            fail(
                what,
                f"got α = {got[0]:.6g} s, β = {got[1]:.6g} s/byte",
                _diagnose(got, xs, t),
            )
        passed(what, f"α = {got[0] * 1e3:.3f} ms, β = {got[1]:.4g} s/byte")
        out = got
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def check_every_byte_crossed(sweep: Mapping[str, Any], procs: int, mtu: int) -> None:
    """A count: for every size, the link's qdisc counted at least what an all-reduce of
    that payload must put on the job's one link (:func:`min_link_bytes`). Zero bytes, or
    half of them, means the ranks talked past the link."""
    counted = sweep["link_bytes"]
    if counted is None:
        fail("bytes on the link", "not counted: this run was not on a link of its own")
    short = [
        (s, c, min_link_bytes(s, procs, mtu))
        for s, c in zip(sweep["sizes"], counted, strict=True)
        if c < min_link_bytes(s, procs, mtu)
    ]
    ratios = ", ".join(f"{c / s:.3f}" for s, c in zip(sweep["sizes"], counted, strict=True))
    that(
        not short,
        what=f"every all-reduce crossed the link: ≥ N × payload + headers (N = {procs})",
        detail=f"bytes on the link per payload byte, by size: {ratios}"
        if not short
        else "; ".join(f"{s:,} B payload: counted {c:,.0f} < {m:,.0f}" for s, c, m in short),
        hint="the ranks must meet on the job's own loopback (GLOO_SOCKET_IFNAME=lo)",
    )


def check_link_is_slow(
    shaped: Mapping[str, Any],
    unshaped: Mapping[str, Any] | None,
    *,
    rate_mbit: float,
    burst_bytes: int,
    mtu: int,
    min_link_bytes_over_burst: float = 4.0,
) -> None:
    """The token bucket's bound, on counts: in t seconds at most burst + rate·t bytes
    leave it, so an all-reduce that put L bytes on the link took at least (L − burst)/rate
    — less a few packets (``4 × (mtu + 14)``) for the ACKs that vary from one repetition to
    the next around the counted mean. Every repetition of every size with L above
    ``min_link_bytes_over_burst`` bursts must respect it; and, in the same run, the
    largest of those sizes on the unshaped loopback must have taken less than that bound
    (its median plus 4 × its spread): the qdisc made the difference."""
    rate = rate_mbit * 1e6 / 8
    slack = 4 * (mtu + 14)
    rows = []
    for i, (s, nb) in enumerate(zip(shaped["sizes"], shaped["link_bytes"], strict=True)):
        if nb < min_link_bytes_over_burst * burst_bytes:
            continue
        bound = (nb - burst_bytes - slack) / rate
        rows.append((s, nb, bound, min(shaped["seconds"][i])))
    if not rows:
        fail(
            f"{rate_mbit:g} Mbit/s is slow",
            f"no size put more than {min_link_bytes_over_burst:g} bursts on the link",
            "add larger --sizes-kb or raise --max-seconds",
        )
    slow = [r for r in rows if r[3] < r[2]]
    that(
        not slow,
        what=f"{rate_mbit:g} Mbit/s: no all-reduce beat the token bucket's bound (L − burst)/rate",
        detail="; ".join(
            f"{s / 1024:,.0f} KiB: fastest {t * 1e3:.1f} ms ≥ {b * 1e3:.1f} ms"
            for s, _, b, t in rows[-3:]
        )
        if not slow
        else "; ".join(
            f"{s / 1024:,.0f} KiB: {t * 1e3:.2f} ms < {b * 1e3:.2f} ms" for s, _, b, t in slow
        ),
        hint="the job was not inside the shaped link, or the rate is not what was set",
    )
    if unshaped is None:
        return
    by_size = dict(zip(unshaped["sizes"], unshaped["seconds"], strict=True))
    common = [(s, b) for s, _, b, _ in rows if s in by_size]
    if not common:
        return
    size, bound = common[-1]  # the largest size both measured: the widest gap
    u = by_size[size]
    that(
        median(u) + 4 * spread(u) < bound,
        what="the same all-reduce on the unshaped loopback, same run, beat that bound",
        detail=f"{size / 1024:,.0f} KiB: {median(u) * 1e3:.1f} ms + 4 × spread "
        f"{spread(u) * 1e3:.1f} ms < {bound * 1e3:.1f} ms"
        if median(u) + 4 * spread(u) < bound
        else f"{size / 1024:,.0f} KiB: {median(u) * 1e3:.1f} ms + 4 × spread "
        f"{spread(u) * 1e3:.1f} ms ≥ {bound * 1e3:.1f} ms",
        hint="if the unshaped loopback is as slow, the machine, not the link, limits the run",
    )


def check_steps_bound(
    ddp: Mapping[str, Any], *, rate_mbit: float, burst_bytes: int, mtu: int
) -> float:
    """The token bucket's bound on whole training steps: a step of each DDP variant put
    the counted bytes L on the link, so none can have taken less than (L − burst)/rate
    (less 4 packets, as :func:`check_link_is_slow`), however its communication overlaps
    its computation. Returns that bound (seconds)."""
    rate = rate_mbit * 1e6 / 8
    slack = 4 * (mtu + 14)
    rows = []
    for name, nb in ddp["link_bytes"].items():
        bound = max(0.0, (nb - burst_bytes - slack) / rate)
        rows.append((name, min(ddp["variants"][name]), bound))
    fast = [r for r in rows if r[1] < r[2]]
    that(
        not fast,
        what=f"{rate_mbit:g} Mbit/s: no DDP step beat the link's bound (L − burst)/rate",
        detail="; ".join(
            f"{name}: fastest {t * 1e3:.1f} ms {'<' if t < b else '≥'} {b * 1e3:.1f} ms"
            for name, t, b in rows
        ),
        hint="the ranks' traffic must cross the shaped link; see the byte counts above",
    )
    return max(b for _, _, b in rows)


# ----------------------------------------------------------------- notebook 2: a hook
class _Bucket:
    """What a hook reads of DDP's bucket here: its flat float32 buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _Work:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result([tensor])

    def get_future(self) -> torch.futures.Future:
        return self._future


def _run_hook_as_two_ranks(hook: Callable, grads: list[torch.Tensor]) -> tuple:
    """Run ``hook`` as rank 1 then rank 0 of a two-rank group, in this process: rank 1's
    all-reduce keeps what it sent, rank 0's adds it to its own (in the dtype sent, as
    Gloo and NCCL sum). Returns (rank 0's result, the dtypes sent)."""
    sent: list[torch.Tensor] = []
    real = dist.all_reduce

    def all_reduce(tensor, op=None, group=None, async_op=False):
        if sent:  # rank 0: the sum of both ranks' tensors, in place, as a collective does
            tensor.add_(sent[0])
        sent.append(tensor.clone())
        return _Work(tensor)

    dist.all_reduce = all_reduce
    try:
        hook(_Group(2), _Bucket(grads[1].clone())).wait()  # rank 1 sends first
        out = hook(_Group(2), _Bucket(grads[0].clone())).wait()  # rank 0 gets the sum
    finally:
        dist.all_reduce = real
    return out, [t.dtype for t in sent]


def check_bf16_hook(hook: Callable, seed: int = 0) -> float:
    """The student's hook against the uncompressed average of two ranks' gradients: sent
    in bfloat16, returned in float32, within what bfloat16 allows. Each rank's share is
    rounded once (relative error at most 2⁻⁸) and the sum once more, so the result is
    within 2⁻⁷·(|g₀| + |g₁|)/2 of the average (1 % more for the sum's own rounding);
    returns the largest error in units of that bound."""
    gen = torch.Generator().manual_seed(seed)
    # gradients spread over six decades, as a bucket's are
    scale = 10.0 ** torch.randint(-3, 3, (2, 1000), generator=gen).float()
    grads = list(torch.randn(2, 1000, generator=gen) * scale)
    out, dtypes = _run_hook_as_two_ranks(hook, grads)
    that(
        dtypes == [torch.bfloat16, torch.bfloat16],
        what="the hook all-reduces bfloat16 (2 bytes an element)",
        detail=f"it sent {', '.join(map(str, dtypes))}",
        hint="cast the bucket's buffer with .to(torch.bfloat16) before dist.all_reduce",
    )
    that(
        isinstance(out, torch.Tensor) and out.dtype == torch.float32,
        what="the hook returns the bucket's gradients in float32",
        detail=f"it returned {getattr(out, 'dtype', type(out).__name__)}",
        hint="decompress: copy the summed bfloat16 tensor back into bucket.buffer() and return it",
    )
    mean = (grads[0] + grads[1]) / 2
    bound = 2**-7 * 1.01 * (grads[0].abs() + grads[1].abs()) / 2
    worst = float(((out - mean).abs() / bound).max())
    if worst > 1.0 and torch.allclose(out, 2 * mean, rtol=2**-6):
        fail("the hook returns the average", "it returns the sum", "divide by the group's size")
    that(
        worst <= 1.0,
        what="the hook's result = the average of both ranks' gradients within bfloat16's error",
        detail=f"largest error {worst:.2f} of the bound 2⁻⁷·(|g₀| + |g₁|)/2",
        hint="divide by the group's size, round to bfloat16 once, all-reduce, copy back",
    )
    that(
        not torch.equal(out, mean),
        what="the result carries bfloat16's rounding (it was compressed)",
        hint="the values must travel in bfloat16, not float32",
    )
    return worst
