"""Lab 5 beyond the parameter server: EASGD's averaging baseline is synchronous SGD,
a killed rank resumes to the uninterrupted run's weights, elastic training starts afresh
each run and refuses launchers that cannot restart it,
the graphs notebook runs without stderr, Hogwild's speed conclusion follows the numbers,
the failure-cost figure draws the measured parts, and the README's commands name real
paths."""

from __future__ import annotations

import os
import re
import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TEST_TAG, processes_matching

import lab5_checks as checks
import lab5_plots as plots
from lab_utils import launch, models, tensordata
from lab_utils.source import load_script

matplotlib.use("Agg")

LAB = REPO / "labs" / "lab5_systems"
SCRIPTS = LAB / "scripts"
QUICK = {"LABS_PROFILE": "quick"}


# ------------------------------------------------------------------ EASGD's baseline
def synchronous_sgd(
    steps: int, workers: int, batch: int, n_train: int, lr: float, hidden: int
) -> dict[str, torch.Tensor]:
    """Plain synchronous SGD in one process: every worker's batch gradient taken at the
    one shared set of weights, averaged, one step."""
    torch.manual_seed(0)
    model = models.build("mlp", hidden=(hidden,))
    data = tensordata.load(n_train, 100, seed=0)
    for step in range(1, steps + 1):  # the script counts its steps from 1
        grads = []
        for worker in range(workers):
            idx = tensordata.batch_indices(n_train, batch, seed=0, worker=worker, step=step)
            model.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p, *gs in zip(model.parameters(), *grads, strict=True):
                p -= lr * torch.stack(gs).mean(0)
    return model.state_dict()


@pytest.mark.launcher
def test_easgd_sgd_at_tau_1_is_synchronous_sgd(tmp_path):
    steps, batch, n_train, lr, hidden = 24, 32, 1000, 0.05, 32
    out = tmp_path / "centre.pt"
    launch.run(
        SCRIPTS / "easgd.py",
        [
            "--methods",
            "sgd",
            "--taus",
            "1",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--lr",
            str(lr),
            "--hidden",
            str(hidden),
            "--n-train",
            str(n_train),
            "--n-test",
            "100",
            "--eval-every",
            "100",
            "--save",
            str(out),
        ],
        nprocs=2,
        timeout=120,
        echo=False,
        env=QUICK,
    ).check()
    served = models.read_checkpoint(out)["state_dict"]
    want = synchronous_sgd(steps, 2, batch, n_train, lr, hidden)
    for name, p in want.items():
        torch.testing.assert_close(served[name], p, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ elastic training
ELASTIC = SCRIPTS / "elastic_train.py"
# The run every elastic job here trains: 30 steps, a checkpoint every 10.
ELASTIC_ARGS = [
    "--steps",
    "30",
    "--n-train",
    "1000",
    "--n-test",
    "100",
    "--hidden",
    "32",
    "--ckpt-every",
    "10",
]


@dataclass
class ElasticRuns:
    """One uninterrupted run, and the same killed-and-restarted command run twice in a
    row from one folder; each job's final weights."""

    clean: launch.LaunchResult
    clean_weights: dict[str, torch.Tensor]
    killed: list[launch.LaunchResult]
    killed_weights: list[dict[str, torch.Tensor]]
    cwd: Path  # where the killed runs were started
    runs: Path  # their LABS_RUNS
    left: list  # their processes still alive after the last job


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory) -> ElasticRuns:
    """Three jobs serve the elastic tests (each test reads other facts of them): a
    restart costs a fresh process per rank, so each killed job starts torch four times."""
    out, cwd = tmp_path_factory.mktemp("elastic_out"), tmp_path_factory.mktemp("elastic_cwd")
    runs = tmp_path_factory.mktemp("elastic_runs")
    with pytest.MonkeyPatch.context() as mp:  # what conftest's per-test fixture gives a test
        mp.setenv("LABS_RUNS", str(runs))
        mp.setenv(TEST_TAG, uuid.uuid4().hex)

        def job(name: str, *extra: str, restarts: int, at: Path) -> launch.LaunchResult:
            return launch.run(
                ELASTIC,
                [*ELASTIC_ARGS, "--out", str(out / f"{name}.pt"), *extra],
                nprocs=2,
                timeout=180,
                echo=False,
                env=QUICK,
                cwd=at,
                launcher_args=[f"--max-restarts={restarts}"],
            ).check()

        def weights(name: str) -> dict[str, torch.Tensor]:
            return torch.load(out / f"{name}.pt", weights_only=True)["state_dict"]

        clean = job("clean", restarts=0, at=out)
        # The README's command twice from the same folder: killed at step 25, resumed from 20.
        killed = [job(f"killed{i}", "--kill-at", "25", restarts=1, at=cwd) for i in range(2)]
        left = processes_matching(str(ELASTIC))
    return ElasticRuns(
        clean, weights("clean"), killed, [weights("killed0"), weights("killed1")], cwd, runs, left
    )


@pytest.mark.launcher
@pytest.mark.slow
def test_killed_rank_resumes_to_the_uninterrupted_weights(elastic_runs):
    killed = elastic_runs.killed[0]
    assert "rank 1: SIGKILL at step 25" in killed.output
    assert "attempt 1: starting at step 20" in killed.output
    starts = killed.events("elastic_start")
    assert [(m["attempt"], m["step"]) for m in starts] == [(0, 0), (1, 20)]
    assert [m["attempt"] for m in elastic_runs.clean.events("elastic_start")] == [0]
    checks.check_resume_equal(elastic_runs.killed_weights[0], elastic_runs.clean_weights)
    assert elastic_runs.left == []


