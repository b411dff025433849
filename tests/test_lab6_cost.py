"""Lab 6, notebooks 1–3: FLOP counts, the saved-bytes meter, recomputation policies, and
self-checks that fail on the usual wrong answers (each named by its hint)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

import lab6_checks as checks
import lab6_solutions as reference
from lab_utils import flops, memory, models, saved_bytes
from lab_utils.checks import CheckFailed
from lab_utils.parallel import lm_loss


# ----------------------------------------------------------------------------- FLOPs
def test_transformer_formula_equals_the_counter_and_the_fused_kernel_is_not_counted():
    shape = (2, 32, 50, 2, 16)  # layers, d, vocab, batch, seq
    counted = checks.counted_transformer_flops(*shape)
    assert reference.transformer_train_flops(*shape) == counted
    n_layers, d, vocab, b, s = shape
    model = models.build("char_transformer", vocab=vocab, d_model=d, n_layers=n_layers, max_len=s)
    x = torch.randint(0, vocab, (b, s))
    fused = flops.count_flops(lambda: lm_loss(model(x), x).backward(), math_attention=False)
    # What the math kernel adds is exactly attention's two products, 3 × 4·s²·d per sequence.
    assert counted - fused == n_layers * 12 * b * s * s * d
    assert 6 * flops.linear_weights(model) * b * s == fused


def test_the_cpu_fused_kernel_has_no_formula_and_meta_always_takes_the_math_path():
    """6.1 once counted "without the math kernel" on meta and printed "missing 0": on
    meta, scaled_dot_product_attention decomposes into the math path, so nothing is
    missing there; on real CPU tensors the fused kernel runs, and torch's flop_registry
    has no formula for it (it has them for CUDA's fused kernels)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    assert aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward not in flop_registry
    assert aten._scaled_dot_product_flash_attention in flop_registry  # CUDA's flash kernel
    n_layers, d, vocab, b, s = 1, 16, 20, 2, 8
    kwargs = dict(vocab=vocab, d_model=d, n_heads=2, n_layers=n_layers, max_len=s)
    model = models.build("char_transformer", **kwargs)
    x = torch.randint(0, vocab, (b, s))
    real = lambda: lm_loss(model(x), x).backward()
    assert flops.attention_ops(real) == {
        "aten._scaled_dot_product_flash_attention_for_cpu": False,
        "aten._scaled_dot_product_flash_attention_for_cpu_backward": False,
    }
    attention = n_layers * 12 * b * s * s * d
    math = flops.count_flops(real)
    assert math - flops.count_flops(real, math_attention=False) == attention
    with torch.device("meta"):
        meta_model = models.build("char_transformer", **kwargs)
    xm = x.to("meta")
    on_meta = lambda: lm_loss(meta_model(xm), xm).backward()
    assert flops.attention_ops(on_meta) == {}  # no fused kernel ran: the math path
    assert flops.count_flops(on_meta, math_attention=False) == math  # "missing 0" on meta


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *a: reference.transformer_train_flops(*a) // 3, "forward pass only"),
        (
            lambda L, d, v, b, s: 6 * (12 * L * d * d + d * v) * b * s,
            "attention products are missing",
        ),
        (
            lambda L, d, v, b, s: 6 * (12 * L * d * d + d * v) * b * s + 6 * L * b * s * s * d,
            "do not halve them for the causal mask",
        ),
        (
            lambda L, d, v, b, s: (
                reference.transformer_train_flops(L, d, v, b, s) + 6 * v * d * b * s
            ),
            "embedding is a look-up",
        ),
    ],
)
def test_a_wrong_transformer_count_fails_and_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_transformer_flops(wrong)


def test_cnn_count_and_the_first_layers_missing_input_gradient():
    checks.check_cnn_flops(reference.cnn_train_flops)
    every_conv_three_times = lambda w, b: reference.cnn_train_flops(w, b) + 2 * 9 * w * 28 * 28 * b
    with pytest.raises(CheckFailed, match="needs no input gradient"):
        checks.check_cnn_flops(every_conv_three_times)


def _roofline(intensity_of, bound_of):
    """A matmul_roofline answer built from a (possibly wrong) intensity and rule."""

    def fn(m, k, n, dtype, peak, bandwidth):
        i = intensity_of(m, k, n, dtype.itemsize)
        return i, bound_of(i, dtype, peak, bandwidth)

    return fn


