"""Self-checks for Lab 6: FLOPs of a training step against PyTorch's counter, the
roofline's ridge point, fp16 loss scaling, and a block's saved activations against the
saved-tensor meter. Each raises :class:`~lab_utils.checks.CheckFailed` when it does not
hold, naming the likely mistake.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch.nn import functional as F

import lab6_solutions as reference
from lab_utils import flops, models, saved_bytes
from lab_utils.checks import fail, passed


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
        dense + attention // 2: "count the full s×s products, as MFU conventionally does "
        "(PaLM's MFU, Chowdhery et al. 2022, App. B): do not halve them for the causal mask, "
        "even where a fused kernel skips the masked half",
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


# Two machines whose ridge points tell the mistakes apart: a GPU-like one where bf16 has
# the higher roof (ridges 10 and 40 FLOP/byte), a CPU that emulates bf16 (10 and 2.5).
_ROOF_MACHINES = (
    ({torch.float32: 1e12, torch.bfloat16: 4e12}, 1e11),
    ({torch.float32: 1e11, torch.bfloat16: 2.5e10}, 1e10),
)
# (m, k, n, dtype, machine): fp32 compute-bound first, then fp32 memory-bound, then bf16
# products whose answer changes with the ridge of the dtype (order matters for the hints).
_ROOF_CASES = (
    (96, 96, 96, torch.float32, 0),  # I = 16 > 10
    (512, 64, 256, torch.float32, 0),  # a thin GEMM: I = 2·512·64·256 / (4·180224) ≈ 23.3 > 10
    (48, 48, 48, torch.float32, 0),  # I = 8 < 10
    (48, 48, 48, torch.bfloat16, 0),  # I = 16 < 40 (but > fp32's 10)
    (96, 96, 96, torch.bfloat16, 0),  # I = 32 < 40
    (192, 192, 192, torch.bfloat16, 0),  # I = 64 > 40
    (12, 12, 12, torch.bfloat16, 1),  # I = 4 > 2.5 (but < fp32's 10)
    (12, 12, 12, torch.float32, 1),  # I = 2 < 10
)


def _intensity_mistake(got: float, m: int, k: int, n: int, dtype: torch.dtype) -> str:
    """Name the usual mistake behind a wrong arithmetic intensity of a matmul."""
    e, flop = dtype.itemsize, 2 * m * k * n
    elements = m * k + k * n + m * n
    known = [
        (
            flop / (e * (m * k + k * n)),
            "the output is written too: count its m·n elements "
            "besides the two inputs (bytes moved = inputs read + output written)",
        ),
        (
            flop / (e * (elements + m * n)),
            "the product writes its output once and never reads it (m·n elements, not 2·m·n)",
        ),
        (flop / (e * (m * k + m * n)), "both inputs are read: the k×n weight too"),
        (
            flop / (4 * elements),
            f"the element size is dtype.itemsize ({e} bytes for "
            f"{str(dtype).split('.')[-1]}), not 4",
        ),
        (flop / (8 * e * elements), f"bytes, not bits: an element of this dtype is {e} bytes"),
        (flop / (8 * 4 * elements), f"bytes, not bits: an element of this dtype is {e} bytes"),
        (m * k * n / (e * elements), "a multiply and an add per term: 2·m·k·n FLOPs"),
        (e * elements / flop, "intensity is FLOPs per byte, not bytes per FLOP"),
        (2 * m * k * n / elements, f"divide by bytes, not elements ({e} bytes each)"),
    ]
    for value, why in known:
        if math.isclose(got, value, rel_tol=1e-9):
            return why
    return "FLOPs 2·m·k·n over bytes (m·k + k·n + m·n) · dtype.itemsize"


def check_matmul_roofline(
    fn: Callable, peak: dict | None = None, bandwidth: float | None = None
) -> None:
    """The student's (intensity, memory_bound) of matrix products equal the reference's,
    on two synthetic machines chosen so that each usual mistake changes an answer, then
    on this machine (``peak`` per dtype and ``bandwidth``, as measured) if given."""
    cases = [(m, k, n, dt, *_ROOF_MACHINES[i]) for m, k, n, dt, i in _ROOF_CASES]
    if peak is not None and bandwidth is not None:
        cases += [(m, m, m, dt, peak, bandwidth) for m in (64, 4096) for dt in peak]
    for m, k, n, dtype, machine_peak, bw in cases:
        got = fn(m, k, n, dtype, dict(machine_peak), bw)
        intensity, bound = reference.matmul_roofline(m, k, n, dtype, machine_peak, bw)
        where = (
            f"({m}×{k})·({k}×{n}) in {str(dtype).split('.')[-1]}, peak "
            f"{machine_peak[dtype]:.3g} FLOP/s, bandwidth {bw:.3g} B/s"
        )
        if not (isinstance(got, tuple | list) and len(got) == 2):
            fail(
                "matmul_roofline", f"{where}: returned {got!r}", "return (intensity, memory_bound)"
            )
        if not math.isclose(float(got[0]), intensity, rel_tol=1e-9):
            fail(
                "matmul_roofline",
                f"{where}: you said {float(got[0]):.4g} FLOP/byte, the product does "
                f"{intensity:.4g}",
                _intensity_mistake(float(got[0]), m, k, n, dtype),
            )
        said = bool(got[1])
        if said == bound:
            continue
        if dtype != torch.float32 and said == (intensity < machine_peak[torch.float32] / bw):
            hint = (
                "compare with the ridge point of the op's own dtype, peak[dtype] / bandwidth: "
                "each dtype has its own flat roof (fp32's peak is not bf16's)"
            )
        elif said == (intensity < bw / machine_peak[dtype]):
            hint = "the ridge point is peak / bandwidth (FLOP/s ÷ bytes/s = FLOP per byte)"
        else:
            hint = (
                "memory-bound when the intensity is below the ridge point peak[dtype] / "
                "bandwidth: left of it the sloped roof (intensity × bandwidth) is the lower"
            )
        ridge = machine_peak[dtype] / bw
        fail(
            "matmul_roofline",
            f"{where}: intensity {intensity:.4g} FLOP/byte, ridge point {ridge:.3g}: you "
            f"said memory-bound={said}",
            hint,
        )
    passed(f"matmul_roofline: intensity and bound right on {len(cases)} products and machines")


def autocast_dtypes(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """``(op, input dtype, output dtype)`` of ops run under ``torch.autocast(device,
    dtype)`` on this device, each fed what it gets in a model: the matrix products fp32
    tensors, the others the output of a matrix product. Which ops autocast casts, and to
    what, differs by device (torch/testing/_internal/autocast_test_lists.py:
    ``AutocastTestLists`` for CUDA, ``AutocastCPUTestLists`` for the CPU)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(8, 8, generator=g).to(device) for _ in range(2))
    q = torch.randn(1, 2, 8, 4, generator=g).to(device)
    target = torch.zeros(8, dtype=torch.long, device=device)
    ln = torch.nn.LayerNorm(8).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        h = x @ w  # what a matrix product hands on
        rows = [
            ("linear / matmul", x.dtype, F.linear(x, w).dtype),
            (
                "scaled_dot_product_attention",
                q.dtype,
                F.scaled_dot_product_attention(q, q, q).dtype,
            ),
            ("softmax", h.dtype, torch.softmax(h, -1).dtype),
            ("log_softmax", h.dtype, F.log_softmax(h, -1).dtype),
            ("layer_norm (fp32 weights)", h.dtype, ln(h).dtype),
            ("gelu", h.dtype, F.gelu(h).dtype),
            ("cross_entropy", h.dtype, F.cross_entropy(h, target).dtype),
        ]
    return rows


