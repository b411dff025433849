"""Grading a class on the one-node Slurm cluster: ``lab-grade batch DIR --slurm``.

One class (a data-parallel pass, a lone rank, a tamperer, a crasher, a syntax error:
cheap submissions of tests/submissions/) is graded on Slurm against the sandbox tests'
target, with the batch interrupted by Ctrl-C once the first verdict is in and then run
again; the verdicts must be the ones the one-machine batch gives the same files
(tests/test_sandbox.py asserts that table, ``CLASS``). A job cancelled with ``scancel``
is reported as ``slurm_killed``. The unit tests cover what the cluster cannot show
cheaply: a time limit or a node failure.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sandbox_or_skip
from test_sandbox import CLASS as ONE_MACHINE

from assessment import slurm as slurm_batch
from assessment import targets
from assessment.report import REASONS

REPO = Path(__file__).resolve().parents[1]
SUBMISSIONS = REPO / "tests" / "submissions"
# The target of the scancel test and the unit tests (a job limit from its budget).
TARGET = """\
name = "test-slurm-class"
description = "grader tests on Slurm: synthetic-cifar10, ample budget"
status = "test"
dataset = "synthetic-cifar10"
accuracy = 0.5
budget_s = 900
grace_s = 60
processes = 2
threads_per_proc = 1
launcher = "mpirun"
profile = "quick"
archs = ["resnet_cifar", "linear"]
max_checkpoint_mb = 16
data_parallel = "require"
"""
# The sandbox tests' target (Fashion-MNIST, a linear model): every job takes seconds.
CLASS_TARGET = SUBMISSIONS / "sandbox.toml"
# student -> its file; the verdict each must get is the one machine's: the sandbox
# batch's for the same file and target (tests/test_sandbox.py, where good_linear.py is
# graded as "tamper_then_innocent"), and for crash_one_rank the sandboxed grading's of
# tests/test_grader.py (a crash is a crash whatever the target).
CLASS = {
    "crash_one_rank": SUBMISSIONS / "crash_one_rank.py",
    "good_linear": SUBMISSIONS / "good_linear.py",
    "lone_rank": SUBMISSIONS / "lone_rank.py",
    "syntax_error": SUBMISSIONS / "syntax_error.py.txt",
    "tamper": SUBMISSIONS / "tamper.py",  # its edits refused
}
SAME_FILE_ON_ONE_MACHINE = {"good_linear": "tamper_then_innocent"}
EXPECTED = {
    name: ONE_MACHINE[SAME_FILE_ON_ONE_MACHINE.get(name, name)]
    for name in CLASS
    if name != "crash_one_rank"
} | {"crash_one_rank": ("broken", "crashed")}


def lab_grade(*args: str) -> list[str]:
    return [sys.executable, "-m", "assessment", "batch", *args]


def _ctrl_c_works() -> None:
    """In the child: SIGINT as in a terminal, even where the tests run with it ignored (a
    background job of a shell), which the child would inherit and so ignore Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def table(rows: list[dict]) -> dict[str, tuple[str, str]]:
    return {r["student"]: (r["status"], r["verdict"]) for r in rows}


