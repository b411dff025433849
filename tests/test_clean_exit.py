"""Every distributed job ends cleanly: no SIGABRT at interpreter exit, and no hidden failure.

A Gloo worker thread that releases a finished work needs the GIL: once the interpreter
is finalizing, that ends the process with "terminate called without an active
exception" (SIGABRT); while a group's destructor joins the thread, the rank hangs.
``lab_utils.gloo_exit.arm()``, called by the job, keeps destroyed groups referenced and
makes a rank leave without finalizing the interpreter, with Python's own exit status
(how an armed process ends: tests/test_gloo_exit.py). These tests run one small job that
holds every wrapper (DDP, ZeRO, FSDP2, DTensor) twice, prove that the detector flags an
abort, and that a rank that fails still exits with its failure.
"""

from __future__ import annotations

import pytest

from lab_utils import launch
from lab_utils.source import load_script
from tests.conftest import JOBS, REPO

soak = load_script(REPO / "scripts" / "exit_soak.py")

WRAPPERS = ["ddp", "zero", "fsdp", "dtensor"]
# How often the old exit failed is rare and load-dependent: the report behind this file
# saw 1 aborted run in 30 of sharded.py; these jobs without the fix gave 1 hung DDP run
# (the group's destructor joining a Gloo thread that waited for the GIL) in 11, and no
# failure in 10 runs each of ZeRO and FSDP2. No number of runs CI can afford decides
# that: the soak that measures it is `python scripts/exit_soak.py --runs 50 all`, run by
# hand. Here one job holding every wrapper at once (tests/jobs/wrapper_exit.py `all`:
# each wrapper's model and optimizer still alive at exit, so a wrapper that hangs or
# aborts the exit fails the run) runs twice, a tripwire that also proves they end cleanly
# at all (at one failure in 30 exits per wrapper, failing independently, the 2 x 4
# wrapper exits catch a return with probability 1 - (29/30)^8 = 24 %, as 8 launches of
# one wrapper each did, for a quarter of their cost: each launch is three processes
# importing torch). What decides it deterministically is checked in
# tests/test_gloo_exit.py: an armed rank never finalizes the interpreter (where a Gloo
# thread is killed), and it keeps Python's exit status.
RUNS = 2


def exited_cleanly(result: launch.LaunchResult) -> bool:
    """Status 0 on every rank, no signal and no C++ runtime's abort message: the soak's
    own verdict (scripts/exit_soak.py), so the abort below proves that detector too."""
    return soak.verdict(result) == "clean"


def job(
    *args: str, nprocs: int = 2, launcher: str = "torchrun", env: dict[str, str] | None = None
) -> launch.LaunchResult:
    return launch.run(
        JOBS / "wrapper_exit.py",
        list(args),
        nprocs=nprocs,
        launcher=launcher,
        timeout=180,
        echo=False,
        env=env,
    )


@pytest.mark.launcher
@pytest.mark.slow
def test_every_wrapper_exits_cleanly():
    """RUNS runs of 2 ranks, every wrapper holding the default group past shutdown();
    a run that hangs ends at the launch timeout, and fails too (see RUNS)."""
    bad = []
    for i in range(RUNS):
        result = job("all")
        if not exited_cleanly(result):
            bad.append(f"run {i + 1}: status {result.returncode}\n{result.output[-800:]}")
        for wrapper in WRAPPERS:  # each wrapper did its work in the run
            assert f"{wrapper}: 2 ranks" in result.output, (wrapper, result.output[-800:])
    assert not bad, f"{len(bad)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(bad)


@pytest.mark.launcher
def test_the_detector_flags_an_abort_at_exit():
    """The job does its work, then dies as the Gloo race did: the same check must fail it."""
    result = job("ddp", "--abort")
    assert "ddp: 2 ranks" in result.output
    assert not exited_cleanly(result)
    assert "SIGABRT" in result.output  # torchrun's report of the rank's signal


def ended(returncode: int = 0, *lines: str, timed_out: bool = False) -> launch.LaunchResult:
    return launch.LaunchResult(
        ["job"], returncode, 1.0, timed_out=timed_out, lines=[(0, line) for line in lines]
    )


# How each launcher reports a rank that did not end cleanly, as the soak must classify it.
VERDICTS = {
    "clean": (ended(0, "12 steps, val_acc 80.00%"), "clean"),
    "torchrun, a rank's SIGABRT": (ended(1, "  exitcode  : -6 (pid: 4321)"), "signal"),
    "mpirun, a rank's signal": (
        ended(
            134,
            "mpirun noticed that process rank 1 with PID 7 on node x exited on signal 6 (Aborted).",
        ),
        "signal",
    ),
    "the abort message, status 0": (
        ended(0, "terminate called without an active exception"),
        "terminate called",
    ),
    "a failure": (ended(3, "exitcode  : 3 (pid: 1)"), "status 3"),
    "a hang": (ended(-9, timed_out=True), "hung"),
}


@pytest.mark.parametrize(("result", "expected"), VERDICTS.values(), ids=VERDICTS.keys())
def test_the_soak_names_each_abnormal_ending(result, expected):
    assert soak.verdict(result) == expected


@pytest.mark.launcher
def test_a_rank_that_raises_after_its_work_still_fails_with_its_traceback():
    result = job("ddp", "--raise")
    assert not result.ok
    assert "Traceback" in result.output and "failed after its work" in result.output
    assert "exitcode  : 1" in result.output  # each rank's own status, in torchrun's report


@pytest.mark.launcher
def test_sys_exit_keeps_its_status():
    result = job("ddp", "--exit", "3")
    assert not result.ok and "exitcode  : 3" in result.output
