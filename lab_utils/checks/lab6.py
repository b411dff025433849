"""Self-checks for Lab 6: FLOPs of a training step against PyTorch's counter, the
roofline's ridge point, fp16 loss scaling, and a block's saved activations against the
saved-tensor meter. Each raises :class:`~lab_utils.checks.CheckFailed` when it does not
hold, naming the likely mistake.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from lab_utils import flops, models, saved_bytes
from lab_utils.checks import fail, passed
from lab_utils.solutions import lab6 as reference


# --------------------------------------------------------------------- 01–03
def counted_transformer_flops(
    n_layers: int, d_model: int, vocab: int, batch: int, seq_len: int, n_heads: int = 4
) -> int:
    """FLOPs PyTorch's counter sees in one training step of ``char_transformer``
    (on the meta device: the count depends on shapes only)."""
    with torch.device("meta"):
        model = models.build(
            "char_transformer",
            vocab=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=n_layers,
            max_len=seq_len,
        )
        x = torch.zeros(batch, seq_len, dtype=torch.long)

    def step() -> None:
        F.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()

    return flops.count_flops(step)


def counted_cnn_flops(width: int, batch: int, image_size: int = 28) -> int:
    """FLOPs PyTorch's counter sees in one training step of ``fmnist_cnn`` (meta device)."""
    with torch.device("meta"):
        model = models.build("fmnist_cnn", width=width, image_size=image_size)
        x = torch.zeros(batch, 1, image_size, image_size)
        y = torch.zeros(batch, dtype=torch.long)
    return flops.count_flops(lambda: F.cross_entropy(model(x), y).backward())


def _transformer_mistake(got: int, shape: tuple[int, int, int, int, int]) -> str:
    """The hint for a wrong transformer count: which usual mistake gives ``got``."""
    n_layers, d, vocab, b, s = shape
    want = reference.transformer_train_flops(*shape)
    attention = n_layers * 12 * b * s * s * d
    dense = want - attention
    known = {
        want // 3: "that is the forward pass only: the backward costs twice the forward "
        "(input gradient and weight gradient), so a step is 3× the forward",
        dense: "the attention products are missing: QKᵀ and softmax·V cost 2·s²·d each per "
        "sequence and layer in the forward, 3× that per step",
        dense + attention // 2: "the causal mask does not halve the work: the full s×s "
        "matrix is computed, then masked",
        want + 6 * vocab * d * b * s: "the embedding is a look-up, not a matrix product: "
        "count only the linear layers' weights",
        want - 6 * vocab * d * b * s: "the head (d → vocab) is a linear layer too",
    }
    return known.get(
        got,
        "N = 12·d²·L + d·vocab linear weights; 6·N per token; plus "
        "attention's 12·s²·d·L per sequence",
    )


def check_transformer_flops(fn: Callable) -> None:
    """The student's count equals PyTorch's counter on several shapes, exactly."""
    for shape in ((1, 32, 96, 2, 16), (2, 64, 96, 3, 32), (3, 48, 50, 2, 24)):
        got, counted = fn(*shape), counted_transformer_flops(*shape)
        if not isinstance(got, int | float) or int(got) != counted:
            fail(
                "transformer_train_flops",
                f"(n_layers, d_model, vocab, batch, seq_len) = {shape}: you counted {got!r}, "
                f"PyTorch's counter {counted:,}",
                _transformer_mistake(int(got or 0), shape),
            )
    passed("transformer_train_flops: equal to FlopCounterMode on 3 shapes")


