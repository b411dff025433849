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

from lab_utils.checks import count, fail, passed, spread, that
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
    must give the line back, on synthetic scattered points the least-squares line, and on
    the run's points (when given) the reference's. Returns the fit of the run's points."""
    rng = np.random.default_rng(7)
    x = np.geomspace(2e5, 4e6, 7)
    line = 5e-4 + x / 6.25e6
    cases = {
        "an exact line (α = 0.5 ms, 1/β = 50 Mbit/s)": line,
        "synthetic scattered points (that line ± 5 %)": line
        * (1 + 0.05 * rng.standard_normal(x.size)),
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
    ratios = ", ".join(
        f"{s / 1024:g} KiB {c / s:.3f}" for s, c in zip(sweep["sizes"], counted, strict=True)
    )
    that(
        not short,
        what=f"every all-reduce crossed the link: ≥ N × payload + headers (N = {procs})",
        detail=f"bytes on the link per payload byte, by size: {ratios}"
        if not short
        else "; ".join(f"{s:,} B payload: counted {c:,.0f} < {m:,.0f}" for s, c, m in short),
        hint="the ranks must meet on the job's own loopback (GLOO_SOCKET_IFNAME=lo)",
    )


def packet_slack(mtu: int) -> int:
    """The allowance of the token bucket's bounds below: one packet (``mtu`` + the 14-byte
    Ethernet header lo's packets keep). The bytes counted around a timed span are not all
    in it: the last acknowledgements (66 B each) can leave after the last rank's end, and
    the barriers around it, subtracted at their mean, vary by an acknowledgement or two."""
    return mtu + 14


def _bound_rows(
    bytes_each: Sequence[float], seconds: Sequence[float], burst_bytes: int, rate: float
) -> list[tuple[float, float, float]]:
    """(L, (L − burst)/rate, t) of every repetition: its own bytes with its own time."""
    return [(nb, (nb - burst_bytes) / rate, t) for nb, t in zip(bytes_each, seconds, strict=True)]


def _margin(nb: float, exact: float, t: float, slack_s: float) -> str:
    return (
        f"L = {nb:,.0f} B: {t * 1e3:.1f} ms against (L − burst)/rate = {exact * 1e3:.1f} ms, "
        f"margin {(t - exact) * 1e3:+.1f} ms (allowed: −{slack_s * 1e3:.1f} ms)"
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
    leave it, so an all-reduce that put L bytes on the link took at least (L − burst)/rate.
    Each repetition is held to its own bytes (``link_bytes_each``, paired with
    ``seconds``; without them, the mean ``link_bytes``), less one packet
    (:func:`packet_slack`) for the bytes counted around the span. Every repetition of
    every size with L above ``min_link_bytes_over_burst`` bursts must respect it; and, in
    the same run, the largest of those sizes on the unshaped loopback must have taken
    less than the smallest of its bounds (its median plus 4 × its spread): the qdisc made
    the difference."""
    rate = rate_mbit * 1e6 / 8
    slack = packet_slack(mtu)
    slack_s = slack / rate
    each = shaped.get("link_bytes_each")
    rows = []  # (size, [(L, exact bound, t) per repetition])
    for i, (s, nb) in enumerate(zip(shaped["sizes"], shaped["link_bytes"], strict=True)):
        if nb < min_link_bytes_over_burst * burst_bytes:
            continue
        times = shaped["seconds"][i]
        bytes_each = each[i] if each is not None else [nb] * len(times)
        rows.append((s, _bound_rows(bytes_each, times, burst_bytes, rate)))
    if not rows:
        fail(
            f"{rate_mbit:g} Mbit/s is slow",
            f"no size put more than {min_link_bytes_over_burst:g} bursts on the link",
            "add larger --sizes-kb or raise --max-seconds",
        )
    slow = [(s, r) for s, reps in rows for r in reps if r[2] < r[1] - slack_s]
    closest = [(s, min(reps, key=lambda r: r[2] - r[1])) for s, reps in rows]
    that(
        not slow,
        what=f"{rate_mbit:g} Mbit/s: no all-reduce beat the token bucket's bound (L − burst)/rate, "
        f"L its own bytes, less one packet ({slack:,} B)",
        detail="closest repetition of each size — "
        + "; ".join(f"{s / 1024:,.0f} KiB, {_margin(*r, slack_s)}" for s, r in closest[-3:])
        if not slow
        else "; ".join(f"{s / 1024:,.0f} KiB, {_margin(*r, slack_s)}" for s, r in slow),
        hint="the job was not inside the shaped link, or the rate is not what was set",
    )
    if unshaped is None:
        return
    by_size = dict(zip(unshaped["sizes"], unshaped["seconds"], strict=True))
    common = [(s, min(b - slack_s for _, b, _ in reps)) for s, reps in rows if s in by_size]
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
    ddp: Mapping[str, Any],
    *,
    rate_mbit: float,
    burst_bytes: int,
    mtu: int,
    slack_packets: int = 1,
    steps_of: str = "DDP",
) -> float:
    """The token bucket's bound on whole training steps: a step of each DDP variant put
    L bytes on the link, so none can have taken less than (L − burst)/rate, however its
    communication overlaps its computation — less ``slack_packets`` packets
    (:func:`packet_slack`). With ``link_bytes_each`` and ``spans`` (per step: its own
    bytes, and its span from the first rank's start to the last rank's end) each step is
    held to its own bytes; otherwise every time in ``variants`` to ``link_bytes``, the
    fewest bytes such a step put on the link. ``steps_of`` names whose steps they are in
    the check's line. Returns the largest exact bound (seconds)."""
    rate = rate_mbit * 1e6 / 8
    slack = slack_packets * packet_slack(mtu)
    slack_s = slack / rate
    each, spans = ddp.get("link_bytes_each"), ddp.get("spans")
    rows = []  # (name, closest (L, exact bound, t), [failing ones])
    for name, nb in ddp["link_bytes"].items():
        if each is not None and spans is not None and name in each:
            reps = _bound_rows(each[name], spans[name], burst_bytes, rate)
        else:
            times = ddp["variants"][name]
            reps = _bound_rows([nb] * len(times), times, burst_bytes, rate)
        reps = [(L, max(0.0, b), t) for L, b, t in reps]
        bad = [r for r in reps if r[2] < r[1] - slack_s]
        rows.append((name, min(reps, key=lambda r: r[2] - r[1]), bad))
    packets = "one packet" if slack_packets == 1 else f"{slack_packets} packets"
    that(
        not any(bad for _, _, bad in rows),
        what=f"{rate_mbit:g} Mbit/s: no {steps_of} step beat the link's bound (L − burst)/rate, "
        f"L its own bytes, less {packets} ({slack:,} B)",
        detail="; ".join(
            f"{name}: fastest {min(bad, key=lambda r: r[2])[2] * 1e3:.1f} ms < "
            f"{min(bad, key=lambda r: r[2])[1] * 1e3:.1f} ms − {slack_s * 1e3:.1f} ms"
            if bad
            else f"{name}: closest, {_margin(*closest, slack_s)}"
            for name, closest, bad in rows
        ),
        hint="the ranks' traffic must cross the shaped link; see the byte counts above",
    )
    return max(closest[1] for _, closest, _ in rows)


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
    """What ``dist.all_reduce(..., async_op=True)`` returns: a future that completes only
    when every rank has sent, as a real collective's does, not when the call returns."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        fail(
            "the hook returns at once, without waiting in it",
            "it called .wait() on the all-reduce inside the hook",
            "the other ranks' values arrive after the hook returned: chain the "
            "decompression with .then on the all-reduce's future",
        )
        return False


def _run_hook_as_ranks(hook: Callable, grads: list[torch.Tensor]) -> tuple:
    """Run ``hook`` once per rank in this process, as DDP calls it when given no group:
    ``process_group=None``, with ``dist.group.WORLD`` the group of ``len(grads)`` ranks.
    Each all-reduce returns a future that is NOT complete yet; only after every rank's hook
    returned are the tensors sent summed (in the dtype sent, as Gloo and NCCL sum), written
    into each rank's tensor in place and the futures completed. Then each hook's future is
    waited on. A hook that does not chain on the all-reduce's future (``.then``) thus sees
    its own values only. Returns (each rank's result, the dtypes sent)."""
    group = _Group(len(grads))
    sent: list[tuple[torch.Tensor, _Work]] = []
    real = dist.all_reduce, dist.group, dist.get_world_size

    def all_reduce(tensor, op=None, group=None, async_op=False):
        if not async_op:
            fail(
                "the hook starts the all-reduce and returns at once",
                "it called dist.all_reduce without async_op=True",
                "pass async_op=True and chain the decompression with .then on its future",
            )
        work = _Work()
        sent.append((tensor, work))
        return work

    class _World:  # dist.group as the hook sees it: WORLD is the fake group
        WORLD = group

    dist.all_reduce, dist.group = all_reduce, _World
    dist.get_world_size = lambda group=None: len(grads)
    try:
        try:
            futures = [hook(None, _Bucket(g.clone())) for g in grads]
        except AttributeError as e:
            fail(
                "the hook runs with process_group=None",
                f"it raised {e!r}",
                "DDP passes None when it was given no group: use dist.group.WORLD then",
            )
        that(
            len(sent) == len(grads),
            what="the hook starts one all-reduce per bucket",
            detail=f"{len(sent)} all-reduces from {len(grads)} ranks' hooks",
            hint="one dist.all_reduce(..., async_op=True) of the compressed buffer",
        )
        if sent:  # every rank has sent: the collective completes
            total = sent[0][0].clone()
            for tensor, _ in sent[1:]:
                total.add_(tensor)
            for tensor, work in sent:
                tensor.copy_(total)
                work.future.set_result([tensor])
        out = [f.wait() for f in futures]
    finally:
        dist.all_reduce, dist.group, dist.get_world_size = real
    return out, [t.dtype for t, _ in sent]


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
    outs, dtypes = _run_hook_as_ranks(hook, grads)
    out = outs[0]
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
    if worst > 1.0 and torch.allclose(out, grads[0] / 2, rtol=2**-6):
        fail(
            "the hook returns the all-reduce's result",
            "it returns its own rank's share: the copy back ran before the other rank's "
            "values arrived",
            "the all-reduce completes after the hook returned: return its future chained "
            "with .then(...) that copies the result into the bucket's buffer",
        )
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
    that(
        all(torch.equal(o, out) for o in outs),
        what="every rank ends with the same gradients",
        hint="return the all-reduce's result, chained with .then",
    )
    return worst


# ------------------------------------------ notebooks 2 and 3: training at each rate
def check_counts_same_at_every_rate(runs: Mapping[Any, Mapping[str, Mapping[str, Any]]]) -> None:
    """A same-run count: ``runs[rate][method]["bytes_by_step"]`` (what each step
    all-reduced, counted) is the same at every rate. The link decides how long the
    bytes take, never how many there are; a difference means a run did other work."""
    rates = list(runs)
    first = runs[rates[0]]
    differ = [
        (method, r)
        for r in rates[1:]
        for method in first
        if runs[r].get(method, {}).get("bytes_by_step") != first[method]["bytes_by_step"]
    ]
    name = {r: "unshaped" if r is None else f"{r:g} Mbit/s" for r in rates}
    that(
        not differ and all(set(runs[r]) == set(first) for r in rates),
        what="each method all-reduced the same bytes at every rate ("
        + ", ".join(name[r] for r in rates)
        + ")",
        detail=f"{len(first)} methods, {sum(len(m['bytes_by_step']) for m in first.values())} "
        "steps compared"
        if not differ
        else "; ".join(f"{m} at {name[r]} differs from {name[rates[0]]}" for m, r in differ),
        hint="every rate must run the same methods on the same batches",
    )


def check_training_steps_bound(
    runs: Mapping[str, Mapping[str, Any]], *, rate_mbit: float, burst_bytes: int, mtu: int
) -> float:
    """The token bucket's bound on training steps (:func:`check_steps_bound`), for each
    method of ``runs`` (``{name: run}``, a run's ``link_bytes_by_step`` and ``seconds``
    per step): its steps grouped by what they all-reduced (PowerSGD's first steps send in
    full, local SGD's steps between averages nothing), each group's fewest link bytes
    against its fastest step. Returns the largest bound (seconds)."""
    grouped: dict[str, dict[str, Any]] = {"link_bytes": {}, "variants": {}}
    for name, run in runs.items():
        if run.get("link_bytes_by_step") is None:
            fail(f"{name}: bytes on the link", "not counted: the run was not on a link of its own")
        sizes = sorted({b for b in run["bytes_by_step"] if b})
        for size in sizes:
            steps = [s for s, b in enumerate(run["bytes_by_step"]) if b == size]
            label = name if len(sizes) == 1 else f"{name} ({size:,} B steps)"
            grouped["link_bytes"][label] = min(run["link_bytes_by_step"][s] for s in steps)
            grouped["variants"][label] = [run["seconds"][s] for s in steps]
    return check_steps_bound(
        grouped,
        rate_mbit=rate_mbit,
        burst_bytes=burst_bytes,
        mtu=mtu,
        slack_packets=4,
        steps_of=", ".join(runs),
    )


# ------------------------------------------ notebook 5: what to use when
def predicted_bytes_by_step(model: Mapping[str, Any], run: Mapping[str, Any]) -> list[int]:
    """What each step of ``run`` (a ``run`` event of scripts/compare_methods.py) must
    all-reduce, from the model's gradients (``model``, its ``model`` event): DDP every
    gradient in float32 (``grad_bytes``); bf16 half of that; PowerSGD
    ``lab7_compression.bucket_bytes`` of DDP's buckets (uncompressed before
    ``start_iter``); local SGD and DiLoCo every weight in float32 after steps H, 2H, …
    and nothing in between (1/H of DDP's bytes)."""
    from lab7_compression import bucket_bytes

    steps, full, method = model["steps"], model["grad_bytes"], run["method"]
    if method == "ddp":
        return [full] * steps
    if method == "bf16":
        return [full // 2] * steps
    if method == "powersgd":
        return [
            sum(
                bucket_bytes(
                    b, "powersgd", rank=model["rank"], compressing=s >= model["start_iter"]
                )
                for b in run["shapes_by_bucket"]
            )
            for s in range(steps)
        ]
    if method in ("local", "diloco"):
        return [full if (s + 1) % run["period"] == 0 else 0 for s in range(steps)]
    raise ValueError(f"no method {method!r}: ddp, bf16, powersgd, local or diloco")


def check_compare_bytes(model: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> None:
    """A count, per method of ``runs`` (``{method: run}``, one rate): every step's
    all-reduce bytes equal :func:`predicted_bytes_by_step`, exactly."""
    for method, run in runs.items():
        want, got = predicted_bytes_by_step(model, run), run["bytes_by_step"]
        wrong = [s for s, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        per_step = sum(got) / len(got)
        that(
            not wrong,
            what=f"{method}: every step's all-reduce bytes as predicted",
            detail=f"{per_step:,.0f} B per step on average, {per_step / model['grad_bytes']:.3f} "
            "of DDP's"
            if not wrong
            else f"step {wrong[0]}: counted {got[wrong[0]]:,} B, predicted {want[wrong[0]]:,} B",
            hint="the method sent more or less than its algorithm says: see notebooks 2–4",
        )


def time_to_reach(losses: Sequence[float], seconds: Sequence[float], target: float) -> float | None:
    """The training time (seconds, the steps' own times summed) before the first loss at
    most ``target``. ``losses[i]`` is measured in step i's forward, *before* its update
    (``steps.run_steps``): reaching it took steps 0 … i − 1, ``seconds[:i]``, not step i
    itself. ``None`` if no loss is at most ``target``."""
    i = steps_to_reach(losses, target)
    return None if i is None else float(sum(seconds[:i]))


def steps_to_reach(losses: Sequence[float], target: float) -> int | None:
    """How many steps were taken before the first loss at most ``target`` (its index:
    ``losses[i]`` is measured before step i's update); ``None`` if none is."""
    return next((i for i, x in enumerate(losses) if x <= target), None)


def running_mean(losses: Sequence[float], window: int) -> list[float]:
    """The mean of each loss and the ``window`` − 1 before it (fewer at the start): one
    batch's loss is noisy, and every method sees the same batches, so a target on single
    losses is reached by all on the same easy batch."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare_table(runs: Mapping[str, Mapping[str, Any]], window: int) -> dict[str, Any]:
    """The table of one rate's runs (``{method: run}``): per method its mean step time,
    bytes per step, total time, last training loss, held-out loss, and the steps and time
    to the target — the highest of the methods' lowest *smoothed* training losses
    (:func:`running_mean` over ``window`` steps), which every method's smoothed loss
    reached. ``order`` lists the methods by time to the target; ``winner`` is the first,
    or ``"tie"`` when the second is within the run's spread: one step's time (the longest
    step either of the two took before the target)."""
    smooth = {m: running_mean(r["losses"], window) for m, r in runs.items()}
    target = max(min(s) for s in smooth.values())
    rows = {}
    for m, r in runs.items():
        steps = steps_to_reach(smooth[m], target)
        rows[m] = {
            "optimizer": r["optimizer"],
            # the mean: a local SGD or DiLoCo step that averages is one in H
            "step_s": sum(r["seconds"]) / len(r["seconds"]),
            "bytes_per_step": sum(r["bytes_by_step"]) / len(r["bytes_by_step"]),
            "total_s": sum(r["seconds"]),
            "final_loss": r["losses"][-1],
            "held_out_loss": r["held_out_loss"],
            "to_target_steps": steps,
            "to_target_s": float(sum(r["seconds"][:steps])),
            "longest_step_s": max(r["seconds"][: max(steps, 1)]),
        }
    order = sorted(rows, key=lambda m: rows[m]["to_target_s"])
    first, second = order[0], order[1]
    spread = max(rows[first]["longest_step_s"], rows[second]["longest_step_s"])
    gap = rows[second]["to_target_s"] - rows[first]["to_target_s"]
    winner = "tie" if gap < spread else first
    return {
        "target": target,
        "window": window,
        "rows": rows,
        "order": order,
        "gap_s": gap,
        "spread_s": spread,
        "winner": winner,
    }


def link_bound_to_target(
    run: Mapping[str, Any], steps: int, *, rate_mbit: float, burst_bytes: int, mtu: int
) -> float:
    """The least time the first ``steps`` steps of ``run`` (those taken before the loss
    that reached the target, :func:`steps_to_reach`) can have taken on the link, from
    counts alone: a step that put L bytes on the link took at least (L − burst)/rate,
    less 4 packets (:func:`check_steps_bound`'s slack), however fast its computation."""
    rate, slack = rate_mbit * 1e6 / 8, 4 * (mtu + 14)
    return sum(
        max(0.0, (nb - burst_bytes - slack) / rate) for nb in run["link_bytes_by_step"][:steps]
    )


LOW_BYTE = ("powersgd", "local", "diloco")  # the methods that send far less than DDP a step


def beat_ddp_by_the_link(
    table: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    *,
    rate_mbit: float,
    burst_bytes: int,
    mtu: int,
) -> dict[str, tuple[float, float]]:
    """For each low-byte method of the table (:data:`LOW_BYTE`): ``(its measured time to
    the target, the least time DDP can have needed to reach it on this link)``. Where the
    first is below the second, that method got there before DDP could have, a claim
    resting on DDP's counted bytes and the token bucket, not on two noisy times."""
    rows = table["rows"]
    bound = link_bound_to_target(
        runs["ddp"],
        rows["ddp"]["to_target_steps"],
        rate_mbit=rate_mbit,
        burst_bytes=burst_bytes,
        mtu=mtu,
    )
    return {m: (rows[m]["to_target_s"], bound) for m in LOW_BYTE if m in rows}


# ----------------------------------------------------------------- notebook 4: DiLoCo
def _run_outer_as_two_ranks(fn: Callable, before: list, afters: list) -> tuple[Any, int]:
    """Run ``fn(before, after, 2)`` as rank 1 then rank 0 of a two-rank group, in this
    process: rank 0's i-th all-reduce adds what rank 1 sent in its i-th (a sum, in place,
    as a collective does). Returns (rank 0's result, how many all-reduces rank 1 made)."""
    sent: list[torch.Tensor] = []
    received = [0]
    rank = [1]
    real = dist.all_reduce

    def all_reduce(tensor, op=None, group=None, async_op=False):
        # a sum, like the real default: any other op (MAX, AVG, …) fails by name here,
        # rather than being summed anyway and passing for the wrong reason
        if op not in (None, dist.ReduceOp.SUM):
            fail(
                "pseudo_gradient's all-reduces",
                f"op={op} (not a sum)",
                "all-reduce with the default op, a sum, then divide by world_size",
            )
        if rank[0] == 1:
            sent.append(tensor.clone())
        else:
            i = received[0]
            received[0] += 1
            if i >= len(sent) or sent[i].shape != tensor.shape:
                fail(
                    "pseudo_gradient's all-reduces",
                    "the ranks' all-reduces do not pair up (another count or shape)",
                    "every rank all-reduces the same tensors in the same order",
                )
            tensor.add_(sent[i])
        return _Work(tensor) if async_op else None

    dist.all_reduce = all_reduce
    try:
        fn([b.clone() for b in before], [a.clone() for a in afters[1]], 2)
        rank[0] = 0
        out = fn(before, afters[0], 2)
    finally:
        dist.all_reduce = real
    return out, len(sent)


def _close_all(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    return all(
        g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))
        for g, w in zip(got, want, strict=True)
    )


def check_pseudo_gradient(fn: Callable, seed: int = 0) -> float:
    """``fn(before, after, world_size)``: DiLoCo's outer gradient, the mean over the ranks
    of θ_before − θ_after, run as two ranks in this process against that mean, with each
    plausible wrong answer named. Returns its size (the mean Δ's largest element)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5,), (3, 4, 2)]
    before = [torch.randn(s, generator=gen) for s in shapes]
    # each rank's H inner steps moved it a little, each its own way
    afters = [[b - 0.01 * torch.randn(b.shape, generator=gen) for b in before] for _ in range(2)]
    kept = [t.clone() for t in before], [[a.clone() for a in r] for r in afters]
    got, calls = _run_outer_as_two_ranks(fn, before, afters)
    what = "pseudo_gradient = mean over ranks of θ_before − θ_after"
    if not (
        isinstance(got, list | tuple)
        and len(got) == len(before)
        and all(isinstance(g, torch.Tensor) for g in got)
    ):
        fail(what, f"returned {type(got).__name__}", "return a list: one tensor per parameter")
    if not (
        all(torch.equal(b, k) for b, k in zip(before, kept[0]))
        and all(torch.equal(a, k) for a, k in zip(afters[0], kept[1][0]))
    ):
        fail(
            what,
            "it changed `before` or `after` in place",
            "before is the global weights the outer step still needs: compute new tensors",
        )
    mine = [b - a for b, a in zip(before, afters[0])]
    theirs = [b - a for b, a in zip(before, afters[1])]
    ref = [(m + t) / 2 for m, t in zip(mine, theirs)]
    if _close_all(got, ref):
        size = max(float(r.abs().max()) for r in ref)
        passed(what, f"{calls} all-reduce(s); largest element {size:.4g}")
        return size
    mistakes = [
        ([-r for r in ref], "the sign is flipped: Δ = θ_before − θ_after, not after − before"),
        ([2 * r for r in ref], "summed over the ranks, not averaged: divide by world_size"),
        (mine, "this rank's Δ alone: all-reduce it over the ranks (dist.all_reduce)"),
        ([-m for m in mine], "this rank's after − before alone: flip it and all-reduce it"),
        ([m / 2 for m in mine], "divided by world_size but never all-reduced"),
        (
            [(a + c) / 2 for a, c in zip(afters[0], afters[1])],
            "the average of the weights (local SGD's), not of the deltas θ_before − θ_after",
        ),
    ]
    for wrong, message in mistakes:
        if _close_all(got, wrong):
            fail(what, message, "Δ = before − after, dist.all_reduce(Δ), Δ / world_size")
    if calls == 0:
        fail(what, "no all-reduce was made", "average Δ over the ranks with dist.all_reduce")
    fail(what, "not the mean of θ_before − θ_after", "Δ = before − after, all-reduce, / N")
    return 0.0


def diloco_bytes(
    steps: int, period: int, fragment_numel: Sequence[int], element_bytes: int = 4
) -> list[int]:
    """The all-reduce bytes of each step of (Streaming) DiLoCo with len(fragment_numel)
    fragments: every period/F steps the next fragment in turn sends its pseudo-gradient,
    ``element_bytes`` a parameter (F = 1: the whole model every H steps)."""
    every = period // len(fragment_numel)
    out, syncs = [], 0
    for step in range(1, steps + 1):
        if step % every:
            out.append(0)
            continue
        out.append(element_bytes * fragment_numel[syncs % len(fragment_numel)])
        syncs += 1
    return out


def check_diloco_bytes(run: Mapping[str, Any]) -> None:
    """A count: every step's all-reduce bytes equal :func:`diloco_bytes`' prediction from
    the fragments' sizes."""
    sent = list(run["bytes_by_step"])
    want = diloco_bytes(len(sent), run["period"], run["fragment_numel"])
    wrong = [(s, g, w) for s, (g, w) in enumerate(zip(sent, want), 1) if g != w]
    that(
        not wrong,
        what=f"DiLoCo H = {run['period']}, F = {run['fragments']}: every step's bytes as predicted",
        detail=f"{sum(sent):,} bytes in {sum(1 for b in sent if b)} syncs"
        if not wrong
        else "; ".join(f"step {s}: {g:,} ≠ {w:,}" for s, g, w in wrong[:4]),
        hint="one fragment a sync, in turn, every H/F steps; 4 bytes a parameter",
    )


def check_streaming(diloco: Mapping[str, Any], streaming: Mapping[str, Any]) -> float:
    """Counts: Streaming DiLoCo's largest sync sends its largest fragment (4 bytes a
    parameter), no more; in all it sends what DiLoCo sends; DiLoCo's sync sends the whole
    model. Returns how many times smaller the peak is."""
    for run in (diloco, streaming):
        check_diloco_bytes(run)
    numel = sum(diloco["fragment_numel"])
    count(max(diloco["bytes_by_step"]), 4 * numel, what="DiLoCo's sync sends the whole model")
    count(
        max(streaming["bytes_by_step"]),
        4 * max(streaming["fragment_numel"]),
        what=f"Streaming DiLoCo (F = {streaming['fragments']}): the peak sync is the largest fragment",
    )
    count(
        sum(streaming["bytes_by_step"]),
        sum(diloco["bytes_by_step"]),
        what="Streaming DiLoCo sends in all what DiLoCo sends",
    )
    return max(diloco["bytes_by_step"]) / max(streaming["bytes_by_step"])


def check_outer_lr_one_is_local_sgd(agreements: Sequence[Mapping[str, Any]]) -> float:
    """DiLoCo with outer SGD lr 1 and no momentum is local SGD: θ − 1·mean(θ − θᵢ) =
    mean θᵢ. After one outer step (the same AdamW steps before it, bit for bit) the weights
    must agree to float32 rounding (10⁻⁶ of the largest weight), and every other outer
    setting of the run must differ by more than 10⁻⁴ of it (the check tells them apart);
    at the end, after AdamW has amplified the rounding, the equal one must still be 10×
    closer than any wrong one. Returns the first difference in units of the largest weight."""
    same = [a for a in agreements if a["outer_lr"] == 1 and a["outer_momentum"] == 0]
    wrong = [a for a in agreements if a not in same]
    if len(same) != 1 or not wrong:
        fail("outer lr 1 = local SGD", "the run has no (1, 0) check and a wrong answer beside it")
    eq = same[0]
    scale = eq["max_abs_weight"]
    that(
        eq["first_sync_diff"] <= 1e-6 * scale,
        what=f"outer lr 1, no momentum, H = {eq['period']}: local SGD's weights after one outer step",
        detail=f"largest difference {eq['first_sync_diff']:.2e} (largest weight {scale:.2f})",
        hint="Δ = θ_before − θ_after averaged over ranks; θ ← θ − lr·Δ; restart from θ",
    )
    for a in wrong:
        that(
            a["first_sync_diff"] > 1e-4 * scale,
            what=f"outer lr {a['outer_lr']:g}, momentum {a['outer_momentum']:g} is not local SGD",
            detail=f"largest difference {a['first_sync_diff']:.2e} after one outer step",
            hint="the check must tell a wrong outer step apart",
        )
    closest = min(a["max_abs_diff"] for a in wrong)
    that(
        10 * eq["max_abs_diff"] < closest,
        what="at the end, (1, 0) is still far closer to local SGD than any other setting",
        detail=f"{eq['max_abs_diff']:.2e} against at least {closest:.2e}",
        hint="a small rounding difference grows under AdamW, but not to a wrong step's",
    )
    return eq["first_sync_diff"] / scale
