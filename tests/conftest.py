"""Shared fixtures: every test gets its own cache and runs folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
import torch

if TYPE_CHECKING:
    from lab_utils.launch import LaunchResult

# pytest-xdist runs two workers on two cores: one thread each, or they fight.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "tests" / "jobs"
SUITE_COSTS = REPO / "tests" / "suite_costs.json"  # wall-clock seconds by module, recorded
TEST_TAG = "LABS_TEST_TAG"  # in the environment of every process a test starts
# A lab's own modules (labs/lab4_*/lab4_checks.py ...) import by their plain names, as in
# the lab's notebooks; the names carry the lab's number, so labs never collide.
sys.path.extend(str(folder) for folder in sorted(REPO.glob("labs/lab[0-9]*_*")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: pytest-xdist (``--dist loadscope --no-loadscope-reorder``, as
    ``make test`` runs it) hands out whole modules, classes and notebooks in collection
    order, so the long ones start at once and the many short ones fill in at the end; the
    two workers then finish together instead of one running a long module alone. The
    seconds are a recorded run's (tests/suite_costs.json, written by benchmarks.suite_cpu);
    a module not recorded yet counts as the longest. (xdist's own reorder, on unless told
    otherwise, sorts by the number of tests: it started Lab 2's two 8-process science runs
    last.)"""
    costs = json.loads(SUITE_COSTS.read_text())
    longest = max(costs.values(), default=0.0)

    def cost(item: pytest.Item) -> float:
        return costs.get(item.nodeid.split("::", 1)[0], longest)

    items.sort(key=lambda item: -cost(item))  # stable: each module keeps its order


@pytest.fixture(autouse=True)
def _isolated_runs(tmp_path_factory, monkeypatch):
    """Runs (checkpoints, metrics) go to a temporary folder, never into the repo; every
    process the test starts inherits its tag (see :func:`processes_matching`)."""
    monkeypatch.setenv("LABS_RUNS", str(tmp_path_factory.mktemp("runs")))
    monkeypatch.setenv(TEST_TAG, uuid.uuid4().hex)


def tiny_transformer(layers: int = 2, steps: int | None = 1) -> list[str]:
    """Options of the smallest character transformer the Lab 4 and Lab 6 scripts accept."""
    args = [
        "--d-model",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--n-chars",
        "20000",
    ]
    return [*args, "--layers", str(layers), *(["--steps", str(steps)] if steps else [])]


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_RANK")
LAUNCHER_VARS += ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def script_stop(
    monkeypatch: pytest.MonkeyPatch, script: Path, argv: list, world_size: int = 1
) -> int:
    """The exit status of a Lab 4 script's ``main()`` run in this process as rank 0 of
    ``world_size`` (torchrun's environment; 1: started with ``python``), where it must stop
    before it joins any process group. In-process because a second start of torch costs
    seconds; joining a group fails the test, and there is no torchrun agent to wait for
    (one test per lab starts the real torchrun: tests/test_lab4.py)."""
    from lab_utils import parallel
    from lab_utils.source import load_script

    module = load_script(script)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    if world_size > 1:
        for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.setenv(var, str(world_size))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LABS_PROFILE", "quick")
    monkeypatch.setattr(parallel, "_wait_for_the_other_workers", lambda: None)
    monkeypatch.setattr(module.labdist, "init", lambda **kw: pytest.fail("a group was joined"))
    monkeypatch.setattr(module.gloo_exit, "arm", lambda: None)  # nothing to arm: no group
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, argv)])
    with pytest.raises(SystemExit) as stop:
        module.main()
    return stop.value.code


def launch_quick(
    script: Path, args: list, *, nprocs: int, timeout: float = 240, env: dict | None = None
) -> LaunchResult:
    """``script`` launched on ``nprocs`` processes in the quick profile (``env`` added), its
    output not echoed: a test reads the result (``.output``, ``.event(...)``)."""
    from lab_utils import launch

    return launch.run(
        script,
        [str(a) for a in args],
        nprocs=nprocs,
        timeout=timeout,
        echo=False,
        env={"LABS_PROFILE": "quick", **(env or {})},
    )