def check_cnn_flops(fn: Callable) -> None:
    """The student's count equals PyTorch's counter for several widths and batches."""
    for width, batch in ((4, 2), (8, 3), (16, 1)):
        got, counted = fn(width, batch), counted_cnn_flops(width, batch)
        if isinstance(got, int | float) and int(got) == counted:
            continue
        first = 2 * 9 * 1 * width * 28 * 28 * batch
        hint = (
            "the first convolution's input is the data: it needs no input gradient, so "
            "that layer costs 2× its forward, not 3×"
            if got == counted + first
            else "3×3 conv: 2·9·C_in·C_out·H·W per image forward (H, W of its output: 28, 14, "
            "7); the step is 3× that except for the first conv; classifier 6·in·out"
        )
        fail(
            "cnn_train_flops",
            f"width={width}, batch={batch}: you counted {got!r}, PyTorch's counter {counted:,}",
            hint,
        )
    passed("cnn_train_flops: equal to FlopCounterMode for 3 widths")


def check_memory_bound(fn: Callable, peak_flops: float, bandwidth: float) -> None:
    """Operations on both sides of the ridge point, and one on it, are classified right."""
    ridge = peak_flops / bandwidth
    for intensity in (ridge / 100, ridge / 2, ridge, ridge * 2, ridge * 100):
        got, want = bool(fn(intensity, peak_flops, bandwidth)), intensity < ridge
        if got != want:
            fail(
                "memory_bound",
                f"intensity {intensity:.3g} FLOP/byte with a ridge point at "
                f"{ridge:.3g}: you said memory-bound={got}",
                "memory-bound when FLOPs per byte < peak FLOP/s ÷ bandwidth (bytes/s)",
            )
    passed(f"memory_bound: the ridge point at {ridge:.3g} FLOP/byte separates the two")


def _log_uniform_grads(n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    magnitude = 10 ** (torch.rand(n, generator=g) * 10 - 11)  # 1e-11 … 1e-1
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return magnitude * sign


def check_fp16_gradients(fn: Callable) -> None:
    """Equal to scale → fp16 → fp32 → unscale, element by element, for three scales."""
    grads = _log_uniform_grads()
    for scale in (1.0, 2.0**10, 2.0**16):
        got = fn(grads.clone(), scale)
        want = reference.fp16_gradients(grads, scale)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            fail("fp16_gradients", f"returned {type(got).__name__}", "return a tensor like grads")
        if torch.equal(got.float(), want):
            continue
        zeros, want_zeros = int((got == 0).sum()), int((want == 0).sum())
        unscaled = reference.fp16_gradients(grads, 1.0)
        if scale != 1.0 and torch.equal(got.float(), unscaled):
            hint = (
                "the loss scale is missing: multiply by the scale before the cast to fp16 "
                "(so small values stay representable) and divide after"
            )
        elif torch.equal(got.float(), want * scale):
            hint = "unscale: divide by the scale after casting back to fp32"
        else:
            hint = "(grads · scale) → float16 → float32, then ÷ scale"
        fail(
            "fp16_gradients",
            f"scale {scale:g}: {zeros} of {grads.numel()} gradients are zero "
            f"in your result, {want_zeros} with scaling done right",
            hint,
        )
    passed("fp16_gradients: scaling keeps the gradients fp16 alone would flush to zero")


def block_saved_bytes(seq_len: int, batch: int, d_model: int, n_heads: int) -> int:
    """Bytes one ``char_transformer`` block saves for backward (fp32, CPU), measured."""
    torch.manual_seed(0)
    block = models.Block(d_model, n_heads)
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)
    return saved_bytes.saved_bytes(lambda: block(x), exclude=block.parameters())


