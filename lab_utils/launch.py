"""Run a script under ``torchrun``, ``horovodrun`` or ``mpirun`` from Python.

From a notebook cell or a test::

    result = launch.run("train_ddp.py", ["--epochs", "2"], nprocs=2, launcher="torchrun")
    result.check()            # raises with the output's tail if the job failed
    result.event("summary")   # the one record rank 0 emitted as event "summary"
    result.events("eval")     # every "eval" record, in order (result.metrics: all records)

Before it starts, :func:`run` prints the command it starts as one line a student can
paste into a terminal (``$ OMP_NUM_THREADS=1 torchrun --standalone ... train_ddp.py
--epochs 2``). Each script's docstring lists the events it emits.

Output is streamed live, one line at a time, tagged ``[rank N]``. The job runs
under :mod:`lab_utils.reaper`, so a timeout, an interrupted cell (Ctrl-C / the
stop button) or a crashed rank ends the whole process tree: nothing is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import metrics as lmetrics
from .net import free_port

LAUNCHERS = ("torchrun", "horovodrun", "mpirun", "python")

# Rank tags as each launcher writes them: mpirun --tag-output "[1,0]<stdout>:",
# horovodrun "[0]<stdout>:" (both may tag every write, not every line), and
# torchrun --tee "[default0]:" at the start of each line.
_SEGMENT_TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
_LINE_TAG = re.compile(r"^\[[A-Za-z_]+(\d+)\]:")
# The line that names what went wrong: an exception's message as a traceback ends it, an
# argparse-style "error: " line, or a fatal signal's report (Python's faulthandler, which
# lists the stack *after* it). Rank tags ("[rank 0] ", torch's "[rank0]: ") may precede it.
_CAUSE = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)*(?:[\w.]*(?:Error|Exception|Exit|Interrupt)\b|(?:\S+: )?error: "
    r"|Fatal Python error: )"
)
# torchrun's own summary only says that a child failed: never the cause.
_NOT_THE_CAUSE = ("ChildFailedError", "elastic.multiprocessing")


def is_cause(line: str) -> bool:
    """Whether ``line`` names what went wrong (not a launcher's summary of it)."""
    return bool(_CAUSE.match(line)) and not any(s in line for s in _NOT_THE_CAUSE)


def first_cause(lines: Sequence[str], context: int = 12) -> list[str]:
    """The lines around the first cause in ``lines``: the traceback above an exception's
    message, or the stack below a fatal signal's report; [] when none is there."""
    for i, line in enumerate(lines):
        if is_cause(line):
            if "Fatal Python error" in line:
                return list(lines[i : i + 2 * context])
            return list(lines[max(0, i - context) : i + 1])
    return []


class LaunchError(RuntimeError):
    """A launched job failed, timed out or was interrupted."""


class EventError(LookupError):
    """A job did not emit exactly one record of the event asked for."""


@dataclass
class LaunchResult:
    """What a launched job did, as seen from outside."""

    command: list[str]
    returncode: int
    elapsed: float
    timed_out: bool = False
    interrupted: bool = False
    lines: list[tuple[int | None, str]] = field(default_factory=list)
    line_count: int = 0  # lines printed in all (``lines`` may keep only the last ones)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def output(self) -> str:
        """All output as text, each line tagged with its rank."""
        return "\n".join(_format(r, t) for r, t in self.lines)

    def rank_output(self, rank: int) -> str:
        """The lines one rank printed."""
        return "\n".join(t for r, t in self.lines if r == rank)

    def events(self, name: str, **fields: Any) -> list[dict[str, Any]]:
        """Every record rank 0 emitted as event ``name``, in the order it emitted them;
        ``fields`` keeps those whose fields have these values (``attempt=1``)."""
        return lmetrics.events(self.metrics, name, **fields)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """The one record rank 0 emitted as event ``name`` (with these ``fields``).

        Raises :class:`EventError`, naming the events the job did emit, when there is none
        or more than one (then pick one with a field, or take them all with
        :meth:`events`)."""
        found = self.events(name, **fields)
        if len(found) == 1:
            return found[0]
        asked = ", ".join([repr(name), *(f"{k}={v!r}" for k, v in fields.items())])
        counts = collections.Counter(str(m.get("event", "(no event name)")) for m in self.metrics)
        seen = ", ".join(f"{e} ×{n}" if n > 1 else e for e, n in counts.items()) or "none"
        if found:
            problem = (
                f"{len(found)} records match event({asked}), where one was asked for: "
                f"take them all with .events({asked}), or name a field that picks one"
            )
        else:
            problem = f"no record matches event({asked})"
            if not self.ok:
                problem += " (the job did not succeed: .check() says why)"
        raise EventError(f"{_script_of(self.command)}: {problem}. Events it emitted: {seen}.")

    def check(self) -> LaunchResult:
        """Return ``self`` if the job succeeded, else raise :class:`LaunchError`."""
        if self.ok:
            return self
        why = (
            f"timed out after {self.elapsed:.0f}s"
            if self.timed_out
            else f"exited with status {self.returncode}"
        )
        shown = [_format(r, t) for r, t in self.lines]
        tail = shown[-40:]
        first = first_cause(shown)
        # a rank's error scrolls away above the launcher's summary: show it first
        lead = (
            "First error:\n" + "\n".join(first) + "\n\n"
            if first and not any(is_cause(line) for line in tail)
            else ""
        )
        if not first and (last := last_lines_by_rank(self.lines, tail)):
            # no error line anywhere: a rank that stopped with a plain message
            # (sys.exit("...")) said why in its last lines, above the launcher's summary
            lead = "Each rank's last lines:\n" + "\n".join(last) + "\n\n"
        raise LaunchError(
            f"{' '.join(self.command)}\n{why}. {lead}Last output:\n" + "\n".join(tail)
        )


def last_lines_by_rank(
    lines: Sequence[tuple[int | None, str]], shown: Sequence[str], n: int = 3
) -> list[str]:
    """The last ``n`` lines of each rank, in rank order, that ``shown`` does not hold."""
    out = []
    for rank in sorted({r for r, _ in lines if r is not None}):
        own = [_format(rank, t) for r, t in lines if r == rank][-n:]
        out += [line for line in own if line not in shown]
    return out


def _format(rank: int | None, text: str) -> str:
    return text if rank is None else f"[rank {rank}] {text}"


def _script_of(cmd: Sequence[str]) -> str:
    """The program a command runs, for messages: its first ``.py`` (or ``-m`` module)."""
    for i, word in enumerate(cmd):
        if word.endswith(".py") or (i and cmd[i - 1] == "-m" and word != "torch.distributed.run"):
            return word
    return " ".join(cmd[:1]) or "the job"


class RankDemux:
    """Reassemble per-rank lines from a launcher's tagged output stream."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int | None, str], str] = {}
        self._rest = ""
        self._last_key: tuple[int | None, str] = (None, "stdout")

    def feed(self, text: str) -> Iterator[tuple[int | None, str]]:
        self._rest += text
        # Hold back a trailing "[..." that may be the first half of a tag cut by a read.
        cut = self._rest.rfind("[")
        tail = self._rest[cut:] if cut != -1 else ""
        if tail and "\n" not in tail and len(tail) < 24 and not _SEGMENT_TAG.search(tail):
            chunk, self._rest = self._rest[:cut], tail
        else:
            chunk, self._rest = self._rest, ""
        yield from self._split(chunk)

    def flush(self) -> Iterator[tuple[int | None, str]]:
        chunk, self._rest = self._rest, ""
        yield from self._split(chunk)
        for key, text in list(self._partial.items()):
            if text:
                yield key[0], text
        self._partial.clear()
        self._last_key = (None, "stdout")

    def _split(self, chunk: str) -> Iterator[tuple[int | None, str]]:
        pos = 0
        for m in _SEGMENT_TAG.finditer(chunk):
            yield from self._add(chunk[pos : m.start()])
            self._last_key = (int(m.group(1)), m.group(2))
            pos = m.end()
        yield from self._add(chunk[pos:])

    def _add(self, text: str) -> Iterator[tuple[int | None, str]]:
        key = self._last_key
        if not text:
            return
        if key[0] is not None and "\n" in text:
            # A tag covers one line: what follows its newline is the launcher's own.
            head, tail = text.split("\n", 1)
            yield from self._emit(key, head + "\n")
            self._last_key = (None, "stdout")
            yield from self._add(tail)
        else:
            yield from self._emit(key, text)

    def _emit(self, key: tuple[int | None, str], text: str) -> Iterator[tuple[int | None, str]]:
        buf = self._partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self._partial[key] = rest
        for line in lines:
            rank = key[0]
            m = _LINE_TAG.match(line) if rank is None else None
            if m:
                rank, line = int(m.group(1)), line[m.end() :]
            yield rank, line.rstrip("\r")


def _bin(name: str) -> str:
    """``name`` from this interpreter's environment first, then from ``PATH``."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise LaunchError(
            f"{name} is not installed (looked beside {sys.executable} and on PATH). "
            "Run `make setup`."
        )
    return found


