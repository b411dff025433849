"""Lab 5's parameter server: the staleness a run logs against what the counts predict, the
accuracy curve over the whole run, the throughput sweep's figure, the Adam exercise, and
jobs whose worker or server dies.
"""

from __future__ import annotations

import ast
import json

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, processes_matching

import lab5_checks as checks
import lab5_plots as plots
import lab5_solutions as solutions
from lab_utils import exercises, launch, models, tensordata
from lab_utils.checks import CheckFailed

LAB = REPO / "labs" / "lab5_systems"
SCRIPT = LAB / "scripts" / "param_server.py"
QUICK = {"LABS_PROFILE": "quick"}


def ps_job(args, nprocs=3, timeout=120, tmp=None):
    env = dict(QUICK, LABS_RUNS=str(tmp)) if tmp else QUICK
    return launch.run(
        SCRIPT, [str(a) for a in args], nprocs=nprocs, timeout=timeout, echo=False, env=env
    )


# ------------------------------------------------------------------ logs built by hand
def round_robin(workers: int, rounds: int, slow: int = 1) -> list[tuple[int, int, int]]:
    """The push log of workers that compute in lockstep, the last one ``slow`` times
    slower: (worker, version pulled, version when applied), in the order applied."""
    pulled = dict.fromkeys(range(workers), 0)
    log: list[tuple[int, int, int]] = []
    for r in range(rounds):
        for w in range(workers):
            if w == workers - 1 and (r + 1) % slow:
                continue
            log.append((w, pulled[w], len(log)))
            pulled[w] = len(log)  # the answer carries the new version
    return log


def summary_of(log, mode="async", workers=None, straggler=1):
    staleness = [a - p for _, p, a in log]
    return {
        "mode": mode,
        "pushes": [list(x) for x in log],
        "staleness": staleness,
        "updates": len(log),
        "gradients": len(log),
        "workers": workers or len({w for w, _, _ in log}),
        "straggler": straggler,
        "mean_staleness": sum(staleness) / len(staleness),
        "max_staleness": max(staleness),
    }


def test_equal_workers_in_lockstep_are_w_minus_1_stale_but_for_their_first_push(capsys):
    s = summary_of(round_robin(4, 10))
    per = checks.staleness_by_worker(s)
    assert [c["n"] for c in per.values()] == [10] * 4
    # All pull version 0 together; worker w's last push leaves 3 − w updates after it.
    assert [(c["head"], c["tail"]) for c in per.values()] == [(0, 3), (0, 2), (0, 1), (0, 0)]
    assert s["staleness"][4:] == [3] * 36
    checks.check_async_server(s)
    checks.check_staleness_prediction(s)
    out = capsys.readouterr().out
    assert "worker 0: mean staleness 2.70 = predicted 3.00 − 0.30 (3 updates outside its run" in out
    assert "shown, not asserted" in out  # the share at exactly W − 1 depends on timing


def test_a_straggler_k_times_slower_is_k_times_w_minus_1_stale(capsys):
    s = summary_of(round_robin(4, 12, slow=3), straggler=3)
    checks.check_async_server(s)
    checks.check_staleness_prediction(s)
    out = capsys.readouterr().out
    assert "straggler's prediction (N − n)/n = K·(W − 1) = 9" in out
    assert "worker 3 (straggler, 3× slower): mean staleness 9.00 = predicted 9.00 − 0.00" in out
    assert (
        "worker 0: mean staleness 2.08 = predicted 2.33 − 0.25" in out
    )  # W − 2 + 1/K, less its edge
    # The same log claimed with a different K: the prediction from the counts fails.
    with pytest.raises(CheckFailed, match="K·\\(W − 1\\) = 6"):
        checks.check_staleness_prediction(dict(s, straggler=2))


def test_the_staleness_checks_catch_a_worker_that_keeps_its_first_weights():
    log = [(w, 0, a) for a, w in enumerate([0, 1] * 5)]  # never installs the answers
    with pytest.raises(CheckFailed, match="its own previous push returned"):
        checks.check_async_server(summary_of(log))
    with pytest.raises(CheckFailed, match="worker 0: mean staleness"):
        checks.check_staleness_prediction(summary_of(log))


def test_the_async_checks_catch_lost_or_merged_updates():
    s = summary_of(round_robin(2, 4))
    with pytest.raises(CheckFailed, match="one update"):
        checks.check_async_server(dict(s, updates=s["updates"] - 1))
    with pytest.raises(CheckFailed, match="negative"):
        checks.check_async_server(dict(s, staleness=[-1] + s["staleness"][1:]))