def check_layer_activation_bytes(fn: Callable) -> None:
    """The student's formula equals the meter's count for one block on several shapes."""
    for s, b, h, a in ((16, 2, 32, 4), (32, 3, 64, 2), (24, 1, 48, 6)):
        got, measured = fn(s, b, h, a), block_saved_bytes(s, b, h, a)
        if isinstance(got, int | float) and int(got) == measured:
            continue
        korthikanti = s * b * h * (34 + 5 * a * s / h)
        if got == korthikanti:
            hint = (
                "that is Korthikanti et al.'s 16-bit count with dropout and an s×s attention "
                "matrix; this block is fp32 (4 bytes), has no dropout, and its fused "
                "attention keeps only a log-sum-exp per head and position"
            )
        elif got == measured // 2:
            hint = "fp32 values take 4 bytes, not 2"
        elif got == measured - 4 * (4 * s * b + a * s * b):
            hint = "add the small tensors: LayerNorm's mean and 1/std per token, attention's log-sum-exp"
        else:
            hint = (
                "list what each op keeps: LN input and output, q, k, v, attention output, "
                "the residual sum, fc1 and GELU outputs (4h wide), LN statistics, log-sum-exp"
            )
        fail(
            "layer_activation_bytes",
            f"(s, b, h, a) = {(s, b, h, a)}: you said {got!r} bytes, "
            f"the meter counted {measured:,}",
            hint,
        )
    passed("layer_activation_bytes: equal to the saved-tensor meter on 3 shapes")


# --------------------------------------------------------------------- 04–06
def check_make_buckets(fn: Callable) -> None:
    """The student's buckets equal DDP's rule on several parameter lists and caps."""
    cases = [([40, 8, 40, 8, 16], 48), ([100, 4, 100, 4], 64), ([4] * 10, 12), ([64, 64], 1000)]
    for sizes, cap in cases:
        got, want = fn(list(sizes), cap), reference.make_buckets(list(sizes), cap)
        if got == want:
            continue
        flat = [i for b in (got or []) for i in b] if isinstance(got, list) else []
        forward = [
            [len(sizes) - 1 - i for i in b]
            for b in reference.make_buckets(list(reversed(sizes)), cap)
        ]
        if sorted(flat) != list(range(len(sizes))):
            hint = "every parameter index must be in exactly one bucket"
        elif got == forward:
            hint = (
                "backward produces the LAST layer's gradients first: fill buckets from the "
                "last parameter to the first, so the first bucket is ready earliest"
            )
        elif any(sum(sizes[i] for i in b) > cap and len(b) > 1 for b in got):
            hint = f"a bucket of several parameters passed the cap of {cap} bytes"
        else:
            hint = "close a bucket only when the next parameter would not fit in it"
        fail("make_buckets", f"sizes {sizes}, cap {cap}: you made {got}, DDP makes {want}", hint)
    passed(f"make_buckets: DDP's buckets on {len(cases)} parameter lists")


def _bytes_mistake(strategy: str, got: float, kw: dict) -> str:
    """Name the usual mistake behind a wrong per-rank byte count."""
    n, grads = kw["n"], kw["psi"] * 4
    act = kw["batch"] * kw["seq_len"] * kw["d_model"] * 4
    ring = (n - 1) / n
    layers = kw["layers"]
    if strategy in ("tp", "pp"):
        gradient_answers = [
            reference.bytes_sent_per_rank(s, **kw) for s in ("ddp", "zero1", "fsdp")
        ]
        gradient_answers += [grads, 2 * grads, ring * grads]
        wrong = [
            (
                v,
                "tensor and pipeline parallelism send activations (batch × seq_len × d "
                "values), not the Ψ gradients",
            )
            for v in gradient_answers
        ]
        wrong += [  # the first that matches is named (some coincide when n = 2)
            (
                2 * ring * 2 * layers * act,
                "backward all-reduces too: two per block forward, two backward",
            ),
            ((n - 1) * act / n, "the gradient of the boundary activation comes back in backward"),
            (
                ring * 4 * layers * act,
                "each of those all-reduces costs 2(n−1)/n of its size per rank",
            ),
            (2 * (n - 1) * act, "average over the n ranks: only n − 1 boundaries send"),
        ]
        default = "count the all-reduces of a (batch, seq_len, d) activation per block, or the sends per boundary"
    else:
        wrong = [
            (
                2 * ring * grads,
                {
                    "zero1": "ZeRO-1 also broadcasts each updated shard to the others",
                    "fsdp": "FSDP gathers the weights twice (forward, and again in "
                    "backward: it freed them) and reduce-scatters the gradients",
                }.get(strategy, ""),
            ),
            (2 * grads, "the ring sends (n−1)/n of the data per rank and per pass, not all of it"),
            (
                ring * grads,
                "an all-reduce is a reduce-scatter followed by an all-gather: 2(n−1)/n·S",
            ),
            (grads, "count bytes (4 per fp32 value) and the ring's 2(n−1)/n for an all-reduce"),
        ]
        default = "data parallelism sends the Ψ gradients (and ZeRO-1 / FSDP the Ψ weights too)"
    for value, why in wrong:
        if why and abs(got - value) <= 1e-6 * max(1.0, value):
            return why
    return default


