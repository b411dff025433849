"""Grade a whole class on Slurm: ``lab-grade batch SUBMISSIONS_DIR --slurm``.

    lab-grade batch submissions/ --target gpu-4 --slurm --partition gpu --gres gpu:4

One job per submission, all in one job array: each array task grades its submission
with :func:`assessment.grade.grade`, in the same sandbox and against the same target
as ``lab-grade batch`` on one machine, and writes its report (``reports/NAME.json``)
and its row (``slurm/rows/NAME.json``) into the results folder, which must be on a
file system the compute nodes share. This process submits the array, shows progress
while the jobs are pending and running, and collects the rows into the same
``results.json``, ``results.csv`` and ``summary.txt``.

Interrupting it (Ctrl-C) leaves the jobs running; the same command again resumes:
submissions already graded are not graded again, jobs still queued or running are
waited for, not submitted again (``slurm/jobs.json`` records them). A job that Slurm
ended before it reported (time limit, node failure, ``scancel``, preemption) gets the
verdict ``slurm_killed`` with Slurm's state in its message; it is a grader error, so
the next run submits it again.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import grade as grade_mod
from . import jail, results
from . import targets as targets_mod
from .options import BatchOptions
from .report import Report

REPO = Path(__file__).resolve().parent.parent
JOB_NAME = "lab-grade"
SLURM_VARS = ("SLURM_", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte")
ACTIVE = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
)
# Why Slurm ended a job, in words (sacct's and scontrol's JobState).
ENDED = {
    "TIMEOUT": "ran past the job's time limit (--time)",
    "NODE_FAIL": "its node failed",
    "CANCELLED": "was cancelled (scancel, by you or an administrator)",
    "PREEMPTED": "was preempted by another job",
    "OUT_OF_MEMORY": "ran out of the memory Slurm gave it",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "reached its --deadline",
    "FAILED": "failed before the grader reported (read its log)",
    "COMPLETED": "ended without a report (read its log)",
}


class SlurmError(RuntimeError):
    """sbatch, squeue or scontrol failed; the message has their output."""


# --------------------------------------------------------------------------- Slurm calls
def _slurm(args: Sequence[str], timeout: float = 60.0) -> str:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{args[0]}: {e}") from e
    if done.returncode != 0:
        raise SlurmError(
            f"`{shlex.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def queue(array_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``{task id: (state, reason)}`` of the array tasks Slurm still lists as queued or running."""
    if not array_ids:
        return {}
    out = _slurm(["squeue", "-h", "-r", "-j", ",".join(sorted(set(array_ids))), "-o", "%i|%T|%r"])
    found = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[1] in ACTIVE:
            found[parts[0]] = (parts[1], parts[2])
    return found


def final_state(job: str) -> str:
    """How a job ended (COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL, ...): from sacct where
    the cluster keeps accounting, else from scontrol while it still lists the job."""
    try:
        out = _slurm(["sacct", "-n", "-P", "-X", "-j", job, "-o", "State"], timeout=30)
        states = [s.split()[0] for s in out.split() if s.strip()]
        if states:
            return states[0]
    except SlurmError:
        pass
    try:
        out = _slurm(["scontrol", "show", "job", "-o", job], timeout=30)
    except SlurmError:
        return "UNKNOWN"
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


# --------------------------------------------------------------------------- the job side
def job_script(python: str = sys.executable) -> str:
    """The array job: grade entry ``$SLURM_ARRAY_TASK_ID`` of the manifest given as $1."""
    return "\n".join(
        [
            "#!/bin/bash",
            "# Written by lab-grade batch --slurm: grades one submission of the manifest.",
            "set -euo pipefail",
            f"cd {shlex.quote(str(REPO))}",
            f'exec {shlex.quote(python)} -m assessment.slurm job "$1" "$SLURM_ARRAY_TASK_ID"',
            "",
        ]
    )