def test_sync_claims_can_fail():
    s = summary_of([(0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)], mode="sync")
    checks.check_sync_server(dict(s, updates=2, staleness=[0, 0, 0, 0]))
    with pytest.raises(CheckFailed, match="1 stale"):
        checks.check_sync_server(dict(s, updates=2, staleness=[0, 1, 0, 0]))
    with pytest.raises(CheckFailed, match="one update per N"):
        checks.check_sync_server(dict(s, updates=4, staleness=[0, 0, 0, 0]))


# ------------------------------------------------------------------ the accuracy curve
def test_the_accuracy_curve_check_wants_the_whole_run():
    summary = {"mode": "async", "updates": 40, "final_acc": 0.8}
    curve = [
        {"updates": 0, "t": 0.0, "acc": 0.1},
        {"updates": 20, "t": 1.0, "acc": 0.7},
        {"updates": 40, "t": 2.0, "acc": 0.8},
    ]
    checks.check_accuracy_curve(summary, curve)
    with pytest.raises(CheckFailed, match="last point at the last update"):
        checks.check_accuracy_curve(summary, curve[:2])
    with pytest.raises(CheckFailed, match="ends at the final accuracy"):
        checks.check_accuracy_curve(summary, curve[:2] + [dict(curve[2], acc=0.77)])
    # One worker's snapshots, dated by that worker: no update counts to span the run by.
    with pytest.raises(CheckFailed, match="server's update counts"):
        checks.check_accuracy_curve(summary, [{"t": 0.0, "acc": 0.1}, {"t": 1.1, "acc": 0.77}])


# ------------------------------------------------------------------ the sweep's figure
def _row(mode, workers, steps=100, shards=1):
    return {
        "mode": mode,
        "workers": workers,
        "shards": shards,
        "steps": steps,
        "grads_per_s": 100.0 * workers,
        "server_busy": [0.05 * workers] * shards,
    }


def test_throughput_refuses_a_sweep_of_runs_of_different_lengths():
    with pytest.raises(ValueError, match="different lengths"):
        plots.throughput([_row("async", 1), _row("async", 2, steps=300)])


