"""A path of the check, its result, and running paths under one deadline.

A path runs in its own process tree under :func:`lab_utils.launch.run` (the course's
launcher: a timeout, every process reaped, rank 0's metrics read back), so a crash, a
hang or a CUDA error in one path cannot stop the others. The deadline is the check's
whole budget: a path starts only when at least its ``min_seconds`` are left, runs for at
most what is left, and a path the deadline cut short is "skipped: no time left", not
failed (its own timeout, shorter, is what marks a hang).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils import launch

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NO_TIME = "no time left"
TAIL_LINES = 12


@dataclass
class Check:
    """One path: what runs, under which launcher, how long it may take, how it is read.

    ``known_limits`` are ``(regex, reason)`` pairs: a failure whose output matches is a
    limit of the machine or of PyTorch (Gloo without a collective on CUDA tensors, no
    Horovod), reported as skipped with the reason and the matching line; anything else
    that fails is a failure. ``expect_failure`` inverts the verdict: the path passes when
    the job fails with output matching it (the course's clear refusal of a setting).
    """

    name: str
    group: str
    what: str
    script: str = ""
    args: Sequence[str] = ()
    nprocs: int = 1
    launcher: str = "python"
    module: bool = False
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 120.0
    min_seconds: float = 15.0
    backend: str = ""
    skip: str = ""
    exclusive: bool = False  # measures time: runs alone, before the others
    expect_failure: str = ""
    known_limits: tuple[tuple[str, str], ...] = ()
    threads: int | None = None  # OMP_NUM_THREADS per process (None: launcher's default)
    numbers: Callable[[launch.LaunchResult], dict[str, Any]] | None = None
    failure_reason: Callable[[launch.LaunchResult], str] | None = None  # better than the last line
    # A path that reports several rows (Lab 6's probe: one per part)
    rows: Callable[[Result, launch.LaunchResult], list[Result]] | None = None


@dataclass
class Result:
    """What one path did: ``status`` is passed, failed or skipped."""

    name: str
    group: str
    what: str
    status: str
    seconds: float = 0.0
    reason: str = ""  # why skipped, or what failed in one line
    error: str = ""  # the error's last lines
    numbers: dict[str, Any] = field(default_factory=dict)
    backend: str = ""
    command: str = ""


class Deadline:
    """Seconds left of the check's budget (a clock can be given, for tests)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.start = clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)


def skipped(check: Check, reason: str) -> Result:
    return Result(
        check.name, check.group, check.what, SKIPPED, reason=reason, backend=check.backend
    )


def error_tail(output: str, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines up to the last exception message a process printed (the
    cause, not the launcher's summary after it; the stack after a fatal signal's report),
    else the output's last ``n`` lines."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if launch.is_cause(lines[i]):
            if "Fatal Python error" in lines[i]:
                return "\n".join(line[:300] for line in lines[i : i + n])
            return "\n".join(line[:300] for line in lines[max(0, i + 1 - n) : i + 1])
    return "\n".join(line[:300] for line in lines[-n:])


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def default_numbers(result: launch.LaunchResult) -> dict[str, Any]:
    """The scalar fields of the last record rank 0 emitted (at most 8)."""
    if not result.metrics:
        return {}
    last = result.metrics[-1]
    picked = {
        k: v
        for k, v in last.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "event"
    }
    return dict(list(picked.items())[:8])


def judge(check: Check, result: launch.LaunchResult, cut_by_deadline: bool) -> tuple[str, str]:
    """``(status, reason)`` of a finished job."""
    output = result.output
    if check.expect_failure:
        if result.ok:
            return FAILED, f"expected the job to stop with {check.expect_failure!r}; it ran"
        if re.search(check.expect_failure, output):
            return PASSED, f"stopped as the course says: {check.expect_failure!r}"
        return FAILED, f"stopped, but without {check.expect_failure!r}"
    if result.timed_out:
        if cut_by_deadline:
            return (
                SKIPPED,
                f"{NO_TIME}: stopped at the check's deadline after {result.elapsed:.0f} s",
            )
        return FAILED, f"timed out after {result.elapsed:.0f} s"
    if not result.ok:
        for pattern, why in check.known_limits:
            # the last line that says it: the exception's message, not the source above it
            hits = [line.strip() for line in output.splitlines() if re.search(pattern, line)]
            if hits:
                return SKIPPED, f"{why}: {hits[-1][:200]}"
        return FAILED, f"exit code {result.returncode}"
    return PASSED, ""


def run_check(
    check: Check, out: Path, deadline: Deadline, scratch: Path | None = None
) -> list[Result]:
    """Run one path in its own process tree; never raises for the path's faults. Its whole
    output goes to ``out/logs/NAME.log``; it runs in ``scratch/work/NAME`` (default: out)."""
    if check.skip:
        return [skipped(check, check.skip)]
    left = deadline.left()
    if left < check.min_seconds:
        return [
            skipped(
                check,
                f"{NO_TIME} ({left:.0f} s of the budget left, needs {check.min_seconds:.0f} s)",
            )
        ]
    timeout = min(check.timeout, left)
    cwd = (scratch or out) / "work" / check.name  # what a script writes stays apart
    cwd.mkdir(parents=True, exist_ok=True)
    log = out / "logs" / f"{check.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = launch.command(
        check.launcher, check.nprocs, check.script, check.args, module=check.module
    )
    shown = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
    base = Result(check.name, check.group, check.what, FAILED, backend=check.backend, command=shown)
    start = time.monotonic()
    try:
        job = launch.run(
            check.script,
            list(check.args),
            nprocs=check.nprocs,
            launcher=check.launcher,
            timeout=timeout,
            env=check.env,
            cwd=cwd,
            echo=False,
            threads_per_proc=check.threads,
            module=check.module,
        )
    except Exception as e:  # the launcher itself could not start (e.g. not installed)
        base.seconds, base.reason = time.monotonic() - start, f"{type(e).__name__}: {e}"
        base.error = base.reason
        log.write_text(f"$ {shown}\n{base.reason}\n")
        return [base]
    base.seconds = job.elapsed
    log.write_text(f"$ {shown}\n{job.output}\n")
    base.status, base.reason = judge(check, job, cut_by_deadline=timeout < check.timeout)
    if base.status == FAILED:
        base.error = error_tail(job.output)
        why = check.failure_reason(job) if check.failure_reason else ""
        if why or (base.reason.startswith("exit code") and last_line(base.error)):
            base.reason = (why or last_line(base.error))[:300]
    if base.status == PASSED:
        try:
            base.numbers = (check.numbers or default_numbers)(job)
        except Exception as e:  # ran, but did not report what it should
            base.status, base.reason = (
                FAILED,
                f"its numbers could not be read: {type(e).__name__}: {e}",
            )
    if check.rows is not None and base.status != SKIPPED:
        return check.rows(base, job)
    return [base]


def run_all(
    checks: Sequence[Check],
    out: Path,
    deadline: Deadline,
    jobs: int = 1,
    run: Callable[[Check, Path, Deadline], list[Result]] = run_check,
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Every path, results in the catalogue's order: the ``exclusive`` ones first, one at
    a time (their times are figures), then the others ``jobs`` at a time, started in
    the catalogue's order (the slowest are listed last, so the deadline skips them)."""
    done: dict[int, list[Result]] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        results = run(checks[i], out, deadline)
        with lock:
            done[i] = results
            for r in results:
                if progress is not None:
                    progress(r)

    for i, c in enumerate(checks):
        if c.exclusive:
            one(i)
    rest = [i for i, c in enumerate(checks) if not c.exclusive]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, rest))  # map: an exception in one() is raised here, not lost
    return [r for i in range(len(checks)) for r in done[i]]