RIGHT_I = lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n + m * n))
RIGHT_BOUND = lambda i, dt, peak, bw: i < peak[dt] / bw


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (  # counting only the inputs: the output write forgotten
            _roofline(lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n)), RIGHT_BOUND),
            "output is written too",
        ),
        (  # fp32's 4 bytes for every dtype
            _roofline(lambda m, k, n, e: RIGHT_I(m, k, n, 4), RIGHT_BOUND),
            "element size is dtype.itemsize",
        ),
        (  # bits, not bytes
            _roofline(lambda m, k, n, e: RIGHT_I(m, k, n, 8 * e), RIGHT_BOUND),
            "bytes, not bits",
        ),
        (  # m·k·n FLOPs
            _roofline(lambda m, k, n, e: RIGHT_I(m, k, n, e) / 2, RIGHT_BOUND),
            "multiply and an add",
        ),
        (  # the fp32 ridge point for every dtype
            _roofline(RIGHT_I, lambda i, dt, peak, bw: i < peak[torch.float32] / bw),
            "ridge point of the op's own dtype",
        ),
        (  # the ridge point upside down
            _roofline(RIGHT_I, lambda i, dt, peak, bw: i < bw / peak[dt]),
            "ridge point is peak / bandwidth",
        ),
        (  # memory-bound on the wrong side
            _roofline(RIGHT_I, lambda i, dt, peak, bw: i > peak[dt] / bw),
            "below the ridge point",
        ),
    ],
)
def test_a_wrong_roofline_prediction_fails_and_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_matmul_roofline(wrong)


def test_matmul_roofline_reference_passes_on_a_measured_machine_too():
    checks.check_matmul_roofline(reference.matmul_roofline)
    checks.check_matmul_roofline(
        reference.matmul_roofline, {torch.float32: 3e10, torch.bfloat16: 2e11}, 3.5e10
    )
    assert reference.matmul_roofline(2, 3, 4, torch.bfloat16, {torch.bfloat16: 1.0}, 1.0) == (
        48 / (2 * (6 + 12 + 8)),  # 2·m·k·n FLOPs over 2-byte inputs and output
        True,  # 0.92 FLOP/byte, left of a ridge point at 1
    )


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),  # the SXM card: 1,979* ÷ 2
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),  # "H100" in its name, not its peak
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA H200 NVL", torch.float32, 60e12),  # not the H200 SXM's 67
        ("NVIDIA L40", torch.bfloat16, 181e12),  # contains "L4"; neither L4's nor L40S's
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("Tesla V100-PCIE-16GB", torch.float32, 14e12),  # not the SXM2's 15.7
        ("NVIDIA A10G", torch.bfloat16, None),  # not in the table: no A10 peak for it
        ("NVIDIA A100-SXM4-40GB", torch.float32, 19.5e12),
    ],
)
def test_published_peak_matches_the_whole_name_of_confusable_cards(name, dtype, peak):
    assert flops.published_peak(name, dtype) == peak
    card = flops.published_card(name)
    assert (card is None) == (peak is None)
    if card is not None:
        assert card.name == name and "data sheet" in card.source


