"""Run a submission in a fresh working directory and watch it from outside.

The grader copies the submission into a new temporary folder (:func:`prepare`) and
starts it there with :func:`run_job`, the one function that runs a submission, read
top to bottom: the job's environment (:func:`environment`), the launcher's command
inside the sandbox of :mod:`assessment.jail` (unless the instructor asked for unsafe
grading), the memory and process limits, the run under the supervisor
:mod:`lab_utils.reaper` (which owns and ends the whole process tree), and the
clean-up. It measures the wall clock and each rank's CPU time itself, keeps only the
last lines of the job's output (a job that floods its output cannot fill the
grader's memory), and afterwards makes sure that no process of the job is left:
every process is tagged through its environment, so even one that detached itself
and changed its command line is found.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from lab_utils import launch, reaper
from lab_utils import metrics as lmetrics

from . import jail
from . import participation as part

if TYPE_CHECKING:
    from .targets import Target

TAG_VAR = "LABS_GRADE_JOB"  # every process of a graded job carries this in its environment
KEEP_LINES = 2000  # lines of the job's output the grader keeps (the last ones)
MAX_LINE = 2000  # characters kept of one line
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK")
METRICS_NAME = ".lab-grade-metrics.jsonl"  # in the working directory: the job may write it
WEIGHT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".npz", ".npy", ".pkl")
_IGNORED = ("__pycache__", ".git", ".ipynb_checkpoints")
# "ValueError: ...", also behind torch's "[rank1]: " prefix of uncaught exceptions.
_ERROR_LINE = re.compile(
    r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)"
    r"|Killed|Segmentation fault)\b(:.*)?$"
)
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

    @property
    def data_copy(self) -> Path:
        """Where a training-only copy of the data is made for this job alone."""
        return self.root / "data"

    def cleanup(self, keep: bool = False) -> None:
        """Remove the folder; with ``keep``, only the data copy, so that the working
        directory stays for debugging."""
        shutil.rmtree(self.data_copy if keep else self.root, ignore_errors=True)


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
                raise SubmissionError(
                    f"submission folder {src} has no entry script {entry} "
                    "(choose another with --entry)"
                )
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
            compile(path.read_bytes(), str(path.relative_to(workdir)), "exec", dont_inherit=True)
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
class _CpuWatch(threading.Thread):
    """Samples the CPU time of every process below the grader while the job runs,
    so that a stopped job can be told apart (computing, too slow; or idle, waiting
    forever: a hang or a deadlock), and so that each rank's share is known."""

    def __init__(self, every_s: float = 0.5, observers: Sequence[Any] = ()) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        # Each gets ``sample([(process, rank or None), ...])`` on every round (the
        # evidence of :mod:`assessment.participation`).
        self.observers = list(observers)
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds used so far)
        self.by_rank: dict[int, float] = {}  # CPU seconds of the processes of each rank
        self._done = threading.Event()
        self._seen: dict[tuple[int, float], float] = {}
        self._rank: dict[tuple[int, float], int | None] = {}

    def _rank_of(self, key: tuple[int, float], p: psutil.Process) -> int | None:
        """The rank a process runs as, from its environment. Only a rank found is kept:
        a launcher's child seen between fork and exec still has the launcher's
        environment (no rank) under the same pid and start time, and must not stay
        rankless once it runs as a rank (its CPU and sockets would count for none)."""
        if key not in self._rank:
            with contextlib.suppress(psutil.Error, OSError, ValueError):
                env = p.environ()
                for var in RANK_VARS:
                    if var in env:
                        self._rank[key] = int(env[var])
                        break
        return self._rank.get(key)

    def run(self) -> None:
        used = 0.0
        while not self._done.is_set():
            seen: list[tuple[psutil.Process, int | None]] = []
            for p in reaper.descendants():
                try:
                    key = (p.pid, p.create_time())
                    t = p.cpu_times()
                    now = t.user + t.system
                except psutil.Error:
                    continue
                step = max(0.0, now - self._seen.get(key, 0.0))
                used += step
                self._seen[key] = now
                rank = self._rank_of(key, p)
                seen.append((p, rank))
                if rank is not None:
                    self.by_rank[rank] = self.by_rank.get(rank, 0.0) + step
            for observer in self.observers:
                try:
                    observer.sample(seen)
                except (psutil.Error, OSError):  # a process that just ended
                    pass
                except Exception as e:  # a fault of the evidence: never judged on, and
                    # the CPU sampling goes on
                    observer.unavailable = observer.unavailable or f"{type(e).__name__}: {e}"
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
    lines: list[tuple[int | None, str]]  # the last KEEP_LINES lines
    leftovers: int = 0  # processes found alive after the job (and killed)
    error: str | None = None  # the first exception line any rank printed
    line_count: int = 0  # lines printed in all
    rank_cpu_s: dict[int, float] = field(default_factory=dict)  # sampled CPU time per rank
    metrics: list[dict] = field(default_factory=list)  # records the job emitted
    memory_killed: bool = False  # the kernel killed a process for going over the memory limit
    peak_memory_mb: float | None = None
    limits: str = "none"  # how the memory and process limits were set (or why not)
    sockets: part.SocketWatch = field(default_factory=part.SocketWatch)  # ranks' TCP bytes
    gpu: part.GpuWatch | None = None  # ranks' GPU use (GPU jobs)

    def tail(self, n: int = 40) -> list[str]:
        """The last ``n`` lines the job printed, tagged with their rank; for a stopped
        job, the lines before the stop (what follows is the launchers' teardown)."""
        lines = self.lines
        if self.timed_out:
            cut = next(
                (
                    i
                    for i, (rank, text) in enumerate(lines)
                    if rank is None and text.startswith("launch: timed out")
                ),
                len(lines),
            )
            lines = lines[:cut]
        out = [text if rank is None else f"[rank {rank}] {text}" for rank, text in lines[-n:]]
        return out + (["(stopped by the grader)"] if self.timed_out else [])

    def first_error(self) -> str | None:
        """The first exception line any rank printed, e.g. ``[rank 1] ValueError: ...``."""
        if self.error is not None:
            return self.error
        for rank, text in self.lines:
            found = _error_text(rank, text)
            if found:
                return found
        return None


