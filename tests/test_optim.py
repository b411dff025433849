"""lab_utils.optim: scaling rules, schedules, LARS, LAMB, LARC, NovoGrad, ghost BN,
per-sample gradient noise,
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


@pytest.mark.parametrize(
    "args",
    [
        (0.1, 64, 128, "cubic"),
        (0.0, 64, 128, "linear"),
        (0.1, 0, 128, "linear"),
        (0.1, 64, -1, "sqrt"),
    ],
)
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
    assert [step(s) for s in (0, 3, 4, 7, 8, 9)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])
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
    w, _ = _one_step(
        optim.LARS, [3.0, 4.0], [0.6, 0.8], lr=1.0, trust_coefficient=0.01, weight_decay=0.1
    )
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
    ghost = {"2d": optim.GhostBatchNorm2d, "1d": optim.GhostBatchNorm1d}[kind](
        3, ghost_batch_size=16
    )
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
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        nn.BatchNorm1d(5),
    )
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


def test_noise_std_matches_the_small_batch_covariance():
    assert optim.noise_std(64, 64) == 0.0  # the small batch itself: no noise to add
    assert optim.noise_std(1024, 64) == pytest.approx(math.sqrt(15))  # σ² = B/b − 1
    assert optim.noise_std(1024, 64, 0.5) == pytest.approx(math.sqrt(7.5))
    for bad in ((0, 64), (64, 0), (32, 64)):
        with pytest.raises(ValueError):
            optim.noise_std(*bad)


def test_sample_noise_weights_each_sample_gradient():
    """The gradient of the noisy loss is (1/M) Σ z_n ∇ℓ_n with z_n ~ N(1, σ²) drawn per
    sample: rebuild it from per-sample gradients and the same draws."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    noisy = optim.SampleNoiseLoss(0.7, seed=4)
    noisy(net(x), y).backward()
    got = net.weight.grad.clone()
    z = optim.SampleNoiseLoss(0.7, seed=4).weights(8)
    expected = torch.zeros_like(got)
    for n in range(8):
        net.zero_grad()
        nn.functional.cross_entropy(net(x[n : n + 1]), y[n : n + 1]).backward()
        expected += z[n] * net.weight.grad / 8
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(z, torch.ones(8))  # really noisy
    with torch.no_grad():  # evaluation: the plain mean loss
        assert noisy(net(x), y) == pytest.approx(nn.functional.cross_entropy(net(x), y).item())


def test_sample_noise_weights_have_mean_one_and_std_sigma():
    z = optim.SampleNoiseLoss(0.5, seed=1).weights(200_000)
    assert z.mean().item() == pytest.approx(1.0, abs=0.01)
    assert z.std().item() == pytest.approx(0.5, abs=0.01)


def _per_sample_gradients(n=4000, d=4, seed=0):
    """Per-sample gradients with a small mean against their spread (as near a minimum)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen)
    return torch.randn(n, d, generator=gen, dtype=torch.float64) @ mix.double() + 0.05


@pytest.mark.parametrize("big", [256, 1024])
def test_per_sample_noise_gives_a_large_batch_the_small_batch_covariance(big):
    """Hoffer et al.'s claim, measured: with σ² = B/b − 1 the weighted mean of B
    per-sample gradients has the covariance Σ/b of a batch of b; without noise it has
    Σ/B, b/B as much. The Monte-Carlo error of 4000 draws is a few percent."""
    grads, small = _per_sample_gradients(), 16
    sigma_small = torch.cov(grads.T, correction=0) / small  # Σ / b, sampled with replacement
    rel = lambda c: float((c - sigma_small).norm() / sigma_small.norm())
    noisy = optim.weighted_mean_covariance(grads, big, optim.noise_std(big, small), 4000)
    plain = optim.weighted_mean_covariance(grads, big, 0.0, 4000)
    assert rel(noisy) < 0.1
    assert rel(plain) > 0.9  # the check can fail: no noise is far off
    # noise added to the averaged gradient (one z per element of the mean) is off too
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(len(grads), (4000, big), generator=gen)
    means = grads[idx].mean(1)
    averaged = means * (
        1
        + optim.noise_std(big, small) * torch.randn(means.shape, generator=gen, dtype=torch.float64)
    )
    assert rel(torch.cov(averaged.T)) > 0.3


# --------------------------------------------------------------------- LARC, NovoGrad


def _apex_larc_step(params, inner, trust_coefficient, clip, eps):
    """NVIDIA apex's LARC.step, transcribed: rescale each gradient, then the inner SGD."""
    lr = inner.param_groups[0]["lr"]
    wd = inner.param_groups[0]["weight_decay"]
    inner.param_groups[0]["weight_decay"] = 0
    with torch.no_grad():
        for p in params:
            param_norm, grad_norm = torch.norm(p.data), torch.norm(p.grad.data)
            if param_norm != 0 and grad_norm != 0:
                adaptive_lr = trust_coefficient * param_norm / (grad_norm + param_norm * wd + eps)
                if clip:
                    adaptive_lr = min(adaptive_lr / lr, 1)
                p.grad.data += wd * p.data
                p.grad.data *= adaptive_lr
    inner.step()
    inner.param_groups[0]["weight_decay"] = wd