def test_published_peaks_mfu_and_costs():
    assert flops.published_peak("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == 156e12
    assert flops.published_peak("Tesla T4", torch.bfloat16) is None
    assert flops.published_peak("Some CPU", torch.float32) is None
    assert flops.mfu(1e12, 2.0, 1e12) == 0.5
    assert flops.matmul_cost(2, 3, 4) == (48, 4 * (6 + 12 + 8))
    assert flops.elementwise_cost(10, 1, inputs=2) == (10, 120)
    f, b = flops.allreduce_cost(1000, 2)
    assert f / b == 1 / 16


def test_measured_peak_and_bandwidth_are_rates():
    peak = flops.matmul_peak(torch.float32, n=64, repeats=2)
    bandwidth = flops.copy_bandwidth(2**20, repeats=2)
    assert math.isfinite(peak) and peak > 1e6
    assert math.isfinite(bandwidth) and bandwidth > 1e6


# ----------------------------------------------------------------------------- loss scale
def test_fp16_gradients_check_fails_without_the_loss_scale():
    checks.check_fp16_gradients(reference.fp16_gradients)
    with pytest.raises(CheckFailed, match="loss scale is missing"):
        checks.check_fp16_gradients(lambda g, s: g.half().float())
    with pytest.raises(CheckFailed, match="unscale"):
        checks.check_fp16_gradients(lambda g, s: (g * s).half().float())
    with pytest.raises(CheckFailed, match="unscale in fp32"):
        checks.check_fp16_gradients(lambda g, s: ((g * s).half() / s).float())
    with pytest.raises(CheckFailed, match="bfloat16 has fp32's exponent range"):
        checks.check_fp16_gradients(lambda g, s: (g * s).bfloat16().float() / s)


def test_fp16_rounds_to_zero_up_to_2_to_the_minus_25_and_the_figure_marks_it_there():
    """A cast to fp16 rounds to nearest, ties to even: 2⁻²⁵ (half of the smallest
    subnormal 2⁻²⁴) goes to 0, anything above it to 2⁻²⁴. The figure's underflow line sits
    where torch's cast starts to round to zero (the old -24 marked a value fp16 keeps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import lab6_plots as plots

    half_tiny = torch.tensor(2.0**-25)
    above = torch.nextafter(half_tiny, torch.tensor(1.0))
    assert float(half_tiny.half()) == 0.0
    assert float(above.half()) == 2.0**-24
    assert float(torch.tensor(2.0**-24).half()) == 2.0**-24
    ax = plots.gradient_magnitudes(torch.logspace(-30, -1, 50, base=2.0).numpy(), scale=2.0**10)
    underflow = min(line.get_xdata()[0] for line in ax.lines)  # the left of the two red lines
    plt.close(ax.figure)
    edge = torch.tensor(2.0**underflow)
    assert float(edge.half()) == 0.0  # the line's value rounds to zero ...
    assert float(torch.nextafter(edge, torch.tensor(1.0)).half()) != 0.0  # ... the next is not


def test_cpu_autocast_leaves_softmax_and_layer_norm_in_the_dtype_they_get():
    """CUDA's autocast casts softmax, log_softmax and layer_norm to fp32; the CPU's does
    not (they are in no list of AutocastCPUTestLists): fed a bf16 matmul output, they
    return bf16. Only the loss (nll_loss, in the CPU's fp32 list) comes out fp32."""
    rows = {op: (i, o) for op, i, o in checks.autocast_dtypes("cpu", torch.bfloat16)}
    bf16, fp32 = torch.bfloat16, torch.float32
    assert rows["linear / matmul"] == (fp32, bf16)
    assert rows["softmax"] == (bf16, bf16)
    assert rows["log_softmax"] == (bf16, bf16)
    assert rows["layer_norm (fp32 weights)"] == (bf16, bf16)
    assert rows["cross_entropy"] == (bf16, fp32)
    # In char_transformer LayerNorm's input is the fp32 residual stream: fp32 out, for
    # that reason and not autocast's.
    model = models.build("char_transformer", vocab=20, d_model=16, n_heads=2, n_layers=1, max_len=8)
    x = torch.randint(0, 20, (2, 8))

    def forward():
        with torch.no_grad(), torch.autocast("cpu", dtype=bf16):
            model(x)

    seen = checks.module_output_dtypes(model, forward)
    assert seen["LayerNorm"] == ({fp32}, {fp32})
    assert seen["Linear"][1] == {bf16} and seen["GELU"] == ({bf16}, {bf16})


# ----------------------------------------------------------------------------- saved bytes
def test_meter_counts_each_storage_once_and_lab4s_activation_bytes_is_the_same_meter():
    w = torch.randn(8, 8, requires_grad=True)
    base = torch.randn(4, 8, requires_grad=True) * 1.0  # one storage of 4·8 floats

    def forward():
        top, whole = base[:2], base  # two views of that storage, different shapes
        return (top @ w).sum() + (whole @ w).sum()

    meter = saved_bytes.saved_bytes(forward, exclude=[w])
    assert meter == 4 * 8 * 4  # the storage, once (counting per view would add 2·8 floats)
    assert memory.activation_bytes(forward, exclude=[w]) == meter  # one meter in the course


def test_meter_excludes_weights_and_reports_dtypes():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with saved_bytes.SavedBytes(exclude=lin.parameters()) as meter:
        torch.relu(lin(x)).sum()
    assert meter.bytes == 3 * 4 * 4 * 2  # x for the weight gradient, relu's output
    assert meter.by_dtype() == {"torch.float32": meter.bytes}


def test_block_formula_and_korthikanti_unadapted_fails():
    checks.check_layer_activation_bytes(reference.layer_activation_bytes)
    with pytest.raises(CheckFailed, match="Korthikanti"):
        checks.check_layer_activation_bytes(lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h))
    with pytest.raises(CheckFailed, match="small tensors"):
        checks.check_layer_activation_bytes(lambda s, b, h, a: 4 * 16 * s * b * h)


@pytest.fixture(scope="module")
def policies():
    """Bytes saved, loss and gradients of a tiny transformer under each policy."""
    kwargs = dict(vocab=20, d_model=16, n_heads=2, n_layers=2, max_len=8)
    x = torch.randint(0, 20, (3, 8))
    out = {}
    for policy in saved_bytes.POLICIES:
        torch.manual_seed(0)
        model = saved_bytes.recompute(models.build("char_transformer", **kwargs), policy)
        with saved_bytes.SavedBytes(exclude=model.parameters()) as meter:
            loss = lm_loss(model(x), x)
        loss.backward()
        out[policy] = (meter.bytes, loss.item(), [p.grad.clone() for p in model.parameters()])
    return out


def test_recomputation_changes_bytes_by_the_counted_amounts(policies):
    s, b, h, a, layers = 8, 3, 16, 2, 2
    none = policies["none"][0]
    # selective (Korthikanti et al. §5, the attention core): with the fused kernel only
    # its log-sum-exp goes; q, k, v stay as its inputs, its output as proj's input
    assert none - policies["selective"][0] == layers * 4 * a * s * b
    assert none - policies["attention_sublayer"][0] == layers * 4 * (4 * s * b * h + a * s * b)
    assert none - policies["mlp_sublayer"][0] == layers * 4 * 8 * s * b * h
    block = reference.layer_activation_bytes(s, b, h, a)
    assert none - policies["full"][0] == layers * (block - 4 * s * b * h)


def test_selective_recomputation_drops_the_math_kernels_s_by_s_matrix():
    """With attention in the math kernel the core stores its s×s softmax output; the
    selective policy drops exactly that (a·s²·b values per block), and keeps the same
    bytes as with the fused kernel. (s = 12 ≠ head size 8, so the shapes differ.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s, b, a, layers = 12, 3, 2, 2
    kwargs = dict(vocab=20, d_model=16, n_heads=a, n_layers=layers, max_len=s)
    x = torch.randint(0, 20, (b, s))
    out = {}
    for kernel in ("fused", "math"):
        for policy in ("none", "selective"):
            torch.manual_seed(0)
            model = saved_bytes.recompute(models.build("char_transformer", **kwargs), policy)
            with (
                sdpa_kernel(SDPBackend.MATH) if kernel == "math" else nullcontext(),
                saved_bytes.SavedBytes(exclude=model.parameters()) as meter,
            ):
                lm_loss(model(x), x)
            out[kernel, policy] = meter.bytes
    assert out["math", "none"] - out["math", "selective"] == layers * 4 * a * s * s * b
    assert out["fused", "none"] - out["fused", "selective"] == layers * 4 * a * s * b
    assert out["math", "selective"] == out["fused", "selective"]


def test_recomputation_leaves_loss_and_gradients_unchanged(policies):
    _, loss, grads = policies["none"]
    for policy in saved_bytes.POLICIES[1:]:
        assert policies[policy][1] == pytest.approx(loss, abs=1e-6)
        for g, want in zip(policies[policy][2], grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        saved_bytes.recompute(torch.nn.Linear(2, 2), "everything")


def test_torch_runs_convolutions_in_tf32_by_default_and_matmuls_in_fp32() -> None:
    # 6.1 divides the CNN step's FLOPs by the TF32 peak on a GPU because of the first flag
    # and the transformer's by the fp32 peak because of the second: torch's defaults.
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