def _error_text(rank: int | None, text: str) -> str | None:
    if _ERROR_LINE.match(text) and "Warning" not in text:
        text = _TORCH_RANK_PREFIX.sub("", text).strip()
        return text if rank is None else f"[rank {rank}] {text}"
    return None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Confinement:
    """How a job is confined beyond its target's limits: the sandbox or none (unsafe)."""

    data_dir: Path | None  # the training-only copy of the dataset, as $LABS_DATA
    repo: Path = field(default_factory=lambda: Path(launch.__file__).resolve().parent.parent)
    sandboxed: bool = True
    max_procs: int = jail.DEFAULT_MAX_PROCS
    hide: list[Path] = field(default_factory=list)  # full dataset copies in visible folders


def environment(ws: Workspace, target: Target, launcher: str, conf: Confinement) -> dict[str, str]:
    """The whole environment of a graded job, built here alone: the launcher's
    (``launch.job_env``: rendezvous, threads, ``PYTHONPATH``) with the grader's
    settings, a tag on every process, the metrics file and the sandbox's view."""
    grader = {
        TAG_VAR: ws.job_id,  # finds every process of the job, even a detached one
        "LABS_PROFILE": target.profile,
        # Collectives must not give up before the grader's own deadline: a deadlock
        # is reported as one, not as a crash.
        "LABS_DIST_TIMEOUT": str(int(target.deadline_s + 60)),
        "LABS_RUNS": str(ws.workdir / "runs"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if launcher == "mpirun" and target.profile != "gpu":
        # With as many ranks as cores, a rank that busy-polls in MPI (Horovod's
        # background thread) takes the core from its own compute thread.
        grader["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # Ranks on one machine would exchange through shared memory, which no counter
        # of the kernel attributes to a rank; over TCP (on lo) every byte is counted.
        grader["OMPI_MCA_btl"] = "self,tcp"
    env = launch.job_env(launcher, grader, target.threads_per_proc, target.deadline_s)
    env[lmetrics.ENV_VAR] = str(ws.workdir / METRICS_NAME)
    if conf.sandboxed:
        env.update(jail.sandbox_env(ws.workdir, conf.data_dir))
    return env


class _Lines:
    """What the grader notes of each line as it comes: the first error, when the job
    last printed, when the grader stopped it; and the line itself when echoing."""

    def __init__(self, echo: bool) -> None:
        self.error: str | None = None
        self.last: float | None = None  # time of the job's last line before any stop
        self.stopped: float | None = None  # time the grader stopped the job
        self._out = sys.stdout if echo else None

    def __call__(self, rank: int | None, text: str) -> None:
        if rank is None and text.startswith("launch: timed out"):
            self.stopped = self.stopped or time.monotonic()
        elif self.stopped is None:
            self.last = time.monotonic()
        if self.error is None:
            self.error = _error_text(rank, text)
        if self._out is not None:
            self._out.write((text if rank is None else f"[rank {rank}] {text}") + "\n")
            self._out.flush()


@dataclass
class _Watchers:
    """The samplers that run beside the job: CPU per rank, TCP bytes, GPU use."""

    cpu: _CpuWatch
    sockets: part.SocketWatch
    gpu: part.GpuWatch | None

    @classmethod
    def start(cls, gpu: bool) -> _Watchers:
        sockets = part.SocketWatch()
        gpu_watch = part.GpuWatch() if gpu else None
        cpu = _CpuWatch(observers=[sockets] + ([gpu_watch] if gpu_watch else []))
        cpu.start()
        return cls(cpu, sockets, gpu_watch)

    def stop(self) -> None:
        self.cpu.stop()
        if self.gpu is not None:
            self.gpu.close()


def run_job(
    ws: Workspace,
    target: Target,
    *,
    launcher: str,
    nprocs: int,
    confinement: Confinement,
    echo: bool = False,
) -> JobOutcome:
    """Run the workspace's script as ``target`` says and watch it from outside; the one
    place a submission is started. Read top to bottom: environment, command, limits,
    the run under the deadline, clean-up."""
    gpu = target.profile == "gpu"
    # The environment and the command: the launcher's, inside bubblewrap unless unsafe.
    env = environment(ws, target, launcher, confinement)
    args = ["--dataset", target.dataset, "--budget", f"{target.budget_s:g}"]
    cmd = launch.command(launcher, nprocs, ws.script, args, (), env)
    if confinement.sandboxed:
        cmd = jail.command(
            cmd,
            workdir=ws.workdir,
            data_dir=confinement.data_dir,
            repo=confinement.repo,
            gpu=gpu,
            hide=confinement.hide,
        )
    # The limits: a cgroup with the target's memory and a process count (its ``how``
    # says why there is none where the machine gives no writable cgroup).
    limits = jail.make_limits(target.memory_mb, confinement.max_procs)
    # The run, under the supervisor and the deadline, watched from outside.
    seen = _Lines(echo)
    cpu0 = _children_cpu()
    start = time.monotonic()
    watchers = _Watchers.start(gpu)
    try:
        result = launch.stream(
            cmd,
            env=env,
            cwd=ws.workdir,
            timeout=target.deadline_s,
            on_line=seen,
            keep_lines=KEEP_LINES,
            max_line=MAX_LINE,
            prefix=limits.join_command(),
        )
    finally:
        end = time.monotonic()
        watchers.stop()
        # Clean-up, even after an error: kill what is left of the job (a worker in a
        # session of its own may be), read the cgroup's record, remove it.
        leftovers = reap_leftovers(ws.job_id, ws.root)
        peak, memory_killed = limits.peak_bytes(), limits.memory_killed()
        limits.remove()
    last = seen.stopped or end  # the end of the job as the job itself lived it
    return JobOutcome(
        returncode=result.returncode,
        timed_out=result.timed_out,
        elapsed=end - start,
        silent_for=last - (seen.last or start),
        busy_cores=watchers.cpu.busy_cores(last, min(10.0, max(2.0, target.deadline_s / 5))),
        cpu_s=_children_cpu() - cpu0,
        lines=result.lines,
        leftovers=leftovers,
        error=seen.error,
        line_count=result.line_count,
        rank_cpu_s=dict(sorted(watchers.cpu.by_rank.items())),
        metrics=_read_metrics(ws.workdir / METRICS_NAME),
        memory_killed=memory_killed,
        peak_memory_mb=None if peak is None else round(peak / 2**20, 1),
        limits=limits.how,
        sockets=watchers.sockets,
        gpu=watchers.gpu,
    )


def _read_metrics(path: Path, max_bytes: int = 4 * 2**20) -> list[dict]:
    """The job's metric records, if the file is a plain, reasonably small file."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            return []
        return lmetrics.read(path)
    except (OSError, ValueError):
        return []


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