def script_help(monkeypatch: pytest.MonkeyPatch, script: Path, profile: str = "quick") -> str:
    """A script's ``--help`` in ``profile`` (its defaults are that profile's), whitespace
    collapsed so that argparse's line wrapping cannot split what a test looks for."""
    from contextlib import redirect_stdout
    from io import StringIO

    from lab_utils.source import load_script

    monkeypatch.setenv("LABS_PROFILE", profile)
    out = StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as stop:
        load_script(script).parse_args(["--help"])
    assert stop.value.code == 0
    return " ".join(out.getvalue().split())


def runs_by_rate(job: LaunchResult, event: str, label: Callable[[dict], str]) -> dict:
    """``{rate: {label(run): run}}``: the ``event`` records of a Lab 7 job that ran the
    same steps at each rate of its ``link`` event (None: the unshaped link)."""
    return {
        r: {label(run): run for run in job.events(event, rate=r)}
        for r in job.event("link")["rates"]
    }


def check_bytes_cross_the_link(job: LaunchResult, runs: dict) -> None:
    """Every step's counted bytes also crossed the link (with the packets' headers), at
    every rate of ``runs`` (:func:`runs_by_rate`); a step that sent nothing is not
    judged (a barrier's few bytes may cross it)."""
    import lab7_checks

    mtu = job.event("link")["mtu"]
    for rate, named in runs.items():
        for name, run in named.items():
            steps = zip(run["bytes_by_step"], run["link_bytes_by_step"], strict=True)
            for sent, on_link in steps:
                assert not sent or on_link >= lab7_checks.min_link_bytes(sent, 2, mtu), (
                    rate,
                    name,
                )


def processes_matching(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies) of this test whose command line mentions ``marker``.
    Of this test: the other pytest worker may run the same script at the same moment (a
    notebook, a benchmark), so a process counts only if it carries this test's tag in its
    environment, or if its environment cannot be read."""
    tag = os.environ.get(TEST_TAG)
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if marker in " ".join(p.info["cmdline"] or []) and _tagged(p, tag):
                found.append(p)
        except psutil.Error:  # gone meanwhile, or its command line unreadable
            continue
    return found


def wait_started(proc: subprocess.Popen, shown: str, timeout_s: float = 10) -> None:
    """Wait until ``proc`` runs its program (its command line shows ``shown``). Until its
    exec a new child is a copy of pytest: its command line and its environment are
    pytest's, so a check of them right after ``Popen`` would miss it by luck."""
    deadline = time.monotonic() + timeout_s
    while shown not in " ".join(psutil.Process(proc.pid).cmdline()):
        assert time.monotonic() < deadline, f"{proc.args} never started"
        time.sleep(0.02)


def _tagged(p: psutil.Process, tag: str | None) -> bool:
    if tag is None:
        return True
    try:
        return p.environ().get(TEST_TAG) == tag
    except psutil.AccessDenied:
        return True  # cannot tell: counted, so a leftover is never missed


def sandbox_or_skip() -> None:
    """Skip a grader test that needs bubblewrap and the real Fashion-MNIST, saying why."""
    from assessment import jail
    from lab_utils import data

    try:
        jail.check()
    except jail.JailError as e:
        pytest.skip(f"no sandbox here: {e}")
    try:
        data.load("fashion-mnist", download=False)
    except data.DataError as e:
        pytest.skip(f"Fashion-MNIST is not installed here: {str(e).splitlines()[0]}")


@pytest.fixture(scope="session")
def slurm():
    """One one-node Slurm cluster for the session (lab_utils.slurm_cluster); skipped,
    saying why, only where Slurm is not installed or the tests do not run as root."""
    from lab_utils import slurm_cluster

    problem = slurm_cluster.why_not()
    if problem:
        pytest.skip(problem)
    with slurm_cluster.local_cluster() as cluster:
        yield cluster


