"""Lab 3: exercises and their checks, the claims' PASS/FAIL logic, the Trainer
callbacks of lab_utils.optim, the experiment runner and science.py at `quick`, and
the data-parallel recipe script."""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import lab3_checks as check
import lab3_settings
import lab3_solutions as solutions
from lab_utils import optim
from lab_utils.checks import CheckFailed
from lab_utils.loader import TensorLoader
from lab_utils.train import Trainer

LAB = Path(__file__).resolve().parent.parent / "labs" / "lab3_large_batch"


@pytest.fixture(scope="module")
def lab_modules():
    """experiments.py and science.py, imported from the lab folder."""
    sys.path.insert(0, str(LAB))
    try:
        import experiments
        import science

        yield experiments, science
    finally:
        sys.path.remove(str(LAB))


@pytest.fixture
def one_thread():
    """The science runs in one thread, so that their numbers do not depend on how many
    cores the machine has or how busy they are (a verdict must not flip with load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fashion_available():
    from lab_utils import data

    try:
        data.load("fashion-mnist", download=False)
    except data.DataError as e:
        pytest.skip(f"Fashion-MNIST is not available offline: {e}")


# ------------------------------------------------------------------------ exercises


def test_reference_solutions_pass_their_checks(capsys):
    check.check_warmup_factor(solutions.warmup_factor)
    check.check_trust_ratio(solutions.lars_trust_ratio)
    assert capsys.readouterr().out.count("✔") == 2


def test_trust_ratio_check_catches_mistakes():
    def no_weight_decay(w, g, trust_coefficient=0.001, weight_decay=0.0):
        return solutions.lars_trust_ratio(w, g, trust_coefficient, 0.0)

    def no_zero_guard(w, g, trust_coefficient=0.001, weight_decay=0.0):
        return trust_coefficient * w.norm() / (g.norm() + weight_decay * w.norm())

    def per_row(w, g, trust_coefficient=0.001, weight_decay=0.0):
        if w.dim() < 2 or w.norm() == 0 or g.norm() == 0:
            return solutions.lars_trust_ratio(w, g, trust_coefficient, weight_decay)
        return (
            trust_coefficient * w.norm(dim=1) / (g.norm(dim=1) + weight_decay * w.norm(dim=1))
        ).mean()

    for wrong, hint in (
        (no_weight_decay, "β·‖w‖"),
        (no_zero_guard, "ratio of 1"),
        (per_row, "whole tensor"),
    ):
        with pytest.raises(CheckFailed, match="lars_trust_ratio") as err:
            check.check_trust_ratio(wrong)
        assert hint in str(err.value)


def test_warmup_check_catches_mistakes():
    def off_by_one(step, warmup_steps, start_factor):
        return min(1.0, start_factor + (1 - start_factor) * step / warmup_steps)

    def never_ends(step, warmup_steps, start_factor):
        return start_factor + (1 - start_factor) * (step + 1) / warmup_steps

    for wrong in (off_by_one, never_ends):
        with pytest.raises(CheckFailed, match="warmup_factor"):
            check.check_warmup_factor(wrong)


def test_student_lars_subclass_matches_the_library():
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())

    class StudentLARS(optim.LARS):
        def trust_ratio(self, w, g, group):
            return solutions.lars_trust_ratio(
                w, g, group["trust_coefficient"], group["weight_decay"]
            )

    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for net, cls in zip(nets, (StudentLARS, optim.LARS), strict=True):
        opt = cls(net.parameters(), lr=5.0, weight_decay=1e-3, exclude_bias_and_norm=True)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    check.same_update(nets[0], nets[1], what="student LARS = library LARS")


# --------------------------------------------------------------------------- claims


def test_claims_pass_and_fail_on_their_thresholds():
    assert check.claim_naive_gap(0.88, 0.85, 16).ok
    assert not check.claim_naive_gap(0.88, 0.865, 16).ok  # 1.5 points is not enough
    assert not check.claim_naive_gap(0.88, 0.80, 8).ok  # ×8 is not "×16 or more"
    assert check.claim_scaling_recovers(0.88, 0.8705, 16).ok
    assert not check.claim_scaling_recovers(0.88, 0.869, 16).ok
    assert check.claim_adaptive_beats_sgd(0.80, 0.79, 0.81, 128).ok
    assert not check.claim_adaptive_beats_sgd(0.80, 0.80, 0.79, 128).ok
    assert check.claim_growth_matches_decay(0.88, 1000, 0.875, 600).ok
    assert not check.claim_growth_matches_decay(0.88, 1000, 0.875, 1000).ok  # not fewer
    assert not check.claim_growth_matches_decay(0.88, 1000, 0.865, 600).ok
    assert check.claim_accumulation_exact(3e-7, 8).ok
    assert not check.claim_accumulation_exact(2e-6, 8).ok
    with pytest.raises(CheckFailed, match="within 1 pt"):
        check.verify(check.claim_scaling_recovers(0.88, 0.85, 16))


def test_claim_margins_are_the_distance_to_the_threshold():
    ok = check.claim_scaling_recovers(0.8879, 0.8821, 16)
    assert ok.ok and ok.margin == pytest.approx(0.42) and ok.unit == "pts"
    bad = check.claim_scaling_recovers(0.88, 0.865, 16)
    assert not bad.ok and bad.margin == pytest.approx(-0.5)
    assert check.claim_naive_gap(0.8879, 0.8310, 16).margin == pytest.approx(3.69)
    assert check.claim_adaptive_beats_sgd(0.80, 0.81, 0.85, 128).margin == pytest.approx(5.0)
    assert check.claim_growth_matches_decay(0.88, 1000, 0.875, 1000).margin < 0  # not fewer
    exact = check.claim_accumulation_exact(1e-7, 16)
    assert exact.margin == pytest.approx(1.0) and exact.asserted("quick")
    assert not ok.asserted("quick") and ok.asserted("cpu")
    assert ok.result("quick") == "not asserted (quick)" and bad.result("cpu") == "FAIL"


# --------------------------------------------------------------- Trainer callbacks


def _toy(n=256, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long()
    return x, y


def _quiet_fit(trainer, loader, epochs):
    with contextlib.redirect_stdout(io.StringIO()):
        return trainer.fit(loader, epochs)


def test_grow_batch_callback_follows_the_schedule():
    x, y = _toy()
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = TensorLoader(x, y, 16, seed=0)
    growth = optim.BatchGrowth(16, 4, milestones=(1, 2))
    seen = []

    class Spy(optim.GrowBatch):
        def on_epoch_start(self, trainer, epoch):
            super().on_epoch_start(trainer, epoch)
            seen.append(loader.batch_size)

    trainer = Trainer(model, opt, callbacks=[Spy(loader, growth)], progress=False)
    _quiet_fit(trainer, loader, 3)
    assert seen == [16, 64, 256]
    assert trainer.step == growth.updates(256, 3) == 16 + 4 + 1


def test_grow_batch_takes_the_rest_of_the_decay_from_a_lambda_lr():
    x, y = _toy()
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = optim.lambda_lr(opt, optim.warmup(2, 0.5))
    loader = TensorLoader(x, y, 64, seed=0)
    growth = optim.BatchGrowth(64, 4, milestones=(1,), max_batch=128)
    trainer = Trainer(
        model, opt, scheduler=sched, callbacks=[optim.GrowBatch(loader, growth)], progress=False
    )
    history = _quiet_fit(trainer, loader, 2)
    lrs = [s["lr"] for s in history.steps]
    # epoch 0: warm-up 0.75, 1, 1, 1 at batch 64; epoch 1: batch 128 (×2 of ×4), LR × 1/2
    assert lrs == pytest.approx([0.75, 1.0, 1.0, 1.0, 0.5, 0.5])


def test_grow_batch_refuses_other_schedulers():
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = _toy()
    loader = TensorLoader(x, y, 64)
    trainer = Trainer(
        model,
        opt,
        scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
        callbacks=[optim.GrowBatch(loader, optim.BatchGrowth(64, 2, (1,)))],
        progress=False,
    )
    with pytest.raises(TypeError, match="LambdaLR"):
        _quiet_fit(trainer, loader, 1)


def test_trust_ratio_recorder_records_every_layer():
    x, y = _toy()
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = optim.LAMB(model.parameters(), lr=0.01, exclude_bias_and_norm=True)
    recorder = optim.TrustRatioRecorder(every=2)
    trainer = Trainer(model, opt, callbacks=[recorder], progress=False)
    _quiet_fit(trainer, TensorLoader(x, y, 32), 1)  # 8 updates
    assert [r["step"] for r in recorder.records] == [2, 4, 6, 8]
    last = recorder.records[-1]
    assert set(last) == {"step", "0.weight", "0.bias", "2.weight", "2.bias"}
    assert last["0.bias"] == 1.0  # excluded from the adaptation
    assert last["0.weight"] == float(opt.state[model[0].weight]["trust_ratio"])
    assert last["2.weight"] == float(opt.state[model[2].weight]["trust_ratio"])
    assert last["0.weight"] != last["2.weight"]


def test_trainer_accumulation_equals_one_batch(lab_modules):
    experiments, _ = lab_modules
    x, y = _toy(n=512, d=12, seed=1)

    def model_fn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 2))

    errors = experiments.accumulation_errors(model_fn, x, y, batch=128, micro_batch=16)
    assert errors["micro_batches"] == 8
    assert errors["grad"] < check.ACCUMULATION_TOL
    assert errors["weights"] < check.ACCUMULATION_TOL
    with pytest.raises(ValueError):
        experiments.accumulation_errors(model_fn, x, y, batch=100, micro_batch=16)


# ---------------------------------------------------------- experiments and science


def test_run_rejects_bad_configurations(lab_modules):
    experiments, _ = lab_modules
    with pytest.raises(ValueError, match="optimizer"):
        experiments.Run("x", 64, 0.1, optimizer="adam")
    with pytest.raises(ValueError, match="positive"):
        experiments.Run("x", 0, 0.1)


def test_schedule_warms_up_then_decays(lab_modules):
    experiments, _ = lab_modules
    setup = experiments.Setup(
        epochs=4, base_batch=64, decay="step", decay_at=(0.5, 0.75), gamma=0.25
    )
    run = experiments.Run("r", 256, 0.4, warmup_epochs=1)
    f = experiments.schedule(run, setup, steps_per_epoch=10)
    assert f(0) == pytest.approx(0.25 + 0.75 / 10)  # starts near the base-batch rate
    assert f(9) == 1.0 and f(19) == 1.0
    assert f(20) == pytest.approx(0.25) and f(30) == pytest.approx(0.0625)
    grow = experiments.schedule(experiments.Run("g", 64, 0.1, grow_batch=True), setup, 10)
    assert grow(35) == 1.0  # the batch grows instead


def test_claims_only_plan_trains_the_rates_that_decide_claim_3(lab_modules):
    """On the cpu profile the claims read, of each grid, the chosen rate and its
    neighbours; the best on validation is picked among the rates that were trained."""
    experiments, science = lab_modules
    from lab_utils import profile

    setup = experiments.setup_for(profile.Profile("cpu", torch.device("cpu"), 1, 1))
    plan = science.make_plan(setup)
    assert len(plan.runs()) == 7 + 9 and len(plan.runs(claims_only=True)) == 5 + 7
    lrs = {name: [r.lr for r in runs] for name, runs in plan.claim_grid.items()}
    assert lrs["sgd"] == [plan.grid["sgd"][1].lr, plan.grid["sgd"][2].lr]
    assert lrs["lars"] == [4.0, 8.0] and lrs["lamb"] == [0.04, 0.08, 0.16]
    trained = plan.runs(claims_only=True)
    val = {0.04: 0.84, 0.08: 0.86, 0.16: 0.18, 4.0: 0.83, 8.0: 0.82}
    summaries = {
        r: science.Summary(r, [val.get(r.lr, 0.81) - 0.01], [val.get(r.lr, 0.81)], 1, 0.0, 0)
        for r in trained
    }
    claims = science.evaluate_claims(
        plan, summaries, setup, {"grad": 0, "weights": 0, "micro_batches": 16}
    )
    assert "LARS 82.00%, LAMB 85.00%" in claims[2].measured
    full = science.make_plan(
        experiments.setup_for(profile.Profile("quick", torch.device("cpu"), 1, 1))
    )
    assert full.claim_grid == full.grid  # where the setup names no rates, all are read


@pytest.mark.slow
def test_science_quick_prints_every_claim(lab_modules, fashion_available, tmp_path, capsys):
    _, science = lab_modules
    out = tmp_path / "science.json"
    assert science.main(["--profile", "quick", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in (
        "naive batch",
        "linear scaling + warm-up",
        "LARS/LAMB beat SGD",
        "growing the batch",
        "gradient accumulation",
    ):
        assert name in text
    assert "FAIL" not in text  # quick runs cannot show the claims: they are not judged
    assert text.count("not asserted (quick)") == 4  # all but the exact accumulation claim
    import json

    record = json.loads(out.read_text())
    assert len(record["claims"]) == 5
    lines = text.splitlines()
    for claim in record["claims"]:  # each printed with the verdict the record holds
        assert claim["verdict"] in ("PASS", "not asserted (quick)")
        assert any(claim["name"] in ln and claim["verdict"] in ln for ln in lines), claim["name"]
    assert {r["label"] for r in record["runs"]} >= {"baseline B=32", "naive ×16"}
    acc = next(c for c in record["claims"] if "accumulation" in c["name"])
    assert acc["verdict"] == "PASS"


@pytest.mark.science
@pytest.mark.slow
@pytest.mark.timeout(3600)  # minutes of CPU; far longer on cores shared with other jobs
def test_claims_hold_on_the_cpu_profile(lab_modules, one_thread):
    """The five claims of the README on the ``cpu`` profile (real Fashion-MNIST, seed 0,
    one thread: deterministic), asserted; of each learning-rate grid at the largest batch
    only the rates that decide claim 3 are trained (``Setup.claim_lrs``). Each claim
    prints its margin (``pytest -rP`` shows it; a failure's message lists them all). Without the data it fails (it does
    not skip): CI must not pass without asserting the claims."""
    experiments, science = lab_modules
    from lab_utils import profile

    setup = experiments.setup_for(profile.Profile("cpu", torch.device("cpu"), 1, 1))
    splits = experiments.load_splits(setup)
    plan = science.make_plan(setup)
    with contextlib.redirect_stderr(io.StringIO()):
        summaries = science.run_plan(
            plan, setup, splits, seeds=[0], progress=False, claims_only=True
        )
    claims = science.evaluate_claims(
        plan, summaries, setup, science.measure_accumulation(setup, splits)
    )
    for c in claims:
        print(c.line())
    assert len(claims) == 5
    assert all(c.ok for c in claims), "\n".join(c.line() for c in claims)


@pytest.mark.launcher
@pytest.mark.slow
def test_recipe_script_two_workers_equal_one_large_batch(fashion_available, monkeypatch):
    """Two workers under torchrun (DDP) train as one process with their global batch.
    The one-process run is the script's ``main()`` in this process, as notebook 3 calls
    it (one worker joins no group: no DDP); only the two-worker job needs a launcher."""
    from lab_utils import launch

    script = LAB / "scripts" / "train_large_batch.py"
    args = ["--epochs", "1", "--n-train", "1024", "--n-test", "500", "--base-batch", "32"]
    two = launch.run(
        script,
        [*args, "--batch-per-worker", "64"],
        nprocs=2,
        env={"LABS_PROFILE": "quick"},
        timeout=180,
        echo=False,
    ).check()
    monkeypatch.setenv("LABS_PROFILE", "quick")  # the same defaults as the launched job
    monkeypatch.syspath_prepend(str(script.parent))
    import train_large_batch

    threads = torch.get_num_threads()  # the script sets this process's; give it back
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's epoch lines
            s1 = train_large_batch.main([*args, "--batch-per-worker", "128"])
    finally:
        torch.set_num_threads(threads)
    s2 = two.metrics[-1]
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    assert s2["global_batch"] == s1["global_batch"] == 128
    base_lr = lab3_settings.RECIPE.of("quick").base_lr  # the script's default
    assert s2["lr"] == s1["lr"] == pytest.approx(base_lr * 128 / 32)
    assert s2["updates"] == s1["updates"] == 8
    assert abs(s2["test_acc"] - s1["test_acc"]) <= 0.01


# ---------------------------------------------------------------------------- plots


def test_plots_draw_what_they_are_given():
    import matplotlib

    matplotlib.use("Agg")
    from types import SimpleNamespace as NS

    import matplotlib.pyplot as plt

    import lab3_plots as lplots

    def result(label, acc, diverged=False):
        return NS(
            run=NS(label=label, batch=64),
            test_acc=acc,
            diverged=diverged,
            updates=10,
            steps=[{"loss": 2.0 / (i + 1)} for i in range(10)],
            epochs=[
                {"epoch": 1, "step": 5, "val_acc": acc},
                {"epoch": 2, "step": 10, "val_acc": acc},
            ],
        )

    runs = [result("a", 0.8), result("b", 0.85), result("c", 0.1, diverged=True)]
    ax = lplots.accuracy_bars(runs, baseline=0.8)
    assert len(ax.patches) == 3 and ax.get_ylim()[0] > 50  # zoomed on the runs that trained
    assert [t.get_text() for t in ax.texts][-1] == "diverged"
    assert len(lplots.loss_per_step(runs).lines) == 3
    assert len(lplots.accuracy_vs_updates(runs).lines) == 3
    records = [{"step": s, "0.weight": 0.01 * s, "0.bias": 1.0, "2.weight": 0.02} for s in (1, 2)]
    assert len(lplots.trust_ratios(records).lines) == 2  # the constant bias ratio is skipped
    with pytest.raises(ValueError, match="no trust ratios"):
        lplots.trust_ratios([])
    assert len(lplots.schedules({"w": optim.warmup(3), "c": optim.lr_schedule(9)}, 9).lines) == 2
    fig = lplots.batch_growth(optim.BatchGrowth(64, 4, (2, 3)), 0.1, 4, 0.25)
    assert [line.get_ydata()[-1] for line in fig.axes[1].lines] == [64, 1024]
    plt.close("all")


def _toy_splits(experiments, n_train=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n_train + 128, 1, 8, 8), generator=g, dtype=torch.uint8)
    y = (x.float().mean(dim=(1, 2, 3)) > 127.5).long()
    return experiments.Splits(
        x[:n_train],
        y[:n_train],
        x[n_train : n_train + 64],
        y[n_train : n_train + 64],
        x[n_train + 64 :],
        y[n_train + 64 :],
        (0.5,),
        (0.29,),
        (1, 8, 8),
        2,
    )


def test_train_emulates_a_large_batch_with_micro_batches(lab_modules):
    experiments, _ = lab_modules
    splits = _toy_splits(experiments)
    setup = experiments.Setup(
        model_kwargs={"hidden": (16,)}, n_train=256, epochs=2, base_batch=16, base_lr=0.05
    )
    run = experiments.Run("big", 64, 0.2, warmup_epochs=1)
    with contextlib.redirect_stdout(io.StringIO()):
        one = experiments.train(run, setup, splits, device=torch.device("cpu"))
        acc = experiments.train(
            run, replace(setup, micro_batch=16), splits, device=torch.device("cpu")
        )
    assert one.updates == acc.updates == 2 * 256 // 64
    assert [s["lr"] for s in one.steps] == pytest.approx([s["lr"] for s in acc.steps])
    # per-step logs hold the last micro-batch's loss; the epoch's mean loss is the same
    assert one.epochs[-1]["train_loss"] == pytest.approx(acc.epochs[-1]["train_loss"], rel=1e-5)
    assert one.test_acc == acc.test_acc and one.val_acc == acc.val_acc
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        experiments.train(
            experiments.Run("odd", 48, 0.1),
            replace(setup, micro_batch=32),
            splits,
            device=torch.device("cpu"),
        )


def test_train_reports_divergence_instead_of_raising(lab_modules):
    experiments, _ = lab_modules
    splits = _toy_splits(experiments)
    setup = experiments.Setup(
        model_kwargs={"hidden": (16,)}, n_train=256, epochs=2, base_batch=16, base_lr=0.05
    )
    with contextlib.redirect_stdout(io.StringIO()):
        result = experiments.train(
            experiments.Run("huge lr", 16, 1e6), setup, splits, device=torch.device("cpu")
        )
    assert result.diverged
