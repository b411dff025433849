"""lab_utils.optim: scaling rules, schedules, LARS, LAMB, ghost BN, gradient noise,
batch growth. Optimiser updates are checked against the papers' formulas on tiny
tensors whose results are worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lab_utils import optim

# --------------------------------------------------------------------- scaling rules


def test_scale_lr_rules():
    assert optim.scale_lr(0.1, 64, 1024, "linear") == pytest.approx(1.6)
    assert optim.scale_lr(0.1, 64, 1024, "sqrt") == pytest.approx(0.4)
    assert optim.scale_lr(0.1, 64, 1024, "none") == pytest.approx(0.1)
    assert optim.scale_lr(0.1, 256, 64, "linear") == pytest.approx(0.025)


@pytest.mark.parametrize("args", [(0.1, 64, 128, "cubic"), (0.0, 64, 128, "linear"),
                                  (0.1, 0, 128, "linear"), (0.1, 64, -1, "sqrt")])
def test_scale_lr_rejects_bad_input(args):
    with pytest.raises(ValueError):
        optim.scale_lr(*args)


# ------------------------------------------------------------------------- schedules


def test_warmup_rises_linearly_to_one():
    f = optim.warmup(4, start_factor=0.2)
    # 0.2 + 0.8 * (s + 1) / 4 for s = 0..3, then 1
    assert [f(s) for s in range(6)] == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0, 1.0])
    g = optim.warmup(5)
    assert [g(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert optim.warmup(0)(0) == 1.0
    with pytest.raises(ValueError):
        optim.warmup(3, start_factor=1.5)


def test_lr_schedule_shapes():
    cos = optim.lr_schedule(12, warmup_steps=2, decay="cosine")
    assert cos(0) == pytest.approx(0.5) and cos(1) == pytest.approx(1.0)
    assert cos(2) == pytest.approx(1.0)
    assert cos(7) == pytest.approx(0.5)  # half way through the 10 decay steps
    assert cos(12) == pytest.approx(0.0, abs=1e-12)
    lin = optim.lr_schedule(10, decay="linear", final_factor=0.1)
    assert lin(5) == pytest.approx(0.55)
    step = optim.lr_schedule(10, decay="step", milestones=(4, 8), gamma=0.5)
    assert [step(s) for s in (0, 3, 4, 7, 8, 9)] == pytest.approx([1, 1, .5, .5, .25, .25])
    with pytest.raises(ValueError):
        optim.lr_schedule(10, warmup_steps=11)
    with pytest.raises(ValueError):
        optim.lr_schedule(10, decay="exp")


def test_lambda_lr_is_stepped_per_update():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = optim.lambda_lr(opt, optim.warmup(4))
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])


# ----------------------------------------------------------------------------- LARS


def _one_step(opt_cls, w, g, **kw):
    p = nn.Parameter(torch.tensor(w, dtype=torch.float64))
    opt = opt_cls([p], **kw)
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    return p.detach(), opt


def test_lars_one_step_matches_paper():
    # ‖w‖ = 5, ‖g‖ = 1, η = 0.01: local lr = 0.01·5/1 = 0.05; w − γ·0.05·g with γ = 0.5
    w, opt = _one_step(optim.LARS, [3.0, 4.0], [0.6, 0.8], lr=0.5, trust_coefficient=0.01)
    assert w.tolist() == pytest.approx([3 - 0.015, 4 - 0.02])
    p = opt.param_groups[0]["params"][0]
    assert float(opt.state[p]["trust_ratio"]) == pytest.approx(0.05)


def test_lars_one_step_with_weight_decay():
    # β = 0.1: local lr = 0.01·5 / (1 + 0.1·5) = 1/30; g + βw = (0.9, 1.2); step = (0.03, 0.04)
    w, _ = _one_step(optim.LARS, [3.0, 4.0], [0.6, 0.8], lr=1.0, trust_coefficient=0.01,
                     weight_decay=0.1)
    assert w.tolist() == pytest.approx([2.97, 3.96])


def test_lars_momentum_over_two_steps():
    p = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = optim.LARS([p], lr=1.0, momentum=0.9, trust_coefficient=0.01)
    p.grad = torch.tensor([0.6, 0.8], dtype=torch.float64)
    opt.step()  # v1 = 0.05·g = (0.03, 0.04); w1 = (2.97, 3.96)
    p.grad = torch.tensor([0.0, 2.0], dtype=torch.float64)
    opt.step()
    ratio2 = 0.01 * math.hypot(2.97, 3.96) / 2.0
    v2 = [0.9 * 0.03 + ratio2 * 0.0, 0.9 * 0.04 + ratio2 * 2.0]
    assert p.detach().tolist() == pytest.approx([2.97 - v2[0], 3.96 - v2[1]])


def test_lars_zero_norm_layers_use_ratio_one():
    # ‖w‖ = 0 (e.g. a zero-initialised layer): ratio 1, so w = −γ·g
    w, opt = _one_step(optim.LARS, [0.0, 0.0], [0.6, 0.8], lr=0.1, trust_coefficient=0.01)
    assert w.tolist() == pytest.approx([-0.06, -0.08])
    # ‖g‖ = 0 and no decay: ratio 1 and nothing moves, no NaN
    w, opt = _one_step(optim.LARS, [3.0, 4.0], [0.0, 0.0], lr=0.1)
    assert w.tolist() == [3.0, 4.0]
    p = opt.param_groups[0]["params"][0]
    assert float(opt.state[p]["trust_ratio"]) == 1.0


def test_lars_excluded_bias_is_sgd_with_momentum():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(a.detach().clone())
    lars = optim.LARS([a], lr=0.1, momentum=0.9, weight_decay=0.5, exclude_bias_and_norm=True)
    sgd = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        lars.step()
        sgd.step()
    torch.testing.assert_close(a, b)
    assert float(lars.state[a]["trust_ratio"]) == 1.0


def test_lars_trust_ratio_function():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])
    assert float(optim.lars_trust_ratio(w, g, 0.01)) == pytest.approx(0.05)
    assert float(optim.lars_trust_ratio(w, g, 0.01, weight_decay=0.1)) == pytest.approx(1 / 30)
    assert float(optim.lars_trust_ratio(torch.zeros(2), g, 0.01)) == 1.0


def test_lars_rejects_bad_hyperparameters():
    p = [nn.Parameter(torch.zeros(1))]
    for kw in ({"lr": 0}, {"momentum": 1.0}, {"trust_coefficient": 0}, {"weight_decay": -1}):
        with pytest.raises(ValueError):
            optim.LARS(p, **kw)


# ----------------------------------------------------------------------------- LAMB


def test_lamb_one_step_matches_paper():
    # t = 1 with bias correction: m̂ = g, v̂ = g², r = g / (|g| + ε)
    eps, lr = 1e-6, 0.1
    w, opt = _one_step(optim.LAMB, [3.0, 4.0], [0.6, -0.8], lr=lr, eps=eps)
    r = [0.6 / (0.6 + eps), -0.8 / (0.8 + eps)]
    ratio = 5.0 / math.hypot(*r)
    assert w.tolist() == pytest.approx([3 - lr * ratio * r[0], 4 - lr * ratio * r[1]])
    p = opt.param_groups[0]["params"][0]
    assert float(opt.state[p]["trust_ratio"]) == pytest.approx(ratio)


def test_lamb_one_step_with_weight_decay():
    # u = r + λw = (1.3, −0.6) for r ≈ (1, −1), λ = 0.1; ratio = 5 / ‖u‖
    eps, lr, wd = 1e-6, 0.1, 0.1
    w, _ = _one_step(optim.LAMB, [3.0, 4.0], [0.6, -0.8], lr=lr, eps=eps, weight_decay=wd)
    u = [0.6 / (0.6 + eps) + wd * 3, -0.8 / (0.8 + eps) + wd * 4]
    ratio = 5.0 / math.hypot(*u)
    assert w.tolist() == pytest.approx([3 - lr * ratio * u[0], 4 - lr * ratio * u[1]])


def test_lamb_zero_norm_layer_uses_ratio_one():
    eps, lr = 1e-6, 0.1
    w, _ = _one_step(optim.LAMB, [0.0, 0.0], [0.6, -0.8], lr=lr, eps=eps)
    assert w.tolist() == pytest.approx([-lr * 0.6 / (0.6 + eps), lr * 0.8 / (0.8 + eps)])
    w, _ = _one_step(optim.LAMB, [3.0, 4.0], [0.0, 0.0], lr=lr)
    assert w.tolist() == [3.0, 4.0]


def test_lamb_without_bias_correction_second_step():
    p = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    opt = optim.LAMB([p], lr=0.5, betas=(0.5, 0.5), eps=1e-8, bias_correction=False)
    p.grad = torch.tensor([1.0], dtype=torch.float64)
    opt.step()  # m = 0.5, v = 0.5, u = 0.5/√0.5 = √0.5, ratio = 2/√0.5: w = 2 − 0.5·2 = 1
    assert p.item() == pytest.approx(1.0, rel=1e-6)
    p.grad = torch.tensor([3.0], dtype=torch.float64)
    opt.step()  # m = 1.75, v = 4.75, u > 0, ratio = 1/|u|: w = 1 − 0.5 = 0.5
    assert p.item() == pytest.approx(0.5, rel=1e-6)


def test_lamb_excluded_bias_is_adam():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(6))
    b = nn.Parameter(a.detach().clone())
    lamb = optim.LAMB([a], lr=0.01, eps=1e-8, weight_decay=0.3, exclude_bias_and_norm=True)
    adam = torch.optim.Adam([b], lr=0.01, eps=1e-8)
    for _ in range(4):
        g = torch.randn(6)
        a.grad, b.grad = g.clone(), g.clone()
        lamb.step()
        adam.step()
    torch.testing.assert_close(a, b)


def test_trust_ratios_by_layer_name():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = optim.LARS(model.parameters(), lr=0.1, exclude_bias_and_norm=True)
    assert optim.trust_ratios(model, opt) == {}
    model(torch.randn(8, 3)).pow(2).mean().backward()
    w0 = model[0].weight.detach().clone()  # the weights the step's ratio was computed on
    opt.step()
    ratios = optim.trust_ratios(model, opt)
    assert set(ratios) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ratios["0.bias"] == 1.0 and ratios["2.bias"] == 1.0
    g = model[0].weight.grad
    assert ratios["0.weight"] == pytest.approx(float(optim.lars_trust_ratio(w0, g)), rel=1e-6)


# ------------------------------------------------------------------------- ghost BN


@pytest.mark.parametrize("kind,shape", [("2d", (16, 3, 5, 5)), ("1d", (16, 3))])
def test_ghost_bn_equals_bn_when_ghost_is_the_batch(kind, shape):
    torch.manual_seed(0)
    bn = {"2d": nn.BatchNorm2d, "1d": nn.BatchNorm1d}[kind](3)
    ghost = {"2d": optim.GhostBatchNorm2d, "1d": optim.GhostBatchNorm1d}[kind](3, ghost_batch_size=16)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    ghost.load_state_dict(bn.state_dict())
    x = torch.randn(shape) * 3 + 1
    torch.testing.assert_close(ghost(x), bn(x))
    torch.testing.assert_close(ghost.running_mean, bn.running_mean)
    torch.testing.assert_close(ghost.running_var, bn.running_var)
    bn.eval()
    ghost.eval()
    torch.testing.assert_close(ghost(x), bn(x))


def test_ghost_bn_normalises_each_ghost_batch_separately():
    torch.manual_seed(0)
    ghost = optim.GhostBatchNorm2d(2, ghost_batch_size=4, affine=False)
    x = torch.randn(12, 2, 3, 3)
    x[4:8] += 10  # one ghost batch far off: normalised on its own, it is centred anyway
    y = ghost(x)
    for chunk in y.split(4):
        assert chunk.mean(dim=(0, 2, 3)).abs().max() < 1e-5
        assert chunk.var(dim=(0, 2, 3), unbiased=False).sub(1).abs().max() < 1e-3
    whole = nn.BatchNorm2d(2, affine=False)(x)
    assert not torch.allclose(y, whole, atol=1e-2)
    assert int(ghost.num_batches_tracked) == 3


def test_ghost_batch_norm_replaces_bn_layers_in_place():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5))
    model[1].running_mean.fill_(0.3)
    optim.ghost_batch_norm(model, 8)
    assert isinstance(model[1], optim.GhostBatchNorm2d)
    assert isinstance(model[4], optim.GhostBatchNorm1d)
    assert model[1].ghost_batch_size == 8
    assert torch.all(model[1].running_mean == 0.3)
    assert model(torch.randn(32, 1, 6, 6)).shape == (32, 5)


def test_ghost_bn_rejects_bad_input():
    with pytest.raises(ValueError):
        optim.GhostBatchNorm2d(3, ghost_batch_size=0)
    with pytest.raises(ValueError):
        optim.GhostBatchNorm2d(3)(torch.randn(4, 3))


# ------------------------------------------------------------------- gradient noise


def test_noise_std_grows_with_the_batch():
    assert optim.noise_std(64, 64, 0.01) == pytest.approx(0.1)
    assert optim.noise_std(256, 64, 0.01) == pytest.approx(0.2)  # σ² ∝ B


def test_gradient_noise_is_multiplicative_and_removable():
    w = nn.Parameter(torch.ones(20000))
    model = nn.Module()
    model.w = w
    with optim.GradientNoise(model, sigma=0.5, seed=1):
        (w * 3).sum().backward()
        ratio = w.grad / 3
        assert ratio.mean().item() == pytest.approx(1.0, abs=0.02)
        assert ratio.std().item() == pytest.approx(0.5, abs=0.02)
    w.grad = None
    (w * 3).sum().backward()  # removed: the exact gradient again
    assert torch.all(w.grad == 3)


def test_gradient_noise_with_zero_sigma_changes_nothing():
    model = nn.Linear(3, 1)
    noise = optim.GradientNoise(model, sigma=0.0)
    model(torch.ones(2, 3)).sum().backward()
    assert torch.all(model.weight.grad == 2)
    noise.remove()


# ---------------------------------------------------------------------- batch growth


def test_batch_growth_schedule():
    growth = optim.BatchGrowth(base_batch=64, factor=4, milestones=(2, 4))
    assert [growth.batch_size(e) for e in range(6)] == [64, 64, 256, 256, 1024, 1024]
    assert all(growth.lr_factor(e) == 1.0 for e in range(6))
    assert growth.phases(6) == [(2, 64, 1.0), (2, 256, 1.0), (2, 1024, 1.0)]
    # 1000 samples: 2·16 + 2·4 + 2·1 updates instead of 6·16 with a decaying LR
    assert growth.updates(1000, 6) == 42


def test_batch_growth_caps_the_batch_and_decays_the_rest():
    growth = optim.BatchGrowth(base_batch=64, factor=4, milestones=(1, 2), max_batch=512)
    assert [growth.batch_size(e) for e in range(3)] == [64, 256, 512]
    assert growth.lr_factor(2) == pytest.approx(0.5)  # wanted ×16, got ×8: halve the LR
    with pytest.raises(ValueError):
        optim.BatchGrowth(base_batch=64, factor=0.5, milestones=(1,))


# ------------------------------------------------------- gradient accumulation (torch)


def test_accumulation_equals_one_large_batch_without_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), y).backward()
    big = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for xb, yb in zip(x.split(16), y.split(16), strict=True):
        (loss_fn(model(xb), yb) / 4).backward()
    for g_big, p in zip(big, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g_big, rtol=1e-6, atol=1e-7)