@pytest.fixture(scope="module")
def graded(slurm, tmp_path_factory) -> dict:
    """The class graded on Slurm, interrupted once, then resumed."""
    sandbox_or_skip()
    tmp = tmp_path_factory.mktemp("slurm-class")
    folder = tmp / "class"
    folder.mkdir()
    for name, src in CLASS.items():
        shutil.copyfile(src, folder / f"{name}.py")
    target = CLASS_TARGET
    out = tmp / "on-slurm"
    cmd = lab_grade(
        str(folder), "--target", str(target), "--slurm", "--out", str(out), "--poll", "1"
    )
    start = time.monotonic()
    first = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=slurm.env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_ctrl_c_works,
    )
    lines = []
    for line in first.stdout:  # Ctrl-C once the first verdict is in
        lines.append(line)
        if line.startswith("[1/5]"):
            first.send_signal(signal.SIGINT)
            break
    lines += first.stdout.readlines()
    first.wait(timeout=60)
    jobs_after_first = json.loads((out / "slurm" / "jobs.json").read_text())
    second = subprocess.run(
        cmd, cwd=REPO, env=slurm.env(), text=True, capture_output=True, timeout=900
    )
    return {
        "first": "".join(lines),
        "first_rc": first.returncode,
        "second": second.stdout,
        "second_rc": second.returncode,
        "out": out,
        "jobs_after_first": jobs_after_first,
        "rows": json.loads((out / "results.json").read_text())["rows"],
        "slurm_s": time.monotonic() - start,
        "slurm": slurm,
    }


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 5 short gradings: under a minute on 2 idle cores, more when shared
def test_a_class_graded_on_slurm_gets_the_verdicts_of_the_one_machine_batch(graded) -> None:
    print(f"on Slurm {graded['slurm_s']:.0f} s")
    assert table(graded["rows"]) == EXPECTED, graded["second"]
    assert graded["second_rc"] == 0  # no grader error
    reports = {n: json.loads((graded["out"] / "reports" / f"{n}.json").read_text()) for n in CLASS}
    for name, rep in reports.items():  # the same sandbox inside each job that ran
        if name != "syntax_error":  # never started
            assert rep["environment"]["sandbox"] == "bubblewrap", name
        assert rep["leftover_processes"] == 0, name
    tamper = "\n".join(reports["tamper"]["output_tail"])
    assert "refused" in tamper and "TAMPERED" not in tamper
    with open(graded["out"] / "results.csv", newline="") as f:
        assert table(list(csv.DictReader(f))) == EXPECTED
    assert (
        "5 submissions graded against test-sandbox" in (graded["out"] / "summary.txt").read_text()
    )


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(1200)  # when it is the first to need the class graded
def test_an_interrupted_batch_resumes_without_grading_or_submitting_twice(graded) -> None:
    first, second = graded["first"], graded["second"]
    assert re.search(r"submitted 5 job\(s\) as array \d+", first), first
    assert re.search(r"slurm: 0/5 done, .*(pending|running)", first), first  # progress
    assert "interrupted:" in first and "they keep running" in first
    assert graded["first_rc"] == 3
    # The second run submits nothing: the first verdict is kept, the queued jobs are
    # waited for, and whatever finished in between is collected from its job.
    assert not re.search(r"^submitted \d+ job", second, re.MULTILINE), second
    done_before = re.findall(r"^\[\d/5\] (\w+):", first, re.MULTILINE)
    for name in done_before:
        assert f"{name}: already graded" in second, second
    assert second.count("already submitted as job") <= len(CLASS) - len(done_before)
    jobs = {r["student"]: r["slurm_job"] for r in graded["rows"]}
    assert jobs == {n: j["job"] for n, j in graded["jobs_after_first"].items()}
    array = {j.split("_")[0] for j in jobs.values()}
    assert len(array) == 1  # one array of 5 tasks, no second submission
    listed = (
        graded["slurm"]
        .run(["squeue", "-h", "-r", "-t", "all", "-n", slurm_batch.JOB_NAME, "-o", "%i"])
        .stdout.split()
    )
    assert len([j for j in listed if j.split("_")[0] in array]) <= len(CLASS)