# --------------------------------------------------------------------------- graded references
# The reference solutions graded on the shipped CPU targets, each under one launcher.
# tests/test_grader.py checks their verdicts and tests/test_grader_data_parallel.py
# their exchanged bytes: both read the same gradings, made once per test session.
REFERENCE_GRADINGS = {  # (script, launcher) -> shipped target
    ("reference_ddp.py", "torchrun"): "cpu-2proc",
    ("reference_horovod.py", "mpirun"): "cpu-2proc",
    ("reference_ddp.py", "mpirun"): "cpu-cifar-standin",
    ("reference_horovod.py", "horovodrun"): "cpu-cifar-standin",
}
# On the CIFAR-10 stand-in a reference trains one epoch, not its recipe's two (a
# train.py runs its own code with `--epochs 1`): that already passes the stand-in's
# accuracy with every test image (96.8 % for DDP under mpirun, the target asks 55 %), so
# the launch under mpirun and horovodrun and the CIFAR path cost half as much.
ONE_EPOCH = {("reference_ddp.py", "mpirun"), ("reference_horovod.py", "horovodrun")}
# Whether a reference beats the real budget is a timing claim, measured by
# `lab-grade calibrate` and the benchmarks, never asserted in a test: a reference gets
# four times the real budget and grace, and must still reach the real accuracy.
ROOM_FOR_REFERENCES = 4.0


def reference_target(script: str, launcher: str):
    """The shipped target of a reference grading, with room that load cannot use up."""
    import dataclasses

    from assessment import targets

    real = targets.load(REFERENCE_GRADINGS[(script, launcher)])
    return dataclasses.replace(
        real,
        budget_s=real.budget_s * ROOM_FOR_REFERENCES,
        grace_s=real.grace_s * ROOM_FOR_REFERENCES,
    )


def one_epoch_submission(script: str, folder: Path) -> Path:
    """A folder submission: the reference ``script`` unchanged, and a train.py that runs
    it as ``__main__`` for one epoch (ONE_EPOCH)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "assessment" / "solutions" / script, folder / script)
    (folder / "train.py").write_text(
        f'"""{script} for one epoch (tests/conftest.py, ONE_EPOCH)."""\n'
        "import runpy, sys\n"
        "from pathlib import Path\n"
        'sys.argv += ["--epochs", "1"]\n'
        f'runpy.run_path(str(Path(__file__).with_name("{script}")), run_name="__main__")\n'
    )
    return folder


@pytest.fixture(scope="session")
def graded_reference(tmp_path_factory, worker_id):
    """``graded_reference(script, launcher)``: the report of that reference graded on its
    target of REFERENCE_GRADINGS, graded once per test session. Under pytest-xdist the
    workers share it through a file under the session's common temporary folder, taken
    under a lock: the first worker to ask grades, the others wait and read it."""
    import fcntl
    import json

    from assessment import grade
    from assessment.report import Report

    base = tmp_path_factory.getbasetemp()
    cache = (base if worker_id == "master" else base.parent) / "graded-references"
    cache.mkdir(exist_ok=True)

    def graded(script: str, launcher: str) -> Report:
        target = reference_target(script, launcher)
        stored = cache / f"{Path(script).stem}-{launcher}-{target.name}.json"
        with open(stored.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not stored.exists():
                path = REPO / "assessment" / "solutions" / script
                if (script, launcher) in ONE_EPOCH:
                    path = one_epoch_submission(script, cache / f"{stored.stem}-submission")
                grade.grade(path, target, launcher=launcher).write_json(stored)
        data = json.loads(stored.read_text())
        names = set(Report.__dataclass_fields__)
        return Report(**{k: v for k, v in data.items() if k in names})

    return graded