def command(
    launcher: str,
    nprocs: int,
    script: str | os.PathLike,
    args: Sequence[str] = (),
    launcher_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    module: bool = False,
) -> list[str]:
    """The command line that starts ``script`` with ``nprocs`` processes on this machine.

    With ``module=True``, ``script`` is a module name run as ``python -m script``.

    For ``mpirun``, the variables of ``env`` (default: ours) that the labs use are
    forwarded with ``-x`` so they also reach ranks on other machines.
    """
    env = os.environ if env is None else env
    program = [*(["-m", str(script)] if module else [str(script)]), *map(str, args)]
    if launcher == "torchrun":
        return _torchrun(nprocs, program, launcher_args)
    if launcher == "horovodrun":
        return _horovodrun(nprocs, program, launcher_args)
    if launcher == "mpirun":
        return _mpirun(nprocs, program, launcher_args, env)
    if launcher == "python":
        if nprocs != 1:
            raise ValueError("launcher 'python' runs a single process")
        return [sys.executable, *program]
    raise ValueError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")


# Options of torchrun that mean the job brings its own (multi-node) rendezvous.
_RENDEZVOUS_OPTIONS = (
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
)

# Variables mpirun forwards (-x) so that ranks on other machines see them too.
_MPI_EXPORTED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    lmetrics.ENV_VAR,
    "LABS_PROFILE",
    "LABS_DIST_TIMEOUT",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "LABS_DATA",
    "LABS_CACHE",
    "LABS_RUNS",
    "GLOO_SOCKET_IFNAME",
)