@pytest.mark.launcher
def test_a_job_cancelled_with_scancel_is_reported_as_such(slurm, tmp_path: Path) -> None:
    sandbox_or_skip()
    folder = tmp_path / "class"
    folder.mkdir()
    shutil.copyfile(SUBMISSIONS / "hang.py", folder / "hang.py")
    target = tmp_path / "class.toml"
    target.write_text(TARGET)
    out = tmp_path / "grades"
    proc = subprocess.Popen(
        lab_grade(
            str(folder), "--target", str(target), "--slurm", "--out", str(out), "--poll", "1"
        ),
        cwd=REPO,
        env=slurm.env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    job = None
    for line in proc.stdout:
        if "running" in line and "slurm:" in line:  # the job runs: its grader has started
            job = json.loads((out / "slurm" / "jobs.json").read_text())["hang"]["job"]
            time.sleep(3)  # the submission is under way in its sandbox
            slurm.run(["scancel", job])
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 3, rest  # a grader error: not the student's verdict
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert (row["status"], row["verdict"], row["slurm_state"]) == (
        "error",
        "slurm_killed",
        "CANCELLED",
    ), rest
    assert f"Slurm job {job} was cancelled (scancel" in row["message"]
    assert "hang: ERROR slurm_killed" in rest
    deadline = time.monotonic() + 30  # and nothing of the job is left on the node
    while _job_processes(slurm) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(slurm) == []


def _job_processes(cluster) -> list:
    daemons = {p.pid for p in cluster.procs}
    return [
        p for p in cluster.processes() if p.pid not in daemons and p.name() not in ("slurmscriptd",)
    ]


# --------------------------------------------------------------------------- no cluster
def _target(tmp_path: Path) -> targets.Target:
    path = tmp_path / "t.toml"
    path.write_text(TARGET)
    return targets.load(path)


@pytest.mark.parametrize(
    "state, words",
    [
        ("TIMEOUT", "ran past the job's time limit"),
        ("NODE_FAIL", "its node failed"),
        ("PREEMPTED", "was preempted"),
    ],
)
def test_a_job_slurm_killed_gets_its_own_verdict(tmp_path: Path, state: str, words: str) -> None:
    item = {"path": str(tmp_path / "alice.py"), "sha256": "0" * 64}
    row = slurm_batch.killed_row(
        "alice", item, _target(tmp_path), tmp_path, "7_3", state, "mpirun", 2
    )
    assert (row["status"], row["verdict"], row["exit_code"]) == ("error", "slurm_killed", 3)
    assert REASONS["slurm_killed"] == "error"
    assert f"Slurm job 7_3 {words}" in row["message"] and f"state {state}" in row["message"]
    report = json.loads((tmp_path / "reports" / "alice.json").read_text())
    assert report["reason"] == "slurm_killed" and report["job_id"] == "7_3"


def test_final_state_from_sacct_or_else_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_accounting(args, timeout=60.0):
        if args[0] == "sacct":
            raise slurm_batch.SlurmError("Slurm accounting storage is disabled")
        return "JobId=12 ArrayJobId=12 ArrayTaskId=3 JobName=lab-grade JobState=TIMEOUT Reason=TimeLimit"

    monkeypatch.setattr(slurm_batch, "_slurm", no_accounting)
    assert slurm_batch.final_state("12_3") == "TIMEOUT"
    monkeypatch.setattr(slurm_batch, "_slurm", lambda args, timeout=60.0: "NODE_FAIL\n")
    assert slurm_batch.final_state("12_3") == "NODE_FAIL"
    monkeypatch.setattr(slurm_batch, "_slurm", lambda args, timeout=60.0: "CANCELLED by 0\n")
    assert slurm_batch.final_state("12_3") == "CANCELLED"


def test_sbatch_command_takes_partition_gres_and_time(tmp_path: Path) -> None:
    t = _target(tmp_path)
    cmd = slurm_batch.sbatch_command(
        Path("g.sbatch"),
        Path("m.json"),
        30,
        t,
        tmp_path,
        partition="gpu",
        gres="gpu:4",
        time_limit="20",
        extra=["--account=course"],
    )
    assert "--array=0-29" in cmd and "--cpus-per-task=2" in cmd and "--time=20" in cmd
    assert "--partition=gpu" in cmd and "--gres=gpu:4" in cmd and "--account=course" in cmd
    assert cmd[-2:] == ["g.sbatch", "m.json"]
    # By default the limit is twice budget + grace, plus 10 minutes: (2 x 960 + 600) s.
    assert (
        f"--time={slurm_batch.default_time(t)}"
        in slurm_batch.sbatch_command(Path("g"), Path("m"), 1, t, tmp_path)
        and slurm_batch.default_time(t) == "42"
    )
