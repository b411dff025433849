"""Run a submission in a fresh working directory and watch it from outside.

The grader copies the submission into a new temporary folder, starts it there under
the chosen launcher through :func:`lab_utils.launch.run` (whose supervisor,
:mod:`lab_utils.reaper`, owns and ends the whole process tree), measures the wall
clock itself, and afterwards makes sure that no process of the job is left: every
process is tagged through its environment, so even one that detached itself and
changed its command line is found.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lab_utils import launch, reaper

TAG_VAR = "LABS_GRADE_JOB"  # every process of a graded job carries this in its environment
WEIGHT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".npz", ".npy", ".pkl")
_IGNORED = ("__pycache__", ".git", ".ipynb_checkpoints")
# "ValueError: ...", also behind torch's "[rank1]: " prefix of uncaught exceptions.
_ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)"
                         r"|Killed|Segmentation fault)\b(:.*)?$")
_TORCH_RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]:\s*")


class SubmissionError(ValueError):
    """The submission cannot even be copied (missing, not a script, no entry point)."""


@dataclass
class Workspace:
    """A fresh folder holding a copy of the submission."""

    root: Path  # temporary folder, removed by :meth:`cleanup`
    workdir: Path  # the job's working directory (``root/work``)
    script: Path  # the entry script inside ``workdir``
    ignored: list[str] = field(default_factory=list)  # weight files not copied
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # tags the job's processes

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def prepare(submission: str | os.PathLike, entry: str = "train.py") -> Workspace:
    """Copy ``submission`` (a ``.py`` file, or a folder with ``entry``) into a new folder.

    Weight files in a submission folder are not copied: the checkpoint must be made
    by the graded run itself. Symbolic links are not followed.
    """
    src = Path(submission).expanduser()
    if not src.exists():
        raise SubmissionError(f"submission {src} does not exist")
    root = Path(tempfile.mkdtemp(prefix="lab-grade-"))
    workdir = root / "work"
    ignored: list[str] = []
    try:
        if src.is_file():
            if src.suffix != ".py":
                raise SubmissionError(f"submission {src} is not a Python script (.py)")
            workdir.mkdir()
            script = workdir / src.name
            shutil.copyfile(src, script)
        elif src.is_dir():
            def skip(folder: str, names: list[str]) -> set[str]:
                out = set()
                for n in names:
                    p = Path(folder) / n
                    if n in _IGNORED or p.is_symlink():
                        out.add(n)
                    elif n.endswith(WEIGHT_SUFFIXES):
                        out.add(n)
                        ignored.append(str(p.relative_to(src)))
                return out

            shutil.copytree(src, workdir, ignore=skip, symlinks=False)
            script = workdir / entry
            if not script.is_file():
                raise SubmissionError(f"submission folder {src} has no entry script {entry} "
                                      "(choose another with --entry)")
        else:
            raise SubmissionError(f"submission {src} is neither a file nor a folder")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return Workspace(root=root, workdir=workdir, script=script, ignored=ignored)


def sources(workdir: Path) -> list[Path]:
    """The copied ``.py`` files (a folder named ``x.py`` is not one)."""
    return sorted(p for p in workdir.rglob("*.py") if p.is_file())


def syntax_error(workdir: Path) -> str | None:
    """The first syntax error in the copied ``.py`` files, or ``None`` (nothing is run)."""
    for path in sources(workdir):
        try:
            compile(path.read_bytes(), str(path.relative_to(workdir)), "exec",
                    dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            where = f"{getattr(e, 'filename', path.name)}, line {getattr(e, 'lineno', '?')}"
            text = (getattr(e, "text", "") or "").rstrip()
            return f"{where}: {getattr(e, 'msg', e)}" + (f"\n    {text}" if text else "")
    return None


def reads_test_split(workdir: Path) -> bool:
    """Whether the source mentions the test split (allowed for evaluation only)."""
    pattern = re.compile(r"\b[xy]_test\b|[\"']test[\"']")
    return any(pattern.search(p.read_text(errors="replace")) for p in sources(workdir))


# --------------------------------------------------------------------------- running
class _Clock(io.TextIOBase):
    """Stands in for stdout while the job runs: notes when the job last printed and
    when the launcher stopped it, and passes the text on if the user wants to see it."""

    def __init__(self, forward: io.TextIOBase | None) -> None:
        self.forward = forward
        self.last_output: float | None = None
        self.stopped_at: float | None = None  # when the deadline stopped the job
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._partial += s
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if line.startswith("launch: timed out"):
                self.stopped_at = self.stopped_at or time.monotonic()
            elif self.stopped_at is None:  # what follows the stop is teardown noise
                self.last_output = time.monotonic()
        if self.forward is not None:
            self.forward.write(s)
            self.forward.flush()
        return len(s)


class _CpuWatch(threading.Thread):
    """Samples the CPU time of every process below the grader while the job runs,
    so that a stopped job can be told apart: computing (too slow) or idle (waiting
    forever: a hang or a deadlock)."""

    def __init__(self, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds used so far)
        self._done = threading.Event()
        self._seen: dict[tuple[int, float], float] = {}

    def run(self) -> None:
        used = 0.0
        while not self._done.is_set():
            for p in reaper.descendants():
                try:
                    key = (p.pid, p.create_time())
                    t = p.cpu_times()
                    now = t.user + t.system
                except psutil.Error:
                    continue
                used += max(0.0, now - self._seen.get(key, 0.0))
                self._seen[key] = now
            self.samples.append((time.monotonic(), used))
            self._done.wait(self.every_s)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def busy_cores(self, until: float, window_s: float) -> float | None:
        """Average number of busy cores over ``window_s`` seconds before ``until``."""
        before = [(t, u) for t, u in self.samples if t <= until]
        if len(before) < 2:
            return None
        t1, u1 = before[-1]
        t0, u0 = next(((t, u) for t, u in reversed(before) if t <= t1 - window_s), before[0])
        return (u1 - u0) / (t1 - t0) if t1 > t0 else None


@dataclass
class JobOutcome:
    """What the grader saw of one job."""

    returncode: int
    timed_out: bool
    elapsed: float  # wall clock from start to the last process's exit, measured here
    silent_for: float | None  # seconds without output before the job ended or was stopped
    busy_cores: float | None  # CPU cores the job kept busy in the seconds before it ended
    cpu_s: float  # CPU time (user + system) of the whole process tree
    lines: list[tuple[int | None, str]]
    leftovers: int = 0  # processes found alive after the job (and killed)

    def tail(self, n: int = 40) -> list[str]:
        """The last ``n`` lines the job printed, tagged with their rank; for a stopped
        job, the lines before the stop (what follows is the launchers' teardown)."""
        lines = self.lines
        if self.timed_out:
            cut = next((i for i, (rank, text) in enumerate(lines)
                        if rank is None and text.startswith("launch: timed out")), len(lines))
            lines = lines[:cut]
        out = [text if rank is None else f"[rank {rank}] {text}" for rank, text in lines[-n:]]
        return out + (["(stopped by the grader)"] if self.timed_out else [])

    def first_error(self) -> str | None:
        """The first exception line any rank printed, e.g. ``[rank 1] ValueError: ...``."""
        for rank, text in self.lines:
            if _ERROR_LINE.match(text) and "Warning" not in text:
                text = _TORCH_RANK_PREFIX.sub("", text).strip()
                return text if rank is None else f"[rank {rank}] {text}"
        return None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(ws: Workspace, args: Sequence[str], *, launcher: str, nprocs: int, deadline: float,
            env: Mapping[str, str], threads_per_proc: int | None,
            echo: bool = False) -> JobOutcome:
    """Run the workspace's script and wait for it, for at most ``deadline`` seconds."""
    job_env = {**env, TAG_VAR: ws.job_id}
    clock = _Clock(sys.stdout if echo else None)
    watch = _CpuWatch()
    cpu0 = _children_cpu()
    start = time.monotonic()
    watch.start()
    try:
        with contextlib.redirect_stdout(clock):
            result = launch.run(ws.script, list(args), nprocs=nprocs, launcher=launcher,
                                timeout=deadline, env=job_env, cwd=ws.workdir, echo=True,
                                threads_per_proc=threads_per_proc)
    finally:
        end = time.monotonic()
        watch.stop()
        # Even when launch.run raised: a worker in a session of its own may be left.
        leftovers = reap_leftovers(ws.job_id, ws.root)
    last = clock.stopped_at or end  # the end of the job as the job itself lived it
    silent = last - (clock.last_output or start)
    outcome = JobOutcome(returncode=result.returncode, timed_out=result.timed_out,
                         elapsed=end - start, silent_for=silent,
                         busy_cores=watch.busy_cores(last, min(10.0, max(2.0, deadline / 5))),
                         cpu_s=_children_cpu() - cpu0, lines=list(result.lines),
                         leftovers=leftovers)
    return outcome


def job_processes(tag: str, root: Path) -> list[psutil.Process]:
    """Live processes of a job: tagged in their environment, or running inside ``root``."""
    me = os.getpid()
    root_text = str(root)
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        if p.info["pid"] == me:
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            cwd = p.info["cwd"] or ""
            mine = root_text in cmd or cwd.startswith(root_text)
            if not mine:
                mine = p.environ().get(TAG_VAR) == tag
            if mine and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def reap_leftovers(tag: str, root: Path, grace_s: float = 2.0) -> int:
    """Kill whatever of the job is still alive (the supervisor should leave nothing)."""
    procs = job_processes(tag, root)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=grace_s)
    return len(procs)
