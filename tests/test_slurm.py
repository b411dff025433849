"""The course's sbatch files, run for real on a one-node Slurm cluster.

The session's cluster (the ``slurm`` fixture of conftest.py, lab_utils.slurm_cluster)
runs Lab 2's DDP script through ``srun torchrun`` with a c10d rendezvous and through
one Slurm task per process, the Horovod script through ``srun --mpi=pmix``, and Lab 4's
hybrid.py with one task per process, all in the quick profile on 2 processes; each
job's output shows its ranks and what it trained. A cluster started and then left by
an error or by Ctrl-C leaves no daemon and no job process behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lab_utils import daemons, slurm_cluster

REPO = Path(__file__).resolve().parents[1]
LAB2 = REPO / "labs" / "lab2_data_parallel"
LAB4 = REPO / "labs" / "lab4_model_parallel"
# The one-node commands of Lab 2's README, run here as written (all submitted at once,
# without --wait), and Lab 4's hybrid.py the same way on 2 tasks.
README_JOBS = {
    "ddp_torchrun": "PROCS_PER_NODE=2 LABS_PROFILE=quick sbatch --wait --nodes=1 --gpus-per-node=0 "
    "--cpus-per-task=2 slurm/train_ddp.sbatch",
    "ddp_tasks": "LABS_PROFILE=quick sbatch --wait --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 "
    "--cpus-per-task=1 slurm/train_ddp_tasks.sbatch",
    "horovod": "LABS_PROFILE=quick sbatch --wait --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 "
    "--cpus-per-task=1 slurm/train_horovod.sbatch",
}
HYBRID = (
    "TP=2 HYBRID_ARGS='--d-model 32 --heads 4 --layers 2 --seq-len 16 --batch-size 8 "
    "--steps 2 --n-chars 20000' LABS_PROFILE=quick sbatch --wait --nodes=1 "
    "--ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 slurm/hybrid.sbatch"
)
JOBS = {**{k: (LAB2, v) for k, v in README_JOBS.items()}, "hybrid": (LAB4, HYBRID)}
CHANCE = 0.1  # ten classes


def job_env(cluster: slurm_cluster.Cluster, runs: Path, extra: dict[str, str]) -> dict[str, str]:
    """What a student's shell would hold: the venv on PATH; runs outside the checkout."""
    env = cluster.env()
    env.update(
        extra, LABS_RUNS=str(runs), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    )
    return env


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 sbatch --wait OPTS FILE`` -> the environment and sbatch's arguments
    (without --wait: the fixture submits every job at once and waits itself)."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[:2] == ["sbatch", "--wait"], command
    return env, words[2:]


def wait_for(cluster: slurm_cluster.Cluster, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not cluster.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i"]).stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"jobs {ids} still queued after {timeout:g} s")


def job_field(cluster: slurm_cluster.Cluster, job: str, name: str) -> str:
    text = cluster.run(["scontrol", "show", "job", "-o", job]).stdout
    return re.search(rf"\b{name}=(\S+)", text).group(1)


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory) -> dict[str, dict]:
    """Submit the four jobs at once (Slurm runs them as the node's 2 CPUs allow); their
    state, run time and output."""
    tmp = tmp_path_factory.mktemp("sbatch")
    ids = {}
    for name, (folder, command) in JOBS.items():
        extra, args = split(command)
        done = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp}/{name}-%j.out", *args],
            cwd=folder,
            capture_output=True,
            text=True,
            env=job_env(slurm, tmp / "runs", extra),
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        ids[name] = done.stdout.strip()
    wait_for(slurm, list(ids.values()), timeout=600)
    return {
        name: {
            "state": job_field(slurm, job, "JobState"),
            "run_time": job_field(slurm, job, "RunTime"),
            "output": (tmp / f"{name}-{job}.out").read_text(),
        }
        for name, job in ids.items()
    }


def summary(output: str) -> dict:
    """The job's last line: ``summary: {...}``, the script's own metrics record."""
    line = [ln for ln in output.splitlines() if ln.startswith("summary: ")][-1]
    return json.loads(line.removeprefix("summary: "))


def test_the_cluster_is_one_idle_node_that_runs_two_tasks(slurm) -> None:
    assert slurm.node_state() == "idle" or slurm.node_state().startswith(("mix", "alloc"))
    out = slurm.run(["srun", "-N1", "-n2", "hostname"], timeout=120).stdout.split()
    assert len(out) == 2 and set(out) == {slurm.node}


@pytest.mark.launcher
@pytest.mark.timeout(900)  # the first to need the 4 jobs waits for all
def test_ddp_through_srun_torchrun(jobs) -> None:
    job = jobs["ddp_torchrun"]
    assert job["state"] == "COMPLETED", job["output"]
    assert "1 node(s) x 2 process(es)" in job["output"]
    assert "0: torchrun on" in job["output"]  # one torchrun, on the one node
    s = summary(job["output"])
    assert (s["world_size"], s["launcher"]) == (2, "torchrun")
    assert s["val_acc"] > 2 * CHANCE, job["output"]


