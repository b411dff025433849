"""A rendezvous port every rank of a one-machine job agrees on when the launcher gives none.

``mpirun``, ``srun`` and ``horovodrun`` start ranks without ``MASTER_PORT``. A port
derived from the job id can be taken by then (a busy machine holds thousands of
ephemeral ports: one of Gloo's connections held it once in CI), so rank 0 asks the
system for a free port and leaves it in a file named by the job, and the other
ranks wait for that file. The ranks share a machine, so they share its temporary
folder. A file left by an earlier job with the same id is known by its writer
being gone, and rank 0 removes such files when it writes its own.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from pathlib import Path

from .net import free_port

POLL_S = 0.05


def folder() -> Path:
    """Where this user's jobs leave their ports (one folder per user: no one else writes here)."""
    return Path(tempfile.gettempdir()) / f"lab_utils-ports-{os.getuid()}"


def port_file(job: str) -> Path:
    """The file of one job; ``job`` is the launcher's job id (see ``dist.detect``)."""
    return folder() / hashlib.sha1(job.encode()).hexdigest()[:16]


def publish(job: str) -> int:
    """Rank 0: pick a free port, write it for the other ranks, return it."""
    port = free_port()
    folder().mkdir(mode=0o700, exist_ok=True)
    _check_owner()
    _remove_stale()
    path = port_file(job)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(f"{port} {os.getpid()}\n")
    os.replace(partial, path)  # a reader sees the whole file or none
    return port


def wait_for(job: str, rank: int, timeout_s: float) -> int:
    """Any other rank: the port rank 0 published for this job."""
    path = port_file(job)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.parent.exists():
            _check_owner()
        found = _read(path)
        if found is not None and _alive(found[1]):
            return found[0]
        time.sleep(POLL_S)
    raise RuntimeError(
        f"rank {rank} waited {timeout_s:g} s for rank 0 to publish the job's rendezvous "
        f"port in {path}: if rank 0 failed, its output above says why. To choose the port "
        "yourself, give every rank the same MASTER_PORT (e.g. `mpirun -x MASTER_PORT=29500`)."
    )


def _check_owner() -> None:
    """The folder must be this user's alone: a port planted by someone else would send
    the ranks to another process's store."""
    st = folder().lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"{folder()} is not a folder of this user's alone, so the job's rendezvous port "
            "cannot be trusted to it: remove it, or give every rank the same MASTER_PORT."
        )


def _read(path: Path) -> tuple[int, int] | None:
    try:
        port, pid = path.read_text().split()
        return int(port), int(pid)
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    for path in folder().iterdir():
        if path.suffix == ".partial":  # name.<writer pid>.partial
            writer = path.name.split(".")[-2]
            gone = not writer.isdigit() or not _alive(int(writer))
        else:
            found = _read(path)
            gone = found is None or not _alive(found[1])
        if gone:
            path.unlink(missing_ok=True)
