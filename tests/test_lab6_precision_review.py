"""Lab 6.2 after an independent read: fp16's limits as torch's own cast rounds them (2⁻²⁵
to zero, the band up to 2⁻²⁴ kept as 2⁻²⁴, subnormals kept, 65520 to inf), the
``fp16_gradients`` check's message (the largest relative difference, and the 2⁻²⁴
threshold named as a mistake), ``GradScaler`` on the CPU skipping a step that overflowed
and halving its scale, and the loss figure whose fp32 curve is no longer hidden."""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch

import lab6_checks as checks
import lab6_plots as plots
import lab6_solutions as reference
from lab_utils.checks import CheckFailed

TINY = 2.0**-24  # fp16's smallest subnormal


def half(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).half().float().tolist()


# ------------------------------------------------------------------ torch's own cast
def test_torch_rounds_only_up_to_2_to_the_minus_25_to_zero_and_keeps_subnormals():
    """What 6.2, the check's hints and the figure say of fp16, from torch's cast: |x| ≤
    2⁻²⁵ → 0 (the tie at 2⁻²⁵ goes to the even neighbour, 0), (2⁻²⁵, 2⁻²⁴) → 2⁻²⁴, so a
    2⁻²⁴ threshold is wrong; values below the smallest normal 2⁻¹⁴ are kept as
    subnormals (no flush to zero), with fewer bits."""
    just_above = torch.nextafter(torch.tensor(TINY / 2), torch.tensor(1.0)).item()
    assert half([TINY / 4, TINY / 2, -TINY / 2]) == [0.0, 0.0, 0.0]
    assert half([just_above, 0.75 * TINY, 0.99 * TINY, TINY]) == [TINY] * 4
    assert half([3 * TINY, 2.0**-20, 2.0**-15]) == [3 * TINY, 2.0**-20, 2.0**-15]
    assert half([2.0**-14 * (1 + 2**-12)]) == [2.0**-14]  # 11 bits there ...
    assert half([5.4 * TINY]) == [5 * TINY]  # ... a multiple of 2⁻²⁴ below 2⁻¹⁴


def test_torch_rounds_from_65520_up_to_inf_and_below_it_to_65504():
    got = half([65504.0, 65519.0, 65519.99, 65520.0, -65520.0, 70000.0])
    assert got[:3] == [65504.0] * 3
    assert got[3:] == [float("inf"), float("-inf"), float("inf")]


# ------------------------------------------------------------------ the check's message
def threshold_24_rounded(g: torch.Tensor, s: float) -> torch.Tensor:
    """A cast to fp16, then everything below 2⁻²⁴ set to zero by hand (the mistake)."""
    return torch.where((g * s).abs() < TINY, 0.0, (g * s).half().float()) / s


def threshold_24_unrounded(g: torch.Tensor, s: float) -> torch.Tensor:
    """fp16 'emulated' by a 2⁻²⁴ threshold alone: no rounding of what is kept either."""
    return torch.where((g * s).abs() < TINY, 0.0, g * s) / s


@pytest.mark.parametrize("wrong", [threshold_24_rounded, threshold_24_unrounded])
def test_the_check_names_2_to_the_minus_24_as_the_wrong_underflow_threshold(wrong):
    checks.check_fp16_gradients(reference.fp16_gradients)
    with pytest.raises(CheckFailed) as failure:
        checks.check_fp16_gradients(wrong)
    message = str(failure.value)
    assert "not its underflow threshold" in message
    assert "(2⁻²⁵, 2⁻²⁴) rounds up to 2⁻²⁴" in message and "|x| ≤ 2⁻²⁵" in message
    # the unrounded answer is also told that the cast rounds what it keeps
    assert ("11 significant bits" in message) == (wrong is threshold_24_unrounded)


