"""The sandbox a graded job runs in: bubblewrap, plus a memory and process limit.

Every launch of a submission runs as ``bwrap ... -- <launcher command>``. Inside, the
job sees, read-only, the system (``/usr``, ``/etc``, ...), the Python environment,
the course library (``lab_utils``, nothing else of the checkout) and a copy of the
**training** split of its dataset; the only writable places are its working
directory and a private ``/tmp``. It gets its own PID namespace (when its first
process ends, the kernel kills every process left in it, daemons included), its own
network namespace (loopback only: the ranks meet on ``lo``), no capabilities, and a
memory and process-count limit through a cgroup when the machine lets us make one.

Without bubblewrap (or without the namespaces it needs) :func:`check` says why, and
the grader refuses to run untrusted code unless told it may do so unsafely.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils import data as ldata

# System folders shown read-only (a symlink such as /bin -> usr/bin is recreated).
SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")
CACHE_NAME = "cache"  # in a training copy: the parsed tensors of it, for $LABS_CACHE
DEFAULT_MAX_PROCS = 256  # a fork bomb stops here, far above what a launcher needs
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; it needs "
    "root or unprivileged user namespaces)"
)


class JailError(RuntimeError):
    """No sandbox can be made here; the message says why and what to do."""


def bwrap() -> str | None:
    """The bubblewrap binary, or ``None``."""
    return shutil.which("bwrap")


def check() -> None:
    """Raise :class:`JailError` unless a sandbox with the namespaces we need starts here."""
    exe = bwrap()
    if exe is None:
        raise JailError(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
    probe = [
        exe,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--",
        "/bin/sh",
        "-c",
        "! touch /usr/.lab-grade-probe",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JailError(f"bubblewrap does not start: {e}") from e
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no message"]
        raise JailError(
            f"bubblewrap cannot make a sandbox here ({why[0]}); run the grader as "
            "root or enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1)"
        )


# --------------------------------------------------------------------------- training data
def training_copy(dataset: str, dest: Path) -> Path:
    """Copy the training files of ``dataset`` (and nothing of its test split) into
    ``dest/<dataset folder>``, marked :data:`lab_utils.data.TRAINING_ONLY`. Returns
    ``dest``, the folder to hand the job as ``$LABS_DATA``."""
    ds = ldata.load(dataset)
    src = Path(ds.source)
    kind = ldata._kind(dataset)
    folder = dest / kind.cache_folder
    folder.mkdir(parents=True, exist_ok=True)
    for name in kind.files:
        if name in ldata.TEST_FILES:
            continue
        if name == ldata.SYNTHETIC_MANIFEST:  # its checksum of test_batch names no file here
            lines = [
                ln
                for ln in (src / name).read_text().splitlines()
                if ln.strip() and not ln.strip().endswith(ldata.TEST_FILES)
            ]
            (folder / name).write_text("\n".join(lines) + "\n")
            continue
        shutil.copyfile(src / name, folder / name)
    (folder / ldata.TRAINING_ONLY).write_text(
        "The training split only: the grader keeps the test split out of the sandbox.\n"
    )
    # Parse it once here, into a cache the job reads (read-only) instead of parsing
    # the files again in every rank.
    saved = os.environ.get("LABS_CACHE")
    os.environ["LABS_CACHE"] = str(dest / CACHE_NAME)
    try:
        ldata.load(dataset, root=folder, download=False)
    finally:
        if saved is None:
            del os.environ["LABS_CACHE"]
        else:
            os.environ["LABS_CACHE"] = saved
    return dest


# --------------------------------------------------------------------------- cgroup limits
@dataclass
class Limits:
    """A cgroup (v1 or v2) holding one job, with a memory and a process-count limit."""

    memory_bytes: int
    max_procs: int = DEFAULT_MAX_PROCS
    dirs: list[Path] = field(default_factory=list)  # the cgroup folders made for the job
    how: str = "none"

    def join_command(self) -> list[str]:
        """A prefix that moves the command into the job's cgroups, then execs it."""
        if not self.dirs:
            return []
        writes = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs)
        return ["/bin/sh", "-c", f'{writes} && exec "$@"', "lab-grade-limits"]

    def peak_bytes(self) -> int | None:
        for d in self.dirs:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError, ValueError):
                    return int((d / name).read_text())
        return None

    def memory_killed(self) -> bool:
        """Whether the kernel killed a process of the job for going over the limit."""
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                if (d / "memory.events").is_file():  # v2
                    ev = dict(ln.split() for ln in (d / "memory.events").read_text().splitlines())
                    return int(ev.get("oom_kill", 0)) > 0
                if (d / "memory.failcnt").is_file():  # v1
                    oom = (d / "memory.oom_control").read_text()
                    killed = [ln for ln in oom.splitlines() if ln.startswith("oom_kill ")]
                    if killed:
                        return int(killed[0].split()[1]) > 0
                    return int((d / "memory.failcnt").read_text()) > 0
        return False

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