def test_throughput_has_whole_worker_ticks_and_a_legend_that_hides_nothing():
    rows = [_row(m, w) for m in ("async", "sync") for w in (1, 2, 4)] + [_row("async", 2, shards=2)]
    fig = plots.throughput(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
    assert legends, "the figure has no legend"
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [1, 2, 4]
        for legend in legends:
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert len(legends[0].get_texts()) == 3  # async, sync, async with 2 shards


def test_the_staleness_legend_hides_no_bar():
    fig = plots.staleness_histogram(
        {"equal workers": [3] * 30 + [2, 4], "straggler": [9, 8, 7], "the others": [2, 3] * 10},
        cap=12,
    )
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legends = fig.legends + ([ax.get_legend()] if ax.get_legend() else [])
    assert len(legends) == 1 and len(legends[0].get_texts()) == 3
    assert not legends[0].get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


# ------------------------------------------------------------------ the Adam exercise
def test_adam_check_accepts_the_reference():
    checks.check_adam_server_update(solutions.adam_server_update)


def _adam_without_bias_correction(param, grads, m, v, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
    g = torch.stack(grads).mean(0)
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    return param - lr * m / (v.sqrt() + eps), m, v


def _adam_on_the_sum(param, grads, m, v, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
    return solutions.adam_server_update(
        param, [torch.stack(grads).sum(0)], m, v, step, lr, betas, eps
    )


def _sgd_instead(param, grads, m, v, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
    return param - lr * torch.stack(grads).mean(0), m, v


@pytest.mark.parametrize(
    "wrong, message",
    [
        (_adam_without_bias_correction, "no bias correction"),
        (_adam_on_the_sum, "sum"),
        (_sgd_instead, "differs"),
    ],
)
def test_adam_check_rejects_wrong_updates(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_adam_server_update(wrong)


def test_the_adam_exercise_cell_follows_the_exercise_convention():
    nb = json.loads((LAB / "02_adam_on_server.ipynb").read_text())
    decorated = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.parse("".join(cell["source"])).body:
            if isinstance(node, ast.FunctionDef):
                decorated[node.name] = [ast.unparse(d) for d in node.decorator_list]
    assert decorated["adam_server_update"] == ["exercise('lab5.adam_server_update')"]
    # So a later cell's NameError, when the exercise cell was never run, names the exercise.
    hint = exercises.downstream_hint(
        NameError("name 'adam_server_update' is not defined", name="adam_server_update")
    )
    assert hint and "lab5.adam_server_update" in hint


# ------------------------------------------------------------------ jobs
# One asynchronous job serves the straggler's staleness and the accuracy curve (each test
# reads other facts of it): 2 shards and 3 workers, the last one K times slower.
WORKERS, SHARDS, STEPS, K, DELAY = 3, 2, 12, 3, 0.05


@pytest.fixture(scope="module")
def async_job(tmp_path_factory) -> launch.LaunchResult:
    return ps_job(
        [
            "--mode",
            "async",
            "--shards",
            SHARDS,
            "--steps",
            STEPS,
            "--delay",
            DELAY,
            "--straggler",
            K,
            "--snapshots",
            4,
            "--n-train",
            500,
            "--n-test",
            200,
            "--hidden",
            32,
        ],
        nprocs=SHARDS + WORKERS,
        tmp=tmp_path_factory.mktemp("ps_async"),
    ).check()


@pytest.mark.launcher
def test_simulated_compute_with_a_straggler_gives_the_counted_staleness(async_job, capsys):
    s = async_job.event("ps_summary")
    assert (s["steps"], s["delay"], s["straggler"]) == (STEPS, DELAY, K)
    assert (s["workers"], s["shards"]) == (WORKERS, SHARDS)
    per = checks.staleness_by_worker(s)
    assert [per[w]["n"] for w in range(WORKERS)] == [STEPS, STEPS, STEPS // K]
    checks.check_async_server(s)
    checks.check_staleness_prediction(s)
    assert "K·(W − 1) = 6" in capsys.readouterr().out
    assert s["wall_s"] >= STEPS * DELAY  # a sleep never ends early: the compute was simulated


@pytest.mark.launcher
def test_the_accuracy_curve_is_the_servers_model_over_the_whole_run(async_job):
    s = async_job.event("ps_summary")
    curve = async_job.events("ps_eval")
    checks.check_accuracy_curve(s, curve)  # from update 0 to the last, ending at final_acc
    # Each shard applies 12 + 12 + 4 pushes: 4 snapshots evenly spaced over 28 updates.
    assert [p["updates"] for p in curve] == [0, 7, 14, 21, 28]
    times = [p["t"] for p in curve]
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] == pytest.approx(s["last_update_s"]) and times[-1] <= s["wall_s"]


@pytest.mark.launcher
@pytest.mark.parametrize(
    "mode, crash, who", [("sync", "worker:4", "worker 1"), ("async", "server:6", "server")]
)
def test_a_dead_worker_or_server_ends_the_job(mode, crash, who):
    timeout = 120
    result = ps_job(
        [
            "--mode",
            mode,
            "--steps",
            "40",
            "--n-train",
            "1000",
            "--n-test",
            "100",
            "--crash",
            crash,
            "--rpc-timeout",
            "30",
        ],
        timeout=timeout,
    )
    assert not result.ok and not result.timed_out and result.elapsed < timeout
    assert f"{who}: simulated crash" in result.output
    assert "exitcode" in result.output  # torchrun names the process that failed
    assert processes_matching(str(SCRIPT)) == []


@pytest.mark.launcher
def test_sync_server_adam_equals_torch_adam_on_the_averaged_gradient(tmp_path):
    steps, batch, n_train, lr, hidden = 4, 16, 500, 0.01, 32
    out = tmp_path / "ps.pt"
    result = ps_job(
        [
            "--mode",
            "sync",
            "--optimizer",
            "adam",
            "--steps",
            steps,
            "--batch-size",
            batch,
            "--lr",
            lr,
            "--hidden",
            hidden,
            "--n-train",
            n_train,
            "--n-test",
            100,
            "--save",
            out,
        ],
        tmp=tmp_path,
    ).check()
    summary = result.event("ps_summary")
    assert summary["updates"] == steps and summary["gradients"] == 2 * steps
    # The same computation in one process: both workers' gradients at the same weights,
    # averaged, one torch.optim.Adam step.
    torch.manual_seed(0)
    model = models.build("mlp", hidden=(hidden,))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = tensordata.load(n_train, 100, seed=0)
    for step in range(steps):
        grads = []
        for worker in range(2):
            idx = tensordata.batch_indices(n_train, batch, seed=0, worker=worker, step=step)
            model.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    served = models.read_checkpoint(out)["state_dict"]
    for name, p in model.state_dict().items():
        torch.testing.assert_close(served[name], p, rtol=1e-6, atol=1e-7)