def module_output_dtypes(
    model: torch.nn.Module, run: Callable[[], object]
) -> dict[str, tuple[set[torch.dtype], set[torch.dtype]]]:
    """Per module class of ``model`` (``Linear``, ``LayerNorm``, ``GELU``...), the dtypes
    of the inputs and of the outputs seen while ``run`` runs (forward hooks)."""
    seen: dict[str, tuple[set[torch.dtype], set[torch.dtype]]] = {}

    def hook(module: torch.nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            ins, outs = seen.setdefault(type(module).__name__, (set(), set()))
            ins.add(args[0].dtype)
            outs.add(out.dtype)

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _log_uniform_grads(n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    magnitude = 10 ** (torch.rand(n, generator=g) * 10 - 11)  # 1e-11 … 1e-1
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return magnitude * sign


def reference_in(grads: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The loss-scale round trip through ``dtype`` instead of fp16 (a likely mistake)."""
    return (grads * scale).to(dtype).to(torch.float32) / scale


# fp16's limits at the small end, as torch's cast rounds (to nearest, ties to even; the tests
# run torch's own cast at each): the smallest positive fp16 value is the subnormal 2⁻²⁴;
# |x| ≤ 2⁻²⁵ rounds to 0 (exactly 2⁻²⁵ is a tie, and 0 is the even neighbour), 2⁻²⁵ < |x| <
# 2⁻²⁴ rounds up to 2⁻²⁴; below the smallest normal value, 2⁻¹⁴, precision shrinks gradually.
FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_SMALLEST_NORMAL = 2.0**-14


def _largest_relative_difference(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """max |got − want| / |want| over the elements non-zero in both (None if there are
    none): relative, so that the many tiny gradients do not hide behind the large ones."""
    both = (got != 0) & (want != 0)
    if not both.any():
        return None
    return float(((got[both] - want[both]).abs() / want[both].abs()).max())


def _fp16_rounding_mistake(got: torch.Tensor, grads: torch.Tensor, scale: float) -> str | None:
    """Name the mistake of a hand-made fp16 underflow (a threshold instead of the cast's
    rounding), from where ``got`` has zeros the cast does not make; None if not that."""
    scaled = (grads * scale).abs()  # what the cast sees, in fp32 as the reference computes it
    want = reference.fp16_gradients(grads, scale)
    wrong_zero = (got == 0) & (want != 0)
    both = (got != 0) & (want != 0)
    rounding = (  # were the values both keep rounded to fp16's bits?
        ""
        if torch.equal(got[both], want[both])
        else "the cast rounds every value it keeps to fp16's 11 significant bits (fewer "
        "below 2⁻¹⁴), not only the tiny ones to zero: let `.to(torch.float16)` do the rounding"
    )
    if not wrong_zero.any():
        # the zeros may be right and the values kept not rounded at all
        unrounded = torch.equal(got[both], grads[both]) and ((got == 0) == (want == 0)).all()
        return f"your zeros are right, but {rounding}" if rounding and unrounded else None
    rounding = f"; and {rounding}" if rounding else ""
    # every wrong zero lies in the band (2⁻²⁵, 2⁻²⁴], and none of that band survived
    band = (scaled > FP16_SMALLEST_SUBNORMAL / 2) & (scaled <= FP16_SMALLEST_SUBNORMAL)
    if not (wrong_zero & ~band).any() and not (band & (got != 0)).any():
        return (
            f"{int(wrong_zero.sum())} scaled gradients between 2⁻²⁵ and 2⁻²⁴ are 0 in your "
            "result: 2⁻²⁴ is fp16's smallest positive value, not its underflow threshold. A "
            "cast to fp16 rounds to the nearest value it can hold, so |x| in (2⁻²⁵, 2⁻²⁴) "
            "rounds up to 2⁻²⁴; only |x| ≤ 2⁻²⁵ (half of it; the tie at exactly 2⁻²⁵ goes "
            "to the even neighbour, 0) rounds to zero" + rounding
        )
    below_normal = (scaled > FP16_SMALLEST_SUBNORMAL / 2) & (scaled < FP16_SMALLEST_NORMAL)
    if not (wrong_zero & ~below_normal).any() and wrong_zero.sum() > band.sum():
        return (
            "values below fp16's smallest normal value 2⁻¹⁴ are 0 in your result: fp16 has "
            "subnormals down to 2⁻²⁴ (gradual underflow, not flush-to-zero), so only "
            "|x| ≤ 2⁻²⁵ rounds to zero" + rounding
        )
    return None


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
        got = got.float()
        zeros, want_zeros = int((got == 0).sum()), int((want == 0).sum())
        unscaled = reference.fp16_gradients(grads, 1.0)
        if scale != 1.0 and torch.equal(got, unscaled):
            hint = (
                "the loss scale is missing: multiply by the scale before the cast to fp16 "
                "(so small values stay representable) and divide after"
            )
        elif torch.equal(got, want * scale):
            hint = "unscale: divide by the scale after casting back to fp32"
        elif torch.equal(got, ((grads * scale).half() / scale).float()):
            hint = (
                "unscale in fp32: dividing while still in fp16 rounds the small values "
                "to zero again (they underflow)"
            )
        elif torch.equal(got, reference_in(grads, scale, torch.bfloat16)):
            hint = (
                "the gradients are stored in float16 here; bfloat16 has fp32's exponent "
                "range, so they would not underflow in it"
            )
        else:
            hint = _fp16_rounding_mistake(got, grads, scale) or (
                "the values the optimizer sees: what fp16 can store of the gradients a "
                "loss scaled by `scale` gives, brought back to fp32 and to their true size. "
                "fp16 rounds to 11 significant bits (a relative difference of up to 2⁻¹¹ ≈ "
                "4.9e-04 in its normal range, more below 2⁻¹⁴), |x| ≤ 2⁻²⁵ to 0 and |x| ≥ "
                "65520 to inf"
            )
        rel = _largest_relative_difference(got, want)
        fail(
            "fp16_gradients",
            f"scale {scale:g}: {zeros} of {grads.numel()} gradients are zero "
            f"in your result, {want_zeros} with scaling done right; where both are non-zero, "
            + (
                "no element is non-zero in both"
                if rel is None
                else "they agree"
                if rel == 0
                else f"the largest relative difference is {rel:.2e}"
            ),
            hint,
        )
    passed("fp16_gradients: scaling keeps the gradients fp16 alone would round to zero")


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
def torch_buckets(nbytes: list[int], ready: list[int], cap: int, first_cap: int) -> list[list[int]]:
    """The buckets PyTorch's own assignment makes: ``_compute_bucket_assignment_by_size``
    (torch/csrc/distributed/c10d/reducer.cpp), called as DDP's reducer calls it when it
    rebuilds its buckets (at the next forward, in the order the first backward's gradients
    became ready): the parameters in gradient-ready order,
    limits ``[first_cap, cap]``."""
    import torch.distributed as dist

    tensors = [torch.empty(b // 4) for b in (nbytes[i] for i in ready)]  # fp32 gradients
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, [first_cap, cap], [False] * len(ready), list(ready)
    )
    return [list(b) for b in buckets]


def _buckets_by(nbytes, order, cap, first_cap, *, closes, first_for_all=False):
    """A bucketing rule with one knob changed, to name the mistake a wrong answer made."""
    out: list[list[int]] = []
    open_bucket: list[int] = []
    size = 0
    for i in order:
        limit = first_cap if (first_for_all or not out) else cap
        if closes == "before" and open_bucket and size + nbytes[i] > limit:
            out.append(open_bucket)
            open_bucket, size = [], 0
        open_bucket.append(i)
        size += nbytes[i]
        if (closes == "reach" and size >= limit) or (closes == "pass" and size > limit):
            out.append(open_bucket)
            open_bucket, size = [], 0
    return out + ([open_bucket] if open_bucket else [])


def _buckets_mistake(got, nbytes, ready, cap, first_cap) -> str:
    """Name the usual mistake behind wrong buckets."""
    n = len(nbytes)
    flat = [i for b in got for i in b] if isinstance(got, list) else []
    if sorted(flat) != list(range(n)):
        return "every parameter index must be in exactly one bucket"
    rule = dict(cap=cap, first_cap=first_cap)
    candidates = [
        (
            _buckets_by(nbytes, ready, closes="before", **rule),
            "DDP does not close a bucket before it would pass the limit: it adds the "
            "parameter first, then closes the bucket once its bytes have reached the limit "
            "(>=), so a bucket may pass it",
        ),
        (
            _buckets_by(nbytes, ready, closes="pass", **rule),
            "close the bucket when its bytes reach the limit (>=), not only once they pass it",
        ),
        (
            _buckets_by(nbytes, ready, closes="reach", cap=cap, first_cap=cap),
            f"the first bucket has its own, smaller limit first_cap = {first_cap} bytes "
            "(dist._DEFAULT_FIRST_BUCKET_BYTES when bucket_cap_mb is not given)",
        ),
        (
            _buckets_by(nbytes, ready, closes="reach", first_for_all=True, **rule),
            "only the first bucket uses first_cap; every later bucket closes at cap",
        ),
        (
            _buckets_by(nbytes, list(reversed(range(n))), closes="reach", **rule),
            "walk the parameters in `ready` order, the order their gradients arrived (DDP "
            "records it in the first backward): it is not always the reverse of the "
            "registration order",
        ),
        (
            _buckets_by(nbytes, list(range(n)), closes="reach", **rule),
            "walk the parameters in `ready` order (gradients arrive from the last layer to "
            "the first), not in registration order",
        ),
    ]
    for wrong, why in candidates:
        if got == wrong:
            return why
    if [sorted(b) for b in got] == [
        sorted(b) for b in torch_buckets(nbytes, ready, cap, first_cap)
    ]:
        return "keep each bucket's indices in the order they were added (the `ready` order)"
    return (
        "walk `ready`, add each parameter, close the bucket once its bytes reach its limit "
        "(first_cap for the first bucket, cap after it); what is left is the last bucket"
    )


def bucket_cases(n_random: int = 40, seed: int = 0) -> list[tuple[list[int], list[int], int, int]]:
    """(nbytes, ready, cap, first_cap): hand-made cases that tell the usual mistakes apart,
    then random ones (fp32 gradients: bytes are multiples of 4)."""
    cases = [
        ([40, 8, 40, 8, 16], [4, 3, 2, 1, 0], 48, 48),  # closes on reaching; may pass the cap
        ([16, 16, 16, 16], [3, 2, 1, 0], 32, 32),  # exactly reaching the cap closes it
        ([8] * 6, [5, 4, 3, 2, 1, 0], 20, 12),  # the first bucket's own limit
        ([4, 4, 8, 4, 12, 4], [5, 4, 2, 3, 1, 0], 16, 16),  # ready is not reversed(range)
        ([64, 64], [1, 0], 1000, 1000),  # everything in one (last) bucket
    ]
    rng = random.Random(seed)
    for _ in range(n_random):
        n = rng.randint(1, 12)
        nbytes = [4 * rng.randint(1, 32) for _ in range(n)]
        ready = list(reversed(range(n)))
        if rng.random() < 0.5:  # a few neighbours swapped, as LayerNorm's weight and bias
            for _ in range(rng.randint(1, 3)):
                j = rng.randrange(max(1, n - 1))
                ready[j : j + 2] = ready[j : j + 2][::-1]
        cap = 4 * rng.randint(1, 48)
        first_cap = cap if rng.random() < 0.5 else 4 * rng.randint(1, cap // 4)
        cases.append((nbytes, ready, cap, first_cap))
    return cases


def check_make_buckets(fn: Callable) -> None:
    """The student's buckets equal PyTorch's own assignment (the function DDP's reducer
    calls) on hand-made and random parameter lists, caps and first-bucket caps."""
    cases = bucket_cases()
    for nbytes, ready, cap, first_cap in cases:
        want = torch_buckets(nbytes, ready, cap, first_cap)
        got = fn(list(nbytes), list(ready), cap, first_cap)
        if isinstance(got, list) and [list(b) for b in got] == want:
            continue
        fail(
            "make_buckets",
            f"nbytes {nbytes}, ready {ready}, cap {cap}, first_cap {first_cap}: you made "
            f"{got}, PyTorch's own assignment (dist._compute_bucket_assignment_by_size, "
            f"what DDP calls) makes {want}",
            _buckets_mistake(got, nbytes, ready, cap, first_cap)
            if isinstance(got, list)
            else "return a list of buckets, each a list of parameter indices",
        )
    passed(f"make_buckets: PyTorch's own bucket assignment on {len(cases)} parameter lists")


# the strategies of notebook 6, as scripts/predicted_bytes.py names them
STRATEGIES = ("ddp", "zero1_torch", "zero2", "fsdp", "tp", "pp")


def _bytes_mistake(strategy: str, got: float, kw: dict) -> str:
    """Name the usual mistake behind a wrong per-rank byte count."""
    n, grads = kw["n"], kw["psi"] * 4
    act = kw["batch"] * kw["seq_len"] * kw["d_model"] * 4
    ring = (n - 1) / n
    layers = kw["layers"]
    if strategy in ("tp", "pp"):
        gradient_answers = [
            reference.bytes_sent_per_rank(s, **kw) for s in ("ddp", "zero1_torch", "fsdp")
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
                3 * ring * grads,
                {
                    "zero2": "3(n−1)/n·Ψ is PyTorch's ZeroRedundancyOptimizer (all-reduce, then "
                    "a broadcast of the updated parameters); ZeRO stages 1–2 as Rajbhandari "
                    "et al. define them (§7.2.1) reduce-scatter the gradients and all-gather "
                    "the updated parameters: 2(n−1)/n·Ψ, the same as DDP",
                }.get(strategy, ""),
            ),
            (
                2 * ring * grads,
                {
                    "zero1_torch": "ZeroRedundancyOptimizer all-reduces the gradients as DDP "
                    "does, then each rank broadcasts the parameters it updated: (n−1)/n·Ψ more",
                    "fsdp": "FSDP gathers the weights twice (forward, and again in "
                    "backward: it freed them) and reduce-scatters the gradients",
                }.get(strategy, ""),
            ),
            (2 * grads, "the ring sends (n−1)/n of the data per rank and per pass, not all of it"),
            (
                ring * grads,
                {
                    "zero2": "after the step each rank's updated shard must reach the others: "
                    "an all-gather of the parameters after the reduce-scatter",
                }.get(
                    strategy,
                    "an all-reduce is a reduce-scatter followed by an all-gather: 2(n−1)/n·S",
                ),
            ),
            (grads, "count bytes (4 per fp32 value) and the ring's 2(n−1)/n for an all-reduce"),
        ]
        default = (
            "data parallelism sends the Ψ gradients; ZeroRedundancyOptimizer, ZeRO-2 and FSDP "
            "also send the Ψ weights"
        )
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
        for strategy in STRATEGIES:
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
    passed(
        "bytes_sent_per_rank: DDP, ZeroRedundancyOptimizer, ZeRO-2, FSDP, tensor and pipeline "
        "parallelism on 3 shapes"
    )


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
