"""A one-node Slurm cluster on this machine, for the tests and for trying sbatch files.

Everything lives in a temporary folder: ``slurm.conf``, the state and spool folders,
the logs, a munge key and munge's socket. Its own ``munged`` (with ``--force``, since
it runs as root), ``slurmctld`` and ``slurmd`` run in the foreground as children of
this process, on free ports, so a cluster started here never meets the machine's own
Slurm or munge, if any. Used as a context manager::

    with slurm_cluster.local_cluster() as cluster:
        subprocess.run(["sbatch", "job.sbatch"], env=cluster.env(), check=True)

Leaving the block, normally, by an exception or by Ctrl-C, cancels every job, stops
the three daemons and kills whatever is left of the jobs (``slurmstepd`` and the
jobs' own processes, found by the cluster's tag in their environment), then removes
the folder. Needs root (Slurm's daemons run as ``SlurmUser=root`` here) and the
Debian packages ``slurmctld slurmd slurm-client munge``; :func:`why_not` says what is
missing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import daemons
from .net import free_port

TAG_VAR = "LABS_SLURM_CLUSTER"  # in the environment of the daemons and of every job
PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "scontrol",
    "scancel",
    "sinfo",
)
INSTALL_HINT = "apt-get install slurmctld slurmd slurm-client munge (`make setup` as root does it)"


class SlurmClusterError(RuntimeError):
    """The cluster could not start (a program missing, a daemon exited); says why."""


def program(name: str) -> str | None:
    """Path of a Slurm or munge program (the daemons live in /usr/sbin)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def why_not() -> str | None:
    """Why no test cluster can run here, or None when one can."""
    missing = [p for p in PROGRAMS if program(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "a test Slurm cluster runs its daemons as root (SlurmUser=root); run as root"
    return None


def node_name() -> str:
    """The node's name as slurmd sees it: the short host name."""
    return socket.gethostname().split(".")[0]


def config(folder: Path, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    """A minimal ``slurm.conf`` for one node of ``cpus`` CPUs, all state in ``folder``."""
    host = node_name()
    return "\n".join(
        [
            "ClusterName=labs",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge.socket'}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            # No cgroups and no systemd: processes tracked by parent id, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            # Finished jobs stay visible to `scontrol show job` for an hour: their state
            # (COMPLETED, CANCELLED, TIMEOUT) is how the grader tells why a job ended.
            "MinJobAge=3600",
            "KillWait=5",
            "InactiveLimit=0",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class Cluster:
    """A running one-node cluster: its folder, its configuration and its daemons."""

    folder: Path
    cpus: int
    node: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment in which ``sbatch``, ``srun`` and ``squeue`` use this cluster."""
        env = dict(os.environ if base is None else base)
        env.update(SLURM_CONF=str(self.conf), **{TAG_VAR: str(self.folder)})
        return env

    def run(
        self, args: Sequence[str], timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; its text output."""
        return subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, timeout=timeout, check=check
        )

    def node_state(self) -> str:
        done = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster: daemons, step daemons, jobs."""
        found = {p.pid: p for p in _tagged(str(self.folder))}
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(p.pid)
                for q in [top, *top.children(recursive=True)]:
                    found[q.pid] = q
        return [p for p in found.values() if daemons.alive(p)]

    def stop(self, grace_s: float = 10.0) -> None:
        """Cancel the jobs, stop the daemons, kill what is left of the jobs."""
        if self.procs and all(p.poll() is None for p in self.procs):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=10, check=False)
                ids = sorted(set(jobs.stdout.split()))
                if ids:
                    self.run(["scancel", *ids], timeout=10, check=False)
                    daemons.wait_for(
                        lambda: (
                            not self.run(
                                ["squeue", "-h", "-o", "%A"], timeout=10, check=False
                            ).stdout.strip()
                        ),
                        grace_s,
                    )
        for p in reversed(self.procs):  # slurmd, then slurmctld, then munged
            daemons.terminate([psutil.Process(p.pid)] if p.poll() is None else [], grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace_s)
        # Step daemons and job processes outlive slurmd by design: find them by the tag.
        daemons.terminate(_tagged(str(self.folder)), grace_s)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, 9)

    def tail(self, lines: int = 20) -> str:
        """The end of each daemon's log, to say why something failed."""
        return daemons.tail_logs(self.logs, lines)


def _tagged(folder: str) -> list[psutil.Process]:
    """Processes whose environment names this cluster (its tag or its slurm.conf)."""
    conf = str(Path(folder) / "slurm.conf")
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(TAG_VAR) == folder or env.get("SLURM_CONF") == conf:
            found.append(p)
    return [p for p in found if daemons.alive(p)]


def _start(cluster: Cluster, name: str, args: Sequence[str], env: dict[str, str]) -> None:
    log = cluster.folder / f"{name}.out"
    cluster.logs.append(log)
    cluster.procs.append(daemons.start_logged(args, log, env))


def _check_running(cluster: Cluster, what: str) -> None:
    for p in cluster.procs:
        if p.poll() is not None:
            raise SlurmClusterError(
                f"a daemon exited with status {p.returncode} while "
                f"waiting for {what}:\n{cluster.tail()}"
            )


def _wait(cluster: Cluster, what: str, ready, timeout: float) -> None:
    if not daemons.wait_for(ready, timeout, check=lambda: _check_running(cluster, what)):
        raise SlurmClusterError(
            f"timed out after {timeout:g}s waiting for {what}:\n{cluster.tail()}"
        )


def _munge_key(folder: Path) -> Path:
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return key


def start(cluster: Cluster, timeout: float) -> None:
    """Write the configuration and start munged, slurmctld and slurmd; wait for idle."""
    folder = cluster.folder
    for sub in ("state", "spool"):
        (folder / sub).mkdir(mode=0o700)
    cluster.conf.write_text(config(folder, cluster.cpus, free_port(), free_port()))
    env = cluster.env()
    sock = folder / "munge.socket"
    _start(
        cluster,
        "munged",
        [
            program("munged"),
            "--foreground",
            "--force",
            f"--socket={sock}",
            f"--key-file={_munge_key(folder)}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--log-file={folder / 'munged.log'}",
            f"--seed-file={folder / 'munged.seed'}",
        ],
        env,
    )
    _wait(cluster, "munged", sock.exists, timeout)
    _start(cluster, "slurmctld", [program("slurmctld"), "-D", "-f", str(cluster.conf)], env)
    _wait(
        cluster,
        "slurmctld",
        lambda: cluster.run(["scontrol", "ping"], timeout=10, check=False).returncode == 0,
        timeout,
    )
    _start(
        cluster,
        "slurmd",
        [program("slurmd"), "-D", "-f", str(cluster.conf), "-N", cluster.node],
        env,
    )
    cluster.logs += [folder / "slurmctld.log", folder / "slurmd.log"]
    _wait(
        cluster,
        f"node {cluster.node} to be idle",
        lambda: cluster.node_state().startswith("idle"),
        timeout,
    )


@contextlib.contextmanager
def local_cluster(
    cpus: int | None = None, folder: str | os.PathLike | None = None, timeout: float = 60.0
) -> Iterator[Cluster]:
    """Start a one-node cluster with ``cpus`` CPUs (default: all of this machine's);
    yield the :class:`Cluster`; stop all of it on the way out (see the module docstring)."""
    problem = why_not()
    if problem:
        raise SlurmClusterError(problem)
    own = folder is None
    wd = Path(tempfile.mkdtemp(prefix="labs-slurm-")) if own else Path(folder)
    wd.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(folder=wd, cpus=cpus or os.cpu_count() or 1, node=node_name())
    atexit.register(cluster.stop)  # also on sys.exit() from inside the block
    try:
        start(cluster, timeout)
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)
        if own:
            shutil.rmtree(wd, ignore_errors=True)
