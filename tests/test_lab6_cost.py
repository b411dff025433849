"""Lab 6, notebooks 1–3: FLOP counts, the saved-bytes meter, recomputation policies, and
self-checks that fail on the usual wrong answers (each named by its hint)."""

from __future__ import annotations

import math

import pytest
import torch

from lab_utils import flops, memory, models, saved_bytes
from lab_utils.checks import CheckFailed
from lab_utils.checks import lab6 as checks
from lab_utils.parallel import lm_loss
from lab_utils.solutions import lab6 as reference


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
            "causal mask does not halve",
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


def test_memory_bound_check_fails_on_the_inverted_rule():
    checks.check_memory_bound(reference.memory_bound, 1e12, 1e11)
    with pytest.raises(CheckFailed, match="memory-bound"):
        checks.check_memory_bound(lambda i, p, b: i > p / b, 1e12, 1e11)


def test_published_peaks_mfu_and_costs():
    assert flops.published_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
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


# ----------------------------------------------------------------------------- saved bytes
def test_meter_counts_each_storage_once_where_the_lab4_counter_counts_views_twice():
    w = torch.randn(8, 8, requires_grad=True)
    base = torch.randn(4, 8, requires_grad=True) * 1.0  # one storage of 4·8 floats

    def forward():
        top, whole = base[:2], base  # two views of that storage, different shapes
        return (top @ w).sum() + (whole @ w).sum()

    meter = saved_bytes.saved_bytes(forward, exclude=[w])
    old = memory.activation_bytes(forward, exclude=[w])
    assert meter == 4 * 8 * 4  # the storage, once
    assert old == (2 * 8 + 4 * 8) * 4  # the old counter adds the two views


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
    assert none - policies["attention"][0] == layers * 4 * (4 * s * b * h + a * s * b)
    assert none - policies["mlp"][0] == layers * 4 * 8 * s * b * h
    block = reference.layer_activation_bytes(s, b, h, a)
    assert none - policies["full"][0] == layers * (block - 4 * s * b * h)


def test_recomputation_leaves_loss_and_gradients_unchanged(policies):
    _, loss, grads = policies["none"]
    for policy in saved_bytes.POLICIES[1:]:
        assert policies[policy][1] == pytest.approx(loss, abs=1e-6)
        for g, want in zip(policies[policy][2], grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        saved_bytes.recompute(torch.nn.Linear(2, 2), "everything")