def test_the_check_shows_the_largest_relative_difference_of_the_non_zero_values():
    """Returning the gradients unchanged: the relative difference where both are non-zero
    (subnormals rounded to a multiple of 2⁻²⁴ differ by up to a half), not an absolute
    difference, which the large values would set and the tiny ones could not show."""
    grads = checks._log_uniform_grads()
    want = reference.fp16_gradients(grads, 1.0)
    both = (grads != 0) & (want != 0)
    relative = float(((grads[both] - want[both]).abs() / want[both].abs()).max())
    absolute = float((grads - want).abs().max())
    with pytest.raises(CheckFailed) as failure:
        checks.check_fp16_gradients(lambda g, s: g)
    message = str(failure.value)
    shown = re.search(r"largest relative difference is ([0-9.e+-]+)", message)
    assert shown and float(shown.group(1)) == pytest.approx(relative, rel=1e-2)
    assert f"{absolute:.2e}" not in message
    assert "2⁻¹¹" in message  # the hint says what fp16's rounding allows


def test_the_check_names_flush_to_zero_of_the_subnormals():
    with pytest.raises(CheckFailed, match="gradual underflow, not flush-to-zero"):
        checks.check_fp16_gradients(
            lambda g, s: torch.where((g * s).abs() < 2.0**-14, 0.0, (g * s).half().float()) / s
        )


def test_the_check_names_values_kept_without_rounding():
    with pytest.raises(CheckFailed, match="your zeros are right, but the cast rounds"):
        checks.check_fp16_gradients(
            lambda g, s: torch.where((g * s).abs() <= TINY / 2, 0.0, g * s) / s
        )


def test_the_check_says_underflow_and_never_flush(capsys):
    """fp16 has subnormals: values round to zero, they are not flushed (the old wording)."""
    checks.check_fp16_gradients(reference.fp16_gradients)
    said = capsys.readouterr().out
    for wrong in (
        lambda g, s: ((g * s).half() / s).float(),  # unscaled while still in fp16
        lambda g, s: (g * s).bfloat16().float() / s,
    ):
        with pytest.raises(CheckFailed) as failure:
            checks.check_fp16_gradients(wrong)
        said += str(failure.value)
    assert "round to zero" in said and "underflow" in said
    assert "flush" not in said


# ------------------------------------------------------------------ GradScaler
def test_grad_scaler_on_the_cpu_skips_a_step_that_overflowed_and_halves_the_scale():
    """torch.amp.GradScaler("cpu") with fp16 autocast (6.2 runs it on a CPU): at scale 2¹⁶
    the output's gradient 65536 is inf in fp16, the step is skipped (weights unchanged)
    and the scale halved; at 2¹⁵ it fits, the step runs; after 2 good steps (growth_interval
    2) the scale doubles, overflows again, and is halved again."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    x = torch.full((1, 4), 2.0**-10)  # one row: the bias gradient is the output's
    seen = []
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.float16):
            out = lin(x)
        assert out.dtype == torch.float16
        opt.zero_grad(set_to_none=True)
        scaler.scale(out.float().sum()).backward()
        scaler.unscale_(opt)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in lin.parameters())
        before = [p.detach().clone() for p in lin.parameters()]
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        stepped = any(not torch.equal(b, p) for b, p in zip(before, lin.parameters()))
        seen.append((scale, finite, stepped, scaler.get_scale()))
    assert seen == [
        (2.0**16, False, False, 2.0**15),  # overflow: skipped, halved
        (2.0**15, True, True, 2.0**15),
        (2.0**15, True, True, 2.0**16),  # 2 good steps in a row: doubled
        (2.0**16, False, False, 2.0**15),
        (2.0**15, True, True, 2.0**15),
    ]


# ------------------------------------------------------------------ the loss figure
def test_the_loss_figure_draws_fp32_on_top_dashed_and_the_difference_below():
    """6.2's fp32 and bf16 losses coincide to the eye: the fp32 curve is drawn last
    (dashed, over the bf16 one; `curves` drew it first, under it) and a second panel
    shows bf16 − fp32 step by step."""
    fp32, bf16 = [4.0, 3.5, 3.2], [4.0001, 3.4998, 3.2003]
    fig = plots.precision_losses({"fp32": fp32, "bf16 autocast": bf16})
    top, below = fig.axes
    plt.close(fig)
    assert top.lines[-1].get_label() == "fp32" and top.lines[-1].get_linestyle() == "--"
    assert list(top.lines[-1].get_ydata()) == fp32
    difference = next(line for line in below.lines if line.get_label() == "bf16 autocast − fp32")
    assert list(difference.get_ydata()) == pytest.approx([b - a for a, b in zip(fp32, bf16)])