@pytest.mark.launcher
@pytest.mark.timeout(900)  # the first to need the 4 jobs waits for all
def test_ddp_with_one_slurm_task_per_process(jobs) -> None:
    job = jobs["ddp_tasks"]
    assert job["state"] == "COMPLETED", job["output"]
    for rank in (0, 1):  # srun --label: each task says which rank Slurm gave it
        assert f"{rank}: rank {rank} of 2, local rank {rank} on" in job["output"]
    s = summary(job["output"])
    # SLURM_PROCID / SLURM_NTASKS read by set_torch_env_from_launcher: the same two ranks
    # as under torchrun, so the same seeded training to the same accuracy.
    assert (s["world_size"], s["launcher"]) == (2, "slurm")
    assert s["val_acc"] == summary(jobs["ddp_torchrun"]["output"])["val_acc"]


@pytest.mark.launcher
@pytest.mark.timeout(900)  # the first to need the 4 jobs waits for all
def test_horovod_through_srun(jobs) -> None:
    job = jobs["horovod"]
    assert job["state"] == "COMPLETED", job["output"]
    for rank in (0, 1):
        assert f"{rank}: rank {rank} of 2" in job["output"]
    s = summary(job["output"])
    assert (s["world_size"], s["script"]) == (2, "horovod")  # both tasks in one Horovod job
    assert s["val_acc"] > 2 * CHANCE, job["output"]


@pytest.mark.launcher
@pytest.mark.timeout(900)  # the first to need the 4 jobs waits for all
def test_hybrid_with_one_slurm_task_per_process(jobs) -> None:
    job = jobs["hybrid"]
    assert job["state"] == "COMPLETED", job["output"]
    assert "mesh dp=1 × tp=2: weights vs one process" in job["output"]
    s = summary(job["output"])
    assert (s["dp"], s["tp"]) == (1, 2)
    assert s["weights_rel_err"] < 1e-4  # split over 2 ranks, the same weights as one process


def test_the_readme_gives_the_commands_run_here() -> None:
    text = " ".join((LAB2 / "README.md").read_text().split())
    for command in README_JOBS.values():
        assert command in text, command


def test_sbatch_files_keep_their_multi_node_defaults() -> None:
    for path in [*LAB2.glob("slurm/*.sbatch"), *LAB4.glob("slurm/*.sbatch")]:
        text = path.read_text()
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text, path
        subprocess.run(["bash", "-n", str(path)], check=True)


# --------------------------------------------------------------------------- teardown
CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from lab_utils import slurm_cluster
    with slurm_cluster.local_cluster(cpus=1) as c:
        print(c.folder, flush=True)
        subprocess.run(["sbatch", "-o", "/dev/null", "--wrap", "sleep 3171"], env=c.env(),
                       check=True, capture_output=True)
        while "RUNNING" not in c.run(["squeue", "-h", "-o", "%T"]).stdout:
            time.sleep(0.3)
        print("READY", flush=True)
        if sys.argv[1] == "error":
            raise RuntimeError("an error inside the block")
        time.sleep(600)  # until the test interrupts it
""")


def leftovers(folder: str) -> list[psutil.Process]:
    """Processes of that cluster still alive: its daemons, step daemons and the job."""
    found = slurm_cluster._tagged(folder)
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if folder in cmd or "sleep 3171" in cmd:
            found.append(p)
    return [p for p in found if p.pid != os.getpid() and daemons.alive(p)]


def command_line(p: psutil.Process) -> str:
    """``p``'s command line, or "" when it has exited since it was listed."""
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.parametrize("how", ["error", "interrupt"])
def test_a_cluster_left_by_an_error_or_ctrl_c_leaves_nothing(slurm, how: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, how],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    folder = proc.stdout.readline().strip()
    assert folder and proc.stdout.readline().strip() == "READY", proc.stderr.read()
    # A daemon of the cluster may exit between the scan and this read: it counts as gone.
    assert any("sleep 3171" in command_line(p) for p in leftovers(folder))
    if how == "interrupt":
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert ("RuntimeError" if how == "error" else "KeyboardInterrupt") in err
    assert leftovers(folder) == [], err
    assert not Path(folder).exists()


# --------------------------------------------------------------------------- no cluster
def test_slurm_ranks_without_ntasks_per_node() -> None:
    """``srun -N2 -n8`` sets no SLURM_NTASKS_PER_NODE: the tasks on this node come from
    SLURM_STEP_TASKS_PER_NODE, so a multi-node job is not taken for one machine (which
    would put rank 0 on 127.0.0.1 and Gloo on the loopback)."""
    from lab_utils import dist

    step = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
    }
    le = dist.detect({**step, "MASTER_ADDR": "node1"})
    assert (le.launcher, le.rank, le.world_size, le.local_rank, le.local_world_size) == (
        "slurm",
        5,
        8,
        1,
        4,
    )
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        dist.set_torch_env_from_launcher(dict(step))
    uneven = dist.detect({**step, "SLURM_STEP_TASKS_PER_NODE": "5,3", "MASTER_ADDR": "node1"})
    assert (uneven.local_world_size, uneven.master_addr) == (3, "node1")
    one_node = dist.detect({**step, "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "8"})
    assert (one_node.local_world_size, one_node.master_addr) == (8, "127.0.0.1")