def _torchrun(nprocs: int, program: list[str], launcher_args: Sequence[str]) -> list[str]:
    # --standalone picks a free local rendezvous; a multi-node job brings its own.
    multi = any(a.split("=")[0] in _RENDEZVOUS_OPTIONS for a in launcher_args)
    alone = [] if multi else ["--standalone"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *alone,
        f"--nproc-per-node={nprocs}",
        "--tee=3",
        *launcher_args,
        *program,
    ]


def _horovodrun(nprocs: int, program: list[str], launcher_args: Sequence[str]) -> list[str]:
    return [
        _bin("horovodrun"),
        "-np",
        str(nprocs),
        "-H",
        f"localhost:{nprocs}",
        "--gloo",
        *launcher_args,
        sys.executable,
        *program,
    ]


def _mpirun(
    nprocs: int, program: list[str], launcher_args: Sequence[str], env: Mapping[str, str]
) -> list[str]:
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    exported = [opt for var in _MPI_EXPORTED if var in env for opt in ("-x", var)]
    return [
        _bin("mpirun"),
        "-np",
        str(nprocs),
        *root,
        "--oversubscribe",
        "--bind-to",
        "none",
        "--tag-output",
        *exported,
        *launcher_args,
        sys.executable,
        *program,
    ]


def job_env(
    launcher: str, env: Mapping[str, str] | None, threads_per_proc: int | None, timeout: float
) -> dict[str, str]:
    """The environment a launched job gets: ours, plus rendezvous and limits."""
    out = dict(os.environ)
    out.update(env or {})
    out.setdefault("PYTHONUNBUFFERED", "1")  # live output
    if threads_per_proc is not None:
        out["OMP_NUM_THREADS"] = str(threads_per_proc)
    # Collectives give up a little before the launcher does, so the job can say why.
    out.setdefault("LABS_DIST_TIMEOUT", str(max(5, min(120, int(timeout * 0.8)))))
    if launcher == "mpirun":
        out.setdefault("MASTER_ADDR", "127.0.0.1")
        out.setdefault("MASTER_PORT", str(free_port()))
        out.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        out.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        out.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    repo = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo not in paths:  # scripts import lab_utils even when run from elsewhere
        out["PYTHONPATH"] = os.pathsep.join([repo, *paths])
    return out