def _own_cgroup(controller: str) -> Path | None:
    """The folder of this process's cgroup for ``controller`` (v1), or v2's (``""``)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if (
                controller == ""
                and ctrls == ""
                and Path("/sys/fs/cgroup/cgroup.controllers").is_file()
            ):
                return Path("/sys/fs/cgroup") / path.lstrip("/")
            if controller and controller in ctrls.split(","):
                return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    return None


def make_limits(memory_mb: float, max_procs: int = DEFAULT_MAX_PROCS) -> Limits:
    """A fresh cgroup for one job, or a :class:`Limits` with ``how`` saying why not."""
    lim = Limits(memory_bytes=int(memory_mb * 2**20), max_procs=max_procs)
    name = f"lab-grade-{uuid.uuid4().hex[:12]}"
    v2 = _own_cgroup("")
    try:
        if v2 is not None and "memory" in (v2 / "cgroup.subtree_control").read_text():
            d = v2 / name
            d.mkdir()
            lim.dirs.append(d)
            (d / "memory.max").write_text(str(lim.memory_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.swap.max").write_text("0")
            with contextlib.suppress(OSError):
                (d / "pids.max").write_text(str(max_procs))
            lim.how = "cgroup v2"
            return lim
        mem = _own_cgroup("memory")
        if mem is not None and (mem / "memory.limit_in_bytes").is_file():
            d = mem / name
            d.mkdir()
            lim.dirs.append(d)
            (d / "memory.limit_in_bytes").write_text(str(lim.memory_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.memsw.limit_in_bytes").write_text(str(lim.memory_bytes))
            pids = _own_cgroup("pids")
            if pids is not None and pids.is_dir():
                with contextlib.suppress(OSError):
                    p = pids / name
                    p.mkdir()
                    lim.dirs.append(p)
                    (p / "pids.max").write_text(str(max_procs))
            lim.how = "cgroup v1"
            return lim
    except OSError as e:
        lim.remove()
        lim.dirs.clear()
        lim.how = f"none (cannot make a cgroup: {e})"
        return lim
    lim.how = "none (no writable memory cgroup)"
    return lim


# --------------------------------------------------------------------------- the command
def _python_paths() -> list[Path]:
    """What the interpreter needs: its environment and the installation it comes from."""
    paths = {
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(sys.exec_prefix),
        Path(sys.executable).parent.parent,
    }
    return sorted(paths)


def _show(path: Path, args: list[str], shown: set[str]) -> None:
    """Show ``path`` read-only at the same place, following links in it."""
    text = str(path)
    if text in shown or not os.path.lexists(text):
        return
    shown.add(text)
    if path.is_symlink():
        real = path.resolve()
        args += ["--symlink", os.readlink(text), text]
        _show(real, args, shown)
        return
    args += ["--ro-bind", text, text]


def gpu_devices() -> list[str]:
    """The NVIDIA device nodes of this machine (bound into the sandbox as they are)."""
    found: list[str] = []
    for pattern in GPU_DEVICE_GLOBS:
        found += sorted(glob.glob(pattern))
    return found


def command(
    cmd: list[str],
    *,
    workdir: Path,
    data_dir: Path | None,
    repo: Path,
    gpu: bool = False,
    hide: list[Path] | tuple[Path, ...] = (),
) -> list[str]:
    """``cmd`` wrapped in bubblewrap (see the module docstring for what it sees).

    ``hide`` are folders inside the visible system ones that must look empty (a full
    copy of a dataset, test split included); the system dataset folders always are.
    """
    exe = bwrap()
    if exe is None:
        raise JailError(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
    args = [exe, *ISOLATION]
    shown = _show_readable(args, repo, data_dir)
    args += _masks(shown, hide)
    args += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    if gpu:
        for dev in gpu_devices():
            args += ["--dev-bind", dev, dev]
    args += ["--hostname", "localhost", "--remount-ro", "/"]
    return [*args, "--", *cmd]


# Its own session, PID, network, IPC and host name, no capabilities, fresh /proc, /dev,
# /tmp and /dev/shm, and /sys read-only.
ISOLATION = (
    "--die-with-parent",
    "--new-session",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--cap-drop",
    "ALL",
    "--proc",
    "/proc",
    "--dev",
    "/dev",
    "--tmpfs",
    "/tmp",
    "--tmpfs",
    "/dev/shm",
    "--ro-bind",
    "/sys",
    "/sys",
)


def _show_readable(args: list[str], repo: Path, data_dir: Path | None) -> set[str]:
    """Add the read-only binds of what a job may read; the set of folders shown."""
    shown: set[str] = set()
    for p in SYSTEM_PATHS:
        _show(Path(p), args, shown)
    for p in _python_paths():
        _show(p, args, shown)
    # The course library alone: not the rest of the checkout (runs/, tests/, .git).
    for parent in reversed(repo.parents):
        if str(parent) != "/" and os.path.islink(parent):
            _show(parent, args, shown)
    _show(repo / "lab_utils", args, shown)
    for name in ("__init__.py", "starter.py"):  # the references import the starter's recipes
        _show(repo / "assessment" / name, args, shown)
    if data_dir is not None:
        _show(data_dir, args, shown)
    return shown


def _masks(shown: set[str], hide: list[Path] | tuple[Path, ...]) -> list[str]:
    """Empty read-only folders over the dataset folders inside a shown one (the system
    dataset folders and ``hide``), each once (not inside another mask)."""
    args: list[str] = []
    masked: list[str] = []
    for folder in sorted({*map(str, ldata.SYSTEM_DIRS), *(str(Path(h).resolve()) for h in hide)}):
        inside_shown = any(folder.startswith(p + "/") for p in shown)
        if (
            os.path.isdir(folder)
            and inside_shown
            and not any(folder == m or folder.startswith(m + "/") for m in masked)
        ):
            masked.append(folder)
            args += ["--tmpfs", folder, "--remount-ro", folder]
    return args


def sandbox_env(workdir: Path, data_dir: Path | None) -> dict[str, str]:
    """What a job needs to find inside: its home, its caches, its data, loopback."""
    cache = data_dir / CACHE_NAME if data_dir is not None else Path("/tmp/lab_utils-cache")
    env = {
        "HOME": "/tmp",
        "LABS_CACHE": str(cache),
        "TMPDIR": "/tmp",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "XDG_CACHE_HOME": "/tmp/.cache",
        "MPLCONFIGDIR": "/tmp/.mpl",
        "LABS_RUNS": str(workdir / "runs"),
    }
    if data_dir is not None:
        env["LABS_DATA"] = str(data_dir)
    return env