def grade_one(manifest: Path, index: int) -> dict[str, Any]:
    """Inside a job: grade one submission of ``manifest`` and write its report and row."""
    m = json.loads(manifest.read_text())
    item = m["items"][index]
    out, name, path = Path(m["out"]), item["student"], Path(item["path"])
    target = targets_mod.load(m["target_path"])
    job = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{index}"
    for var in [v for v in os.environ if v.startswith(SLURM_VARS)]:
        # Graded as on one machine: mpirun and torchrun must not see a Slurm allocation
        # (OpenMPI would launch through srun, Slurm's task counts would look like ranks).
        del os.environ[var]
    shared = Path(tempfile.mkdtemp(prefix="lab-grade-data-"))
    try:
        data_dir = None if m["unsafe"] else jail.training_copy(target.dataset, shared)
        report = grade_mod.grade(
            path,
            target,
            echo=False,
            launcher=m["launcher"],
            nprocs=m["nprocs"],
            entry=m["entry"],
            unsafe=m["unsafe"],
            data_dir=data_dir,
        )
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    report.write_json(out / "reports" / f"{name}.json")
    row = results.row_of(name, path, item["sha256"], target.name, report)
    row["slurm_job"] = job
    _write_json(rows_dir(out) / f"{name}.json", row)
    print(f"{name}: {report.status.upper()} {report.reason}", flush=True)
    return row