def check_bytes_sent_per_rank(fn: Callable) -> None:
    """The student's prediction equals the reference for every strategy on 3 shapes."""
    shapes = [
        dict(n=2, psi=214_496, batch=16, seq_len=32, d_model=64, layers=4),
        dict(n=4, psi=1_000_000, batch=8, seq_len=64, d_model=128, layers=2),
        dict(n=8, psi=123_456, batch=32, seq_len=16, d_model=32, layers=6),
    ]
    for kw in shapes:
        for strategy in ("ddp", "zero1", "fsdp", "tp", "pp"):
            want = reference.bytes_sent_per_rank(strategy, **kw)
            got = fn(strategy, **kw)
            if isinstance(got, int | float) and abs(got - want) <= 1e-6 * max(1.0, want):
                continue
            detail = f"{strategy} with {kw}: you said {got!r}, expected {want:,.0f}"
            fail(
                "bytes_sent_per_rank",
                detail,
                _bytes_mistake(strategy, got, kw)
                if isinstance(got, int | float)
                else "return a number of bytes",
            )
    passed("bytes_sent_per_rank: DDP, ZeRO-1, FSDP, tensor and pipeline parallelism on 3 shapes")


def ring_bytes_per_rank(counted: dict[str, int], n: int, p2p_total: int = 0) -> float:
    """Bytes sent per rank (averaged) from the full-tensor sizes a run handed to each kind
    of collective: 2(n−1)/n for an all-reduce, (n−1)/n for the others; point-to-point
    sends counted byte for byte and shared over the ranks."""
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": (n - 1) / n,
    }
    unknown = set(counted) - set(factor) - {"p2p"}
    if unknown:
        fail("ring_bytes_per_rank", f"no ring cost for {sorted(unknown)}")
    return sum(factor[k] * b for k, b in counted.items() if k != "p2p") + p2p_total / n


def check_hand_ddp(run: dict, *, tol: float = 1e-6) -> None:
    """HandDDP's averaged gradients (every step) and weights (after the last) equal
    DistributedDataParallel's, from a start that differed on every rank."""
    g, w = run["grad_rel_err"], run["weight_rel_err"]
    if g <= tol and w <= tol:
        passed(
            f"hand-made DDP = DistributedDataParallel after {run['steps']} steps",
            f"relative differences: gradients {g:.1e}, weights {w:.1e}",
        )
        return
    n = run.get("procs", 2)
    if abs(g - (n - 1)) < 1e-3:
        hint = (
            f"the gradients are {n}× DDP's: all-reduce sums, so divide by the number of "
            "ranks (the average) before copying back"
        )
    elif g <= tol:
        hint = "the gradients agree but the weights do not: did every rank start from rank 0's weights?"
    else:
        hint = (
            "a bucket was sent before all its gradients had arrived, or copied back into the "
            "wrong parameters: launch a bucket only when its last gradient is ready"
        )
    fail(
        "hand-made DDP = DistributedDataParallel",
        f"after {run['steps']} steps gradients differ by {g:.2e}, weights by {w:.2e} (relative; "
        f"allowed {tol:.0e})",
        hint,
    )