def supervised(cmd: Sequence[str]) -> list[str]:
    """``cmd`` under the supervisor :mod:`lab_utils.reaper`, which ends its whole tree."""
    return [sys.executable, "-m", "lab_utils.reaper", "--", *cmd]


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a job started by :func:`stream` (its whole process group): ask its
    supervisor, which ends the tree; force the group if it does not within ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


LineHook = Callable[[int | None, str], None]


class _Output:
    """The job's lines as they come: the last ``keep`` kept, each shown to ``on_line``."""

    def __init__(self, keep: int | None, max_line: int | None, on_line: LineHook | None) -> None:
        self.lines: collections.deque[tuple[int | None, str]] = collections.deque(maxlen=keep)
        self.count = 0
        self._max_line = max_line
        self._on_line = on_line

    def take(self, lines: Iterable[tuple[int | None, str]]) -> None:
        for rank, text in lines:
            if self._max_line is not None:
                text = text[: self._max_line]
            self.lines.append((rank, text))
            self.count += 1
            if self._on_line is not None:
                self._on_line(rank, text)


def _pump(proc: subprocess.Popen, chunks: queue.Queue[bytes]) -> None:
    """Move the job's output into ``chunks``; an empty chunk says it ended."""
    assert proc.stdout is not None
    while data := os.read(proc.stdout.fileno(), 65536):
        chunks.put(data)
    chunks.put(b"")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _follow(
    chunks: queue.Queue[bytes], demux: RankDemux, out: _Output, start: float, timeout: float
) -> bool:
    """Read until the output ends (``False``) or ``timeout`` seconds pass (``True``)."""
    while (left := timeout - (time.monotonic() - start)) > 0:
        try:
            data = chunks.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if not data:
            return False
        out.take(demux.feed(_decode(data)))
    return True


def _drain(
    chunks: queue.Queue[bytes], reader: threading.Thread, demux: RankDemux, out: _Output
) -> None:
    """Take what is left once the job is stopped (bounded: its writers are gone)."""
    while True:
        try:
            data = chunks.get(timeout=0.5 if reader.is_alive() else 0)
        except queue.Empty:
            break
        if not data:
            break
        out.take(demux.feed(_decode(data)))
    out.take(demux.flush())