# --------------------------------------------------------------------------- the submit side
def rows_dir(out: Path) -> Path:
    return out / "slurm" / "rows"


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    results.atomic_write(path, json.dumps(obj, indent=2) + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def default_time(target: targets_mod.Target) -> str:
    """A job's time limit: twice the target's deadline plus 10 minutes for the sandbox,
    the data copy and the evaluation, in whole minutes (the grader stops a slow job
    itself; Slurm's limit only catches a grader that hangs)."""
    return str(math.ceil((2 * target.deadline_s + 600) / 60))


def sbatch_command(
    script: Path,
    manifest: Path,
    n: int,
    target: targets_mod.Target,
    out: Path,
    *,
    partition: str | None = None,
    gres: str | None = None,
    time_limit: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``sbatch`` call that submits ``n`` array tasks for ``manifest``."""
    cpus = target.processes * (target.threads_per_proc or 1)
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={JOB_NAME}",
        f"--array=0-{n - 1}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={cpus}",
        f"--time={time_limit or default_time(target)}",
        f"--output={out / 'slurm' / 'logs' / '%A_%a.out'}",
    ]
    if partition:
        cmd.append(f"--partition={partition}")
    if gres:
        cmd.append(f"--gres={gres}")
    return [*cmd, *extra, str(script), str(manifest)]


def killed_row(
    name: str,
    item: dict[str, Any],
    target: targets_mod.Target,
    out: Path,
    job: str,
    state: str,
    launcher: str,
    nprocs: int,
) -> dict[str, Any]:
    """The row (and report) of a job Slurm ended before it reported."""
    why = ENDED.get(state, f"ended in state {state}")
    log = out / "slurm" / "logs" / f"{job}.out"
    report = Report(
        submission=item["path"],
        target=target.name,
        dataset=target.dataset,
        launcher=launcher,
        nprocs=nprocs,
        budget_s=target.budget_s,
        grace_s=target.grace_s,
        required_accuracy=target.accuracy,
        job_id=job,
    )
    report.set(
        "slurm_killed",
        f"Slurm job {job} {why} (state {state}) before the grader "
        f"reported; its log: {log}. Not the submission's fault: "
        "run the batch again to grade it again.",
    )
    report.write_json(out / "reports" / f"{name}.json")
    row = results.row_of(name, Path(item["path"]), item["sha256"], target.name, report)
    row.update(slurm_job=job, slurm_state=state)
    return row


def run_slurm_batch(
    folder: Path, target: targets_mod.Target, out: Path, opts: BatchOptions | None = None
) -> list[dict[str, Any]]:
    """Grade every submission in ``folder`` on Slurm (see the module docstring); the rows."""
    opts = opts or BatchOptions()
    say: Callable[..., None] = print if opts.echo else (lambda *a, **k: None)
    for sub in ("reports", "slurm/logs", "slurm/rows"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if not target.path:
        raise SlurmError("a target read from a file is needed (the jobs load it again)")
    launcher = opts.launcher or target.launcher
    nprocs = opts.nprocs or target.processes
    done = {} if opts.regrade else _previous_rows(out)
    jobs_file = out / "slurm" / "jobs.json"
    jobs: dict[str, dict[str, Any]] = {} if opts.regrade else (_read_json(jobs_file) or {})
    todo = results.students(folder, opts.entry)
    rows: dict[str, dict[str, Any]] = {}
    watch: dict[str, dict[str, Any]] = {}  # student -> its job entry
    queued = queue([j["job"].split("_")[0] for j in jobs.values()]) if jobs else {}
    submit = _sort_out(todo, done, jobs, queued, target.name, rows, watch, say)
    if submit:
        _submit(submit, jobs, jobs_file, target, out, opts, launcher, nprocs, say)
        watch.update({i["student"]: jobs[i["student"]] for i in submit})
    try:
        _wait(watch, rows, target, out, launcher, nprocs, opts.poll_s, say)
    except KeyboardInterrupt:
        _interrupted(watch, rows, done, todo, target.name, out, say)
        raise
    results.save(out, rows, target.name)
    ordered = [rows[n] for n, _ in todo if n in rows]
    say(results.summary(ordered, target.name), end="")
    return ordered


def _sort_out(
    todo: list[tuple[str, Path]],
    done: dict[str, dict[str, Any]],
    jobs: dict[str, dict[str, Any]],
    queued: dict[str, Any],
    target: str,
    rows: dict[str, dict[str, Any]],
    watch: dict[str, dict[str, Any]],
    say: Callable[..., None],
) -> list[dict[str, Any]]:
    """Sort each student: already graded (into ``rows``), a job of theirs to wait for
    (into ``watch``), or to submit (returned)."""
    submit = []
    for name, path in todo:
        digest = results.fingerprint(path)
        item = {"student": name, "path": str(path.resolve()), "sha256": digest}
        old, job = done.get(name), jobs.get(name)
        same = job is not None and job["sha256"] == digest and job["target"] == target
        if (
            old
            and old.get("sha256") == digest
            and old.get("target") == target
            and old.get("status") != "error"
        ):
            rows[name] = old
            say(f"{name}: already graded ({old['status']}: {old['verdict']})", flush=True)
        elif same and job["job"] in queued:
            watch[name] = job
            say(
                f"{name}: already submitted as job {job['job']} "
                f"({queued[job['job']][0].lower()}), not submitted again",
                flush=True,
            )
        elif same and not (old and old.get("slurm_job") == job["job"]):
            watch[name] = job  # ended while no batch was watching: collected below
        else:
            submit.append(item)
    return submit


def _interrupted(
    watch: dict[str, dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    done: dict[str, dict[str, Any]],
    todo: list[tuple[str, Path]],
    target: str,
    out: Path,
    say: Callable[..., None],
) -> None:
    """Ctrl-C while waiting: say which jobs keep running and save what is graded."""
    left = sorted(j["job"] for n, j in watch.items() if n not in rows)
    say(
        f"\ninterrupted: {len(left)} job(s) still in Slurm ({', '.join(left)}); they keep "
        "running. Run the same command again to collect them; they are not submitted "
        "again.",
        flush=True,
    )
    results.save(out, {**_kept(done, todo), **rows}, target)


def _previous_rows(out: Path) -> dict[str, dict[str, Any]]:
    state = _read_json(out / "results.json")
    try:
        return {r["student"]: r for r in state["rows"]}
    except (TypeError, KeyError):
        return {}


def _kept(
    done: dict[str, dict[str, Any]], todo: list[tuple[str, Path]]
) -> dict[str, dict[str, Any]]:
    names = {n for n, _ in todo}
    return {n: r for n, r in done.items() if n in names and r.get("status") != "error"}


def _submit(
    items: list[dict[str, Any]],
    jobs: dict[str, dict[str, Any]],
    jobs_file: Path,
    target: targets_mod.Target,
    out: Path,
    opts: BatchOptions,
    launcher: str,
    nprocs: int,
    say: Callable[..., None],
) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 10**6:06d}"
    manifest = out / "slurm" / f"manifest-{stamp}.json"
    _write_json(
        manifest,
        {
            "out": str(out.resolve()),
            "target_path": str(Path(target.path).resolve()),
            "launcher": launcher,
            "nprocs": nprocs,
            "entry": opts.entry,
            "unsafe": opts.unsafe,
            "items": items,
        },
    )
    for item in items:  # rows of earlier jobs of these students
        (rows_dir(out) / f"{item['student']}.json").unlink(missing_ok=True)
    script = out / "slurm" / "grade.sbatch"
    script.write_text(job_script())
    sbatch = sbatch_command(
        script,
        manifest.resolve(),
        len(items),
        target,
        out.resolve(),
        partition=opts.partition,
        gres=opts.gres,
        time_limit=opts.time_limit,
        extra=opts.sbatch_args,
    )
    array = _slurm(sbatch).strip().split(";")[0]
    for i, item in enumerate(items):
        jobs[item["student"]] = {
            "job": f"{array}_{i}",
            "sha256": item["sha256"],
            "target": target.name,
            "path": item["path"],
            "manifest": str(manifest),
        }
    _write_json(jobs_file, jobs)  # at once: an interrupted batch must not submit them twice
    say(
        f"submitted {len(items)} job(s) as array {array} ({out / 'slurm' / 'logs'}/{array}_N.out)",
        flush=True,
    )


def _from(row: dict[str, Any] | None, job: dict[str, Any]) -> bool:
    """Whether ``row`` was written by ``job`` (not by an earlier job of the student)."""
    return bool(row) and row.get("slurm_job") == job["job"] and row.get("sha256") == job["sha256"]


def _wait(
    watch: dict[str, dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    target: targets_mod.Target,
    out: Path,
    launcher: str,
    nprocs: int,
    poll_s: float,
    say: Callable[..., None],
) -> None:
    """Poll Slurm until every watched job has a row; say what changed."""
    start, shown = time.monotonic(), ""
    total = len(watch) + len(rows)
    while True:
        open_jobs = {n: j for n, j in watch.items() if n not in rows}
        queued = queue([j["job"].split("_")[0] for j in open_jobs.values()]) if open_jobs else {}
        for name, job in open_jobs.items():
            row = _read_json(rows_dir(out) / f"{name}.json")
            if _from(row, job):
                rows[name] = row
            elif job["job"] not in queued:
                state = final_state(job["job"])
                row = _read_json(rows_dir(out) / f"{name}.json")  # it may have just landed
                if _from(row, job):
                    rows[name] = row
                else:
                    rows[name] = killed_row(
                        name, job, target, out, job["job"], state, launcher, nprocs
                    )
            else:
                continue
            r = rows[name]
            acc = "" if r["accuracy"] is None else f" {r['accuracy']:.2%}"
            secs = "" if r["seconds"] is None else f" in {r['seconds']:.1f} s"
            say(
                f"[{len(rows)}/{total}] {name}: {r['status'].upper()} {r['verdict']}{acc}{secs} "
                f"(job {job['job']})",
                flush=True,
            )
            results.save(out, rows, target.name)
        states = Counter(
            s.lower()
            for n, j in watch.items()
            if n not in rows
            for s, _ in [queued.get(j["job"], ("ending", ""))]
        )
        line = ", ".join(f"{v} {k}" for k, v in sorted(states.items()))
        if not states:
            return
        if line != shown:
            say(
                f"slurm: {len(rows)}/{total} done, {line} ({time.monotonic() - start:.0f} s)",
                flush=True,
            )
            shown = line
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m assessment.slurm job MANIFEST INDEX``: what each array task runs."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "job":
        print(
            "usage: python -m assessment.slurm job MANIFEST INDEX (run by lab-grade batch --slurm)",
            file=sys.stderr,
        )
        return 3
    grade_one(Path(args[1]), int(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