@pytest.mark.parametrize("mode", ["clip", "scale"])
@pytest.mark.parametrize("lr", [0.05, 3.0])
def test_larc_matches_apex(mode, lr):
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    ours = optim.LARC(
        nets[0].parameters(),
        lr=lr,
        momentum=0.9,
        weight_decay=1e-3,
        trust_coefficient=0.02,
        mode=mode,
    )
    apex = torch.optim.SGD(nets[1].parameters(), lr=lr, momentum=0.9, weight_decay=1e-3)
    for _ in range(4):
        for net in nets:
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        ours.step()
        _apex_larc_step(list(nets[1].parameters()), apex, 0.02, mode == "clip", 1e-8)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_larc_clip_is_min_of_global_and_local_rate():
    """The deck's rule: one step without momentum moves w by min(γ, η‖w‖/‖g‖)·g."""
    for lr, expected_rate in ((10.0, 0.01 * 5 / 1), (0.001, 0.001)):  # local 0.05 < 10; γ < 0.05
        w = nn.Parameter(torch.tensor([3.0, 4.0]))
        w.grad = torch.tensor([0.6, 0.8])
        optim.LARC([w], lr=lr, momentum=0.0, trust_coefficient=0.01, eps=0.0).step()
        torch.testing.assert_close(
            w.detach(), torch.tensor([3.0, 4.0]) - expected_rate * torch.tensor([0.6, 0.8])
        )
    with pytest.raises(ValueError, match="mode"):
        optim.LARC([w], mode="both")


def _novograd_paper(ws, grads_per_step, lr, beta1, beta2, eps, d):
    """Ginsburg et al. 2019, Algorithm 1, in plain Python floats (one layer = one list)."""
    ws = [list(w) for w in ws]
    m = [None] * len(ws)
    v = [None] * len(ws)
    for t, grads in enumerate(grads_per_step, start=1):
        for layer, g in enumerate(grads):
            norm2 = sum(gi * gi for gi in g)
            if t == 1:
                v[layer] = norm2
                m[layer] = [gi / math.sqrt(norm2) + d * wi for gi, wi in zip(g, ws[layer])]
            else:
                v[layer] = beta2 * v[layer] + (1 - beta2) * norm2
                m[layer] = [
                    beta1 * mi + (gi / (math.sqrt(v[layer]) + eps) + d * wi)
                    for mi, gi, wi in zip(m[layer], g, ws[layer])
                ]
            ws[layer] = [wi - lr * mi for wi, mi in zip(ws[layer], m[layer])]
    return ws


def test_novograd_matches_the_paper():
    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 2), (4,)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    steps = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(4)]
    params = [nn.Parameter(w.clone()) for w in start]
    opt = optim.NovoGrad(params, lr=0.1, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.01)
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    expected = _novograd_paper(
        [w.flatten().tolist() for w in start],
        [[g.flatten().tolist() for g in grads] for grads in steps],
        0.1,
        0.95,
        0.98,
        1e-8,
        0.01,
    )
    for p, e in zip(params, expected, strict=True):
        assert p.detach().flatten().tolist() == pytest.approx(e, rel=1e-12)
    # the second moment is one number per layer, not per element as in Adam
    assert all(opt.state[p]["v"].ndim == 0 for p in params)


def test_novograd_grad_averaging_and_bad_input():
    w = nn.Parameter(torch.tensor([1.0, 0.0]))
    opt = optim.NovoGrad([w], lr=0.1, betas=(0.5, 0.0), grad_averaging=True)
    for _ in range(2):
        w.grad = torch.tensor([3.0, 4.0])
        opt.step()
    # step 1: m = g/‖g‖ = (0.6, 0.8); step 2: v = 25, m = 0.5 m + 0.5 g/5 = (0.6, 0.8)
    torch.testing.assert_close(
        w.detach(), torch.tensor([1.0, 0.0]) - 0.2 * torch.tensor([0.6, 0.8])
    )
    for kwargs in ({"lr": 0}, {"betas": (1.0, 0.9)}, {"eps": -1}):
        with pytest.raises(ValueError):
            optim.NovoGrad([w], **kwargs)


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