@pytest.mark.launcher
@pytest.mark.slow
def test_elastic_runs_in_a_row_each_kill_and_restart(elastic_runs):
    # The same command twice from the same folder (the README's): each run starts from
    # step 0 in a folder of its own, is killed at step 25 and resumes from step 20.
    folders, sums = [], []
    for job in elastic_runs.killed:
        assert "rank 1: SIGKILL at step 25" in job.output
        starts = job.events("elastic_start")
        assert [(m["attempt"], m["step"]) for m in starts] == [(0, 0), (1, 20)]
        kill = job.event("elastic_kill")
        assert kill["step"] - starts[1]["step"] == 5  # steps redone: a count
        assert starts[1]["ready"] > kill["time"]  # the restart took time after the kill
        assert len(job.events("elastic_ckpt")) == 3  # 10, 20 (again), 30
        done = job.event("elastic_done")
        assert done["steps_run"] == 10 and done["step_s"] > 0
        folders.append(starts[0]["ckpt_dir"])
        sums.append(done["checksum"])
    assert folders[0] != folders[1] and sums[0] == sums[1]
    assert all(str(f).startswith(str(elastic_runs.runs)) for f in folders)
    assert not any(elastic_runs.cwd.iterdir())  # nothing written into the working directory
    assert elastic_runs.left == []


def test_elastic_first_attempt_refuses_a_used_checkpoint(tmp_path):
    elastic = load_script(SCRIPTS / "elastic_train.py")
    ckpt = tmp_path / "checkpoint.pt"
    elastic.refuse_stale(ckpt, attempt=0, resume=False)  # none there: fine
    ckpt.write_bytes(b"x")
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        elastic.refuse_stale(ckpt, attempt=0, resume=False)
    elastic.refuse_stale(ckpt, attempt=0, resume=True)
    elastic.refuse_stale(ckpt, attempt=1, resume=False)  # a restart resumes: that is the point


@pytest.mark.launcher
def test_elastic_refuses_mpirun(tmp_path):
    job = launch.run(
        ELASTIC,
        ["--steps", "5", "--n-train", "1000"],
        nprocs=2,
        launcher="mpirun",
        timeout=120,
        echo=False,
        env=QUICK,
        cwd=tmp_path,
    )
    assert job.returncode != 0 and not job.timed_out
    assert "needs torchrun's agent" in job.output and "'mpirun'" in job.output
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ graphs notebook
@pytest.mark.slow
def test_graphs_notebook_writes_nothing_to_stderr():
    pytest.importorskip("nbclient")
    from benchmarks.notebooks import run_notebook

    env = {**os.environ, "LABS_PROFILE": "quick", "LABS_SOLUTIONS": "1"}
    nb, _ = run_notebook(LAB / "05_graphs.ipynb", env, cell_timeout=300)
    stderr = [
        (i, "".join(o.get("text", ""))[:300])
        for i, c in enumerate(nb.cells)
        for o in c.get("outputs", [])
        if o.get("name") == "stderr"
    ]
    assert not stderr, stderr


# ------------------------------------------------------------------ Hogwild! speed
def _hogwild(model: str, lock: bool, rate: float) -> dict:
    return {"model": model, "lock": lock, "updates_per_s": rate}


@pytest.mark.parametrize(
    "dense_lock, dense_free, word", [(727.0, 439.0, "the lock"), (439.0, 727.0, "no lock")]
)
def test_hogwild_speed_conclusion_follows_the_numbers(capsys, dense_lock, dense_free, word):
    checks.show_lock_speed(
        [_hogwild("dense", True, dense_lock), _hogwild("dense", False, dense_free)]
    )
    out = capsys.readouterr().out
    assert f"dense model: {word} gave more updates per second" in out, out
    assert "shown, not asserted" in out


def test_hogwild_figure_labels_its_axes_and_keeps_the_legend_off_the_bars():
    recs = [
        dict(_hogwild(m, lk, 500.0), acc=0.8, collided_when_overlapping=0.5)
        for m in ("dense", "sparse")
        for lk in (True, False)
    ]
    fig = plots.hogwild(recs)
    assert all(ax.get_ylabel() for ax in fig.axes)
    legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in fig.axes:
        for bar in ax.patches:
            assert not box.overlaps(bar.get_window_extent()), "the legend covers a bar"


# ------------------------------------------------------------------ failure cost figure
def test_time_lost_stacks_the_measured_parts():
    rows = [
        {"interval": 50, "redone": 40, "restart_s": 6.0, "redo_s": 0.4, "ckpt_s": 0.1},
        {"interval": 10, "redone": 5, "restart_s": 5.0, "redo_s": 0.05, "ckpt_s": 0.5},
    ]
    ax = plots.time_lost(rows)
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([5.0, 6.0, 0.05, 0.4, 0.5, 0.1])  # sorted by interval
    tops = [p.get_y() + p.get_height() for p in ax.patches]
    assert max(tops) == pytest.approx(6.5) and ax.get_ylim()[0] == 0


# ------------------------------------------------------------------ README
def test_readme_script_commands_run_from_the_lab_folder():
    readme = (LAB / "README.md").read_text()
    commands = re.findall(r"^\| `\w+\.py` \| `([^`]+)` \|", readme, flags=re.M)
    assert len(commands) == 4, commands
    for cmd in commands:
        paths = [w for w in shlex.split(cmd) if w.endswith(".py")]
        assert len(paths) == 1 and (LAB / paths[0]).is_file(), f"{cmd}: no such file from {LAB}"