def stream(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    cwd: str | os.PathLike | None = None,
    on_line: LineHook | None = None,
    keep_lines: int | None = None,
    max_line: int | None = None,
    prefix: Sequence[str] = (),
) -> LaunchResult:
    """Run ``cmd`` under the supervisor, read its output live, wait at most ``timeout`` s.

    Each line, split by rank (:class:`RankDemux`) and cut to ``max_line`` characters,
    goes to ``on_line(rank, text)``; the result keeps the last ``keep_lines`` (``None``:
    all). Output is read through a small queue, so a job that floods it waits for the
    reader instead of filling memory. ``prefix`` goes before the supervisor (e.g. a
    command that puts the job in a cgroup). On timeout a line ``launch: timed out ...``
    is added and the whole tree is stopped; on ``KeyboardInterrupt`` too, then it is
    re-raised. ``result.metrics`` is left empty (see :func:`run`).
    """
    result = LaunchResult(command=list(cmd), returncode=-1, elapsed=0.0)
    out = _Output(keep_lines, max_line, on_line)
    start = time.monotonic()
    proc = subprocess.Popen(
        [*prefix, *supervised(cmd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=dict(env),
        start_new_session=True,
    )
    chunks: queue.Queue[bytes] = queue.Queue(maxsize=16)
    reader = threading.Thread(target=_pump, args=(proc, chunks), daemon=True)
    reader.start()
    demux = RankDemux()
    try:
        if _follow(chunks, demux, out, start, timeout):
            result.timed_out = True
            out.take([(None, f"launch: timed out after {timeout:g}s; stopping every process")])
    except KeyboardInterrupt:
        result.interrupted = True
        raise
    finally:
        stop(proc)
        _drain(chunks, reader, demux, out)
        result.returncode = proc.wait()
        result.elapsed = time.monotonic() - start
        result.lines, result.line_count = list(out.lines), out.count
    return result


def _echo(rank: int | None, text: str) -> None:
    print(_format(rank, text), flush=True)


# Variables a lab script's results depend on, shown before its command when the job has
# them (besides those the caller gave): the profile sizes the run, the threads time it.
SHOWN_VARS = ("LABS_PROFILE", "OMP_NUM_THREADS")


def _program_name(word: str) -> str:
    """``word`` as a shell finds it: a program beside this interpreter (on ``PATH`` once
    the course's environment is activated) or on ``PATH`` itself, by its name."""
    path = Path(word)
    if not path.is_absolute():
        return word
    here = Path(sys.executable).parent
    if path.parent == here or shutil.which(path.name) == word:
        return path.name
    return word


def shell_line(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    names: Iterable[str] = (),
    cwd: str | os.PathLike | None = None,
) -> str:
    """``cmd`` as one line to paste into a terminal, quoted with :func:`shlex.join`.

    ``VAR=value`` comes first for each of ``names`` that ``env`` has, and for each
    variable the command forwards (mpirun's ``-x VAR``); ``cd DIR &&`` when ``cwd`` is not
    the current folder. Programs beside this interpreter or on ``PATH`` are written by
    their name, and ``python -m torch.distributed.run`` as ``torchrun``, the console
    script torch installs for it (``torchrun = torch.distributed.run:main`` in torch's
    ``entry_points.txt``) when it is beside this interpreter."""
    words = list(cmd)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if words[:3] == torchrun and (Path(sys.executable).parent / "torchrun").exists():
        words = ["torchrun", *words[3:]]
    words = [_program_name(w) for w in words]
    env = env or {}
    forwarded = [w for before, w in zip(cmd, cmd[1:]) if before == "-x"]
    shown = [f"{k}={shlex.quote(env[k])}" for k in dict.fromkeys([*names, *forwarded]) if k in env]
    line = " ".join([*shown, shlex.join(words)])
    if cwd is not None and Path(cwd).resolve() != Path.cwd().resolve():
        line = f"cd {shlex.quote(str(cwd))} && {line}"
    return line


def run(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    launcher: str = "torchrun",
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    echo: bool = True,
    threads_per_proc: int | None = 1,
    launcher_args: Sequence[str] = (),
    module: bool = False,
    wrapper: Sequence[str] = (),
) -> LaunchResult:
    """Run ``script`` with ``nprocs`` processes under ``launcher`` and wait for it.

    Args:
        script: path of the Python script to run.
        args: its command-line arguments.
        nprocs: number of processes (ranks).
        launcher: ``torchrun``, ``horovodrun``, ``mpirun`` or ``python`` (one process).
        timeout: seconds before the whole job is killed (``result.timed_out``).
        env: extra environment variables for the job.
        cwd: working directory of the job.
        echo: print each line live as ``[rank N] ...``.
        threads_per_proc: ``OMP_NUM_THREADS`` for each rank (``None``: leave as is).
        launcher_args: extra options for the launcher itself.
        module: ``script`` is a module name, run as ``python -m script``.
        wrapper: a command the launcher runs under (``lab_utils.slow_link.prefix``: a
            network namespace of its own); it goes inside the supervisor, so a timeout or
            an interrupt ends it with the job.

    First it prints the command it starts, ``$ VAR=value ... launcher ... script args``
    (:func:`shell_line`: the variables of ``env`` and :data:`SHOWN_VARS`), so the cell
    shows how to run the same job from a terminal; ``echo`` is about the job's output.

    Returns a :class:`LaunchResult`; it does not raise when the job fails (call
    ``.check()`` for that) but re-raises ``KeyboardInterrupt`` after cleaning up. Its
    records: ``result.event(name)`` (exactly one), ``result.events(name)`` (all).
    """
    fd, metrics_file = tempfile.mkstemp(prefix="labs-metrics-", suffix=".jsonl")
    os.close(fd)
    job = job_env(launcher, env, threads_per_proc, timeout)
    job[lmetrics.ENV_VAR] = metrics_file
    cmd = [*wrapper, *command(launcher, nprocs, script, args, launcher_args, job, module)]
    print("$ " + shell_line(cmd, job, [*(env or {}), *SHOWN_VARS], cwd), flush=True)
    try:
        result = stream(cmd, env=job, cwd=cwd, timeout=timeout, on_line=_echo if echo else None)
        result.metrics = lmetrics.read(metrics_file)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(metrics_file)
    return result
