"""Lab 1: the regression library, the exercise checks, the plots, and the science claims
the notebooks make (closed form = lstsq = converged GD, autograd = hand gradients,
gradient variance ~ 1/B, the 2/λ_max stability threshold, learning-rate decay)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import lab1_checks as check
import lab1_plots as lplots
import lab1_settings
import lab1_solutions as solution
from lab_utils import data, regression
from lab_utils.checks import CheckFailed

LAB = Path(__file__).resolve().parent.parent / "labs" / "lab1_optimisation"
EXERCISES = [
    "normal_equations",
    "mse_gradient",
    "gradient_descent",
    "neuron_gradient",
    "minibatch_sgd",
    "decayed_lr",
    "loglog_slope",
]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture
def line():
    return regression.line_data(200, seed=0)


# ----------------------------------------------------------------- regression library
def test_line_data_follows_its_truth():
    x, y = regression.line_data(5000, w=2.0, b=-1.0, noise=0.1, seed=3)
    assert x.shape == y.shape == (5000,)
    assert x.min() >= 0.0 and x.max() <= 4.0
    np.testing.assert_allclose(regression.lstsq(x, y), [2.0, -1.0], atol=0.02)


def test_gradient_is_the_derivative_of_the_loss(line):
    x, y = line
    theta = np.array([0.4, -0.3])
    eps = 1e-6
    numeric = [
        (regression.mse(x, y, theta + eps * e) - regression.mse(x, y, theta - eps * e)) / (2 * eps)
        for e in np.eye(2)
    ]
    np.testing.assert_allclose(regression.mse_gradient(x, y, theta), numeric, rtol=1e-6)


def test_loss_grid_and_path_losses_match_mse(line):
    x, y = line
    W, B, L = regression.loss_grid(x, y, [0.0, 1.0, 2.0], [-1.0, 0.5])
    assert W.shape == B.shape == L.shape == (2, 3)
    assert L[1, 2] == pytest.approx(regression.mse(x, y, [2.0, 0.5]))
    path = np.array([[0.0, 0.0], [1.0, -1.0]])
    np.testing.assert_allclose(
        regression.path_losses(x, y, path), [regression.mse(x, y, p) for p in path]
    )


def test_full_batch_sgd_is_gradient_descent(line):
    x, y = line
    np.testing.assert_allclose(
        solution.minibatch_sgd(x, y, [0, 0], 0.05, len(x), 4),
        regression.gd_path(x, y, [0, 0], 0.05, 4),
    )
    path = solution.minibatch_sgd(x, y, [0, 0], 0.01, 64, 2)
    assert path.shape == (2 * regression.updates_per_epoch(200, 64) + 1, 2)


def test_lambda_max_is_the_hessian_top_eigenvalue(line):
    x, _ = line
    A = np.c_[x, np.ones_like(x)]
    assert regression.lambda_max(x) == pytest.approx(np.linalg.eigvalsh(2 / len(x) * A.T @ A)[-1])


def test_loglog_slope_recovers_a_power_law():
    b = np.array([1, 2, 4, 8, 16])
    assert regression.loglog_slope(b, 7.0 / b) == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: regression.mse_gradient(np.ones((3, 2, 2)), np.ones(3), [0, 0, 0]), "1-D or 2-D"),
        (lambda: regression.mse_gradient(np.ones(3), np.ones(4), [0, 0]), "3 rows but y has 4"),
        (lambda: regression.mse_gradient(np.ones(3), np.ones(3), [0, 0, 0]), "weights and a bias"),
        (lambda: regression.gd_path(np.ones(3), np.ones(3), [0, 0], -0.1, 1), "positive"),
        (lambda: regression.loss_grid(np.ones((3, 2)), np.ones(3), [0], [0]), "single-feature"),
    ],
)
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ----------------------------------------------------------------- exercise checks
@pytest.mark.parametrize("name", EXERCISES)
def test_reference_solution_passes_its_check(name, capsys):
    getattr(check, f"check_{name}")(getattr(solution, name))
    assert "✔" in capsys.readouterr().out


def _mse_gradient_sign_error(X, y, theta):
    return -solution.mse_gradient(X, y, theta)


def _mse_gradient_summed(X, y, theta):
    return solution.mse_gradient(X, y, theta) * len(y)


def _normal_equations_without_bias(X, y):
    X = X.reshape(len(X), -1)
    return np.linalg.solve(X.T @ X, X.T @ y)


def _gd_uphill(X, y, theta0, lr, steps):
    theta, path = np.array(theta0, float), [np.array(theta0, float)]
    for _ in range(steps):
        theta = theta + lr * solution.mse_gradient(X, y, theta)
        path.append(theta)
    return np.array(path)


def _gd_appends_the_same_array(X, y, theta0, lr, steps):
    theta = np.array(theta0, float)
    path = [theta]
    for _ in range(steps):
        theta -= lr * solution.mse_gradient(X, y, theta)
        path.append(theta)
    return np.array(path)


def _neuron_without_tanh_derivative(x, y, w, b):
    a = np.tanh(w * x + b)
    return np.mean(2 * (a - y) * x), np.mean(2 * (a - y))


def _sgd_dropping_the_last_batch(X, y, theta0, lr, batch_size, epochs, seed=0):
    X = X.reshape(len(X), -1)
    rng, theta = np.random.default_rng(seed), np.array(theta0, float)
    path = [theta.copy()]
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            theta = theta - lr * solution.mse_gradient(X[idx], y[idx], theta)
            path.append(theta)
    return np.array(path)


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("normal_equations", _normal_equations_without_bias, "column of ones"),
        ("mse_gradient", _mse_gradient_sign_error, "sign is flipped"),
        ("mse_gradient", _mse_gradient_summed, "divide by n"),
        ("gradient_descent", _gd_uphill, "against"),
        ("gradient_descent", _gd_appends_the_same_array, "theta.copy()"),
        ("neuron_gradient", _neuron_without_tanh_derivative, "tanh'"),
        ("minibatch_sgd", _sgd_dropping_the_last_batch, "last, smaller batch"),
        ("decayed_lr", lambda step, lr0, k: lr0 * 0.5 ** (step / k), "exponential"),
        ("loglog_slope", lambda x, y: float(np.polyfit(x, y, 1)[0]), "np.log"),
    ],
)
def test_checks_say_what_is_wrong(name, wrong, message):
    with pytest.raises(CheckFailed, match=re.escape(message)):
        getattr(check, f"check_{name}")(wrong)


def test_unfinished_exercise_is_not_reported_as_a_wrong_answer():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        check.check_mse_gradient(stub)


# ----------------------------------------------------------------- science claims
def test_closed_form_lstsq_and_converged_gd_agree(line):
    x, y = line
    lr = 1.0 / regression.lambda_max(x)
    solutions = {
        "normal equations": solution.normal_equations(x, y),
        "lstsq": regression.lstsq(x, y),
        "gradient descent": regression.gd_path(x, y, [-1.0, 3.0], lr, 600)[-1],
    }
    check.solutions_agree(solutions, rtol=1e-4)
    unconverged = {
        **solutions,
        "gradient descent": regression.gd_path(x, y, [-1.0, 3.0], lr, 20)[-1],
    }
    with pytest.raises(CheckFailed, match="gradient descent"):
        check.solutions_agree(unconverged, rtol=1e-4)


def test_normal_equations_lose_accuracy_when_ill_conditioned():
    # κ(XᵀX) = 1e14, so κ(A) ≈ 1e7: squared, it nearly exhausts double precision.
    X, y, w, b = data.synthetic_regression(n=200, d=5, noise=0.0, seed=0, condition_number=1e14)
    truth = np.append(w, b)
    lstsq_error = regression.relative_error(regression.lstsq(X, y), truth)
    try:
        normal_error = regression.relative_error(regression.normal_equations(X, y), truth)
    except np.linalg.LinAlgError:
        normal_error = np.inf
    assert lstsq_error < 1e-6
    assert normal_error > 1e3 * lstsq_error


def test_autograd_equals_the_hand_derived_gradients(line):
    x, y = line
    theta = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    ((theta[0] * torch.from_numpy(x) + theta[1] - torch.from_numpy(y)) ** 2).mean().backward()
    check.gradients_match(
        solution.mse_gradient(x, y, theta.detach().numpy()), theta.grad.numpy(), what="MSE gradient"
    )

    w = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    target = np.tanh(0.8 * x - 1.5)
    ((torch.tanh(w * torch.from_numpy(x) + b) - torch.from_numpy(target)) ** 2).mean().backward()
    check.gradients_match(
        solution.neuron_gradient(x, target, 0.2, 0.1),
        [w.grad.item(), b.grad.item()],
        what="tanh neuron gradient",
    )
    with pytest.raises(CheckFailed):
        check.gradients_match(
            _neuron_without_tanh_derivative(x, target, 0.2, 0.1),
            [w.grad.item(), b.grad.item()],
            what="tanh neuron gradient",
        )


# 02_sgd_minibatches's quick sizes: the data set, the variance sweep, the decay run
MINIBATCH = lab1_settings.MINIBATCH.of("quick")


def test_minibatch_gradient_variance_falls_like_one_over_b():
    x, y = regression.line_data(MINIBATCH.n_samples, seed=0)
    batches = MINIBATCH.variance_batches
    rng = np.random.default_rng(0)
    full = regression.mse_gradient(x, y, np.zeros(2))
    variances = [
        np.mean(
            [
                np.sum((regression.mse_gradient(x[i], y[i], np.zeros(2)) - full) ** 2)
                for i in (
                    rng.choice(len(y), size=b, replace=False)
                    for _ in range(MINIBATCH.variance_draws)
                )
            ]
        )
        for b in batches
    ]
    slope = check.variance_falls_like_inverse_batch(batches, variances)
    assert -1.25 <= slope <= -0.75
    with pytest.raises(CheckFailed, match="decreases"):
        check.variance_falls_like_inverse_batch(batches, variances[::-1])


def test_learning_rate_threshold_is_two_over_lambda_max(line):
    x, y = line
    lam = regression.lambda_max(x)
    below, above = 1.9 / lam, 2.1 / lam
    losses = {
        lr: regression.path_losses(x, y, regression.gd_path(x, y, [-1, 3], lr, 150))
        for lr in (below, above)
    }
    check.learning_rate_threshold(lam, below, losses[below], above, losses[above])
    assert losses[above][-1] > 1e3 * losses[above][0]
    with pytest.raises(CheckFailed):
        check.learning_rate_threshold(lam, above, losses[above], below, losses[below])


def test_learning_rate_decay_converges_where_a_constant_rate_bounces():
    x, y = regression.line_data(MINIBATCH.n_samples, seed=0)
    best = regression.lstsq(x, y)

    def tail_distance(lr):
        path = solution.minibatch_sgd(x, y, [-1, 3], lr, 4, MINIBATCH.decay_epochs, seed=0)
        d = np.linalg.norm(path - best, axis=1)
        return d[-len(d) // 10 :].mean()

    decayed = tail_distance(lambda t: solution.decayed_lr(t, 0.05, 300))
    assert decayed < tail_distance(0.05) / 2


# ----------------------------------------------------------------- plots
def test_plots_label_their_axes(line):
    x, y = line
    surface = regression.loss_grid(x, y, np.linspace(-1, 3, 30), np.linspace(-4, 4, 30))
    path = regression.gd_path(x, y, [-1, 3], 0.05, 20)
    ax = lplots.loss_contour(*surface, {"GD": path}, optimum=regression.lstsq(x, y))
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("weight w", "bias b")
    ax = lplots.loglog({"v": ([1, 2, 4], [4.0, 2.0, 1.0])}, xlabel="B", ylabel="var", guides=(-1,))
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert any("slope -1" in t.get_text() for t in ax.get_legend().get_texts())
    losses = {"GD": regression.path_losses(x, y, path)}
    for fig in (
        lplots.paths_and_losses(*surface, {"GD": path}, losses),
        lplots.learning_rate_gallery(*surface, {"GD": path}, losses),
        lplots.parallelism_diagrams(),
    ):
        assert fig.axes
    with pytest.raises(ValueError, match="anchor"):
        lplots.loglog({}, xlabel="x", ylabel="y", anchor="middle")


def test_autograd_graph_draws_every_operation():
    w = torch.tensor(0.5, requires_grad=True)
    loss = (torch.tanh(w * 2.0) - 1.0) ** 2
    ax = lplots.autograd_graph(loss, names={"w": w})
    texts = " ".join(t.get_text() for t in ax.texts)
    for op in ("Mul", "Tanh", "Sub", "Pow", "w (scalar)"):
        assert op in texts
    with pytest.raises(ValueError, match="requires_grad"):
        lplots.autograd_graph(torch.tensor(1.0))


# ----------------------------------------------------------------- notebooks
def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def test_every_notebook_exercise_has_a_reference_and_a_check():
    keys = set()
    for nb in sorted(LAB.glob("*.ipynb")):
        source = "".join("".join(c["source"]) for c in _cells(nb))
        found = re.findall(r'@exercise\("lab1\.(\w+)"\)', source)
        keys |= set(found)
        for name in found:
            assert f"check_{name}(" in source, f"{nb.name}: no self-check for {name}"
    assert keys == set(EXERCISES)
    for name in keys:
        assert callable(getattr(solution, name))


# ------------------------------------------------ steps to a target (03_batch_size_cost)
@pytest.fixture(scope="module")
def steps_module():
    """steps_to_target.py, imported from the lab folder."""
    import sys

    sys.path.insert(0, str(LAB))
    try:
        import steps_to_target

        yield steps_to_target
    finally:
        sys.path.remove(str(LAB))


def test_crossing_is_interpolated_between_checks(steps_module):
    crossing = steps_module.crossing
    # 0.70 at step 100, 0.90 at step 400: 0.80 is half-way in log(step), at 200
    assert crossing([(1, 0.1), (100, 0.7), (400, 0.9)], 0.8) == pytest.approx(200)
    assert crossing([(1, 0.1), (100, 0.7), (400, 0.9)], 0.9) == pytest.approx(400)
    assert crossing([(5, 0.95)], 0.8) == 5  # reached at the first check
    assert crossing([(1, 0.1), (10, 0.5)], 0.8) is None  # never reached


def test_capped_batches_are_kept_out_of_the_fit(steps_module):
    setup = steps_module.Setup(
        batches=(8, 16, 32, 64, 128, 256, 512), lr_smallest=0.003, lr_max=0.1
    )
    assert setup.cap_batch == pytest.approx(266.67, abs=0.01)
    assert [b for b in setup.batches if setup.capped(b)] == [512]
    assert setup.lr(512) == 0.1 and setup.lr(256) == pytest.approx(0.096)
    steps = {8: 1000, 16: 500, 32: 250, 64: 150, 128: 110, 256: 100, 512: 400}
    m = steps_module.Measured(setup, {b: [s, s, s] for b, s in steps.items()})
    assert m.fitted()[0] == [8, 16, 32, 64, 128, 256]  # 512's rise does not enter
    small, large, half = m.slopes()
    assert half == 3 and small == pytest.approx(-1.0)
    claims = steps_module.claims(m)
    assert all(c.ok for c in claims), [c.line() for c in claims]
    # a curve that never bends fails the second claim; one that is too flat the first
    straight = steps_module.Measured(setup, {b: [8000 / b] * 3 for b in setup.batches})
    assert [c.ok for c in steps_module.claims(straight)] == [True, True, False]
    flat = steps_module.Measured(setup, {b: [1000 * b**-0.5] * 3 for b in setup.batches})
    assert not steps_module.claims(flat)[1].ok
    missing = steps_module.Measured(
        setup, {b: [None, None, 5] if b == 16 else [100] * 3 for b in setup.batches}
    )
    assert not steps_module.claims(missing)[0].ok


def test_a_later_first_check_skips_evaluations_not_crossings(steps_module, monkeypatch):
    """Checks from step 24 lie on the grid that starts at step 1, so the crossing is the
    same for fewer evaluations; a run already at the target at its first check is
    flagged as unbracketed."""
    now = {"step": 0}
    monkeypatch.setattr(steps_module, "evaluate", lambda m, loader: {"acc": now["step"] / 100})

    def run(first_check: int):
        stopper = steps_module.StopAtAccuracy(None, 0.8, 1, 1000, first_check=first_check)
        trainer = SimpleNamespace(model=None, stop_training=False)
        for now["step"] in range(1, 1000):
            stopper.on_batch_end(trainer, now["step"], 0.0)
            if trainer.stop_training:
                break
        return stopper

    full, late, too_late = run(1), run(24), run(90)
    assert late.checks == [c for c in full.checks if c[0] >= 24] and len(late.checks) < 12
    assert late.reached_at == full.reached_at == pytest.approx(80, abs=1)
    per_batch = steps_module.Setup(batches=(8, 16), first_check={8: 24})
    assert (per_batch.check_from(8), per_batch.check_from(16)) == (24, 1)
    setup = steps_module.Setup(batches=(8,))
    checks = {(8, 0): late.checks, (8, 1): too_late.checks}
    m = steps_module.Measured(setup, {8: [late.reached_at, too_late.reached_at]}, checks)
    assert m.unbracketed() == [(8, 1)]


# What the claims need of the notebook's cpu experiment: the uncapped batch sizes (the
# capped one is drawn but never judged), each checked from FIRST_CHECK[B] on. A crossing
# is read from the last check below the target and the first at or above it; each step
# here is the check of the grid (steps 1, 2, ... × 1.15) one before the earliest such
# last check below among the seeds of that batch size (B = 8: 260; 16: 170; 32: 82; 64:
# 29; 128: 46; 256: 46, measured checking from step 25), so every crossing is the one a
# run checked from step 1 finds, for 79 evaluations instead of 199.
FIRST_CHECK = {8: 226, 16: 147, 32: 71, 64: 25, 128: 40, 256: 40}


@pytest.mark.science
@pytest.mark.slow
@pytest.mark.timeout(3600)  # minutes of CPU; far longer on cores shared with other jobs
def test_steps_to_target_claim_holds_on_the_cpu_profile(steps_module):
    """03_batch_size_cost's claim on the ``cpu`` profile (real Fashion-MNIST, fixed
    seeds, one thread: deterministic), asserted; each claim prints its margin
    (``pytest -rP`` shows it). Without the data it fails (it does not skip)."""
    from lab_utils import profile

    full = steps_module.setup_for(profile.Profile("cpu", torch.device("cpu"), 1, 1))
    uncapped = tuple(b for b in full.batches if not full.capped(b))
    assert set(FIRST_CHECK) == set(uncapped)
    setup = dataclasses.replace(full, batches=uncapped, first_check=FIRST_CHECK)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = steps_module.measure(setup, torch.device("cpu"), progress=False)
    finally:
        torch.set_num_threads(before)
    print(steps_module.report(m))
    claims = steps_module.claims(m)
    for c in claims:
        print(c.line())
    assert m.unbracketed() == [], "reached at the first check: lower FIRST_CHECK"
    assert len(claims) == 3
    assert all(c.ok for c in claims), "\n".join(c.line() for c in claims)
