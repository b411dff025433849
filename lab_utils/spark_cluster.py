"""A Spark standalone cluster on this machine: one master and N workers on 127.0.0.1.

The JVMs come from the ``pyspark`` package itself (its ``bin/spark-class``), so no
separate Spark download is needed, only Java 17+. Used as a context manager::

    with spark_cluster.local_cluster(workers=2) as cluster:
        spark = SparkSession.builder.master(cluster.url).getOrCreate()
        ...

Leaving the block, normally, by an exception or by Ctrl-C, stops every process the
cluster started: the master, the workers, the executors they launched and the
executors' Python workers. On a real cluster the same code only changes
``cluster.url`` for ``spark://host:7077``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from . import daemons
from .net import free_port

HOST = "127.0.0.1"

# The JVMs here live for seconds to minutes on a few cores: the C1 compiler alone and the
# serial collector halve the CPU they spend starting up (compiling and collecting for
# throughput they never reach). Used for the daemons and, through
# :func:`session_options`, for a driver and its executors.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


class SparkClusterError(RuntimeError):
    """The cluster could not start (no Java, no pyspark, a JVM exited); says why."""


def spark_home() -> Path:
    """The Spark distribution inside the installed ``pyspark`` package."""
    try:
        import pyspark
    except ImportError as e:
        raise SparkClusterError(
            "pyspark is not installed: run `make setup` (or pip install 'labs[spark]')"
        ) from e
    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").exists():
        raise SparkClusterError(f"{home} has no bin/spark-class: reinstall pyspark")
    return home


def java() -> str:
    """The ``java`` that Spark will use (``JAVA_HOME`` first, then ``PATH``)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not Path(found).exists():
        raise SparkClusterError(
            "Spark needs Java 17 or newer: apt-get install "
            "openjdk-17-jre-headless (run `make setup` as root)"
        )
    return found


def session_options() -> dict[str, str]:
    """Spark settings that start the driver's and the executors' JVMs with
    :data:`JVM_OPTIONS` (pass each to ``SparkSession.builder.config``)."""
    return {
        "spark.driver.extraJavaOptions": JVM_OPTIONS,
        "spark.executor.extraJavaOptions": JVM_OPTIONS,
    }


def get_json(url: str, timeout: float = 30.0) -> Any:
    """GET a JSON document (the master's ``/json/`` or a driver's REST API)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


@dataclass
class Cluster:
    """A running local cluster: where to connect and what it started."""

    url: str  # spark://127.0.0.1:PORT, what SparkSession.builder.master() takes
    ui_url: str  # the master's web UI (its JSON view: ui_url + "/json/")
    work_dir: Path  # executors' folders: work_dir/app-.../<executor id>/
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """The master's view: workers (id, host, cores, state) and applications."""
        return get_json(self.ui_url + "/json/")

    def alive_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.state().get("workers", []) if w.get("state") == "ALIVE"]

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster: JVMs, executors, Python workers."""
        found: list[psutil.Process] = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(p.pid)
                found += [top, *top.children(recursive=True)]
        return [p for p in found if daemons.alive(p)]

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop workers and master with everything below them; wait until all are gone."""
        for p in reversed(self.procs):  # workers first: the master then sees them leave
            with contextlib.suppress(psutil.NoSuchProcess):
                daemons.terminate_tree(psutil.Process(p.pid), grace_s)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace_s)
        # Each JVM was started in a session of its own: sweep the groups for strays.
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, 9)

    def tail(self, lines: int = 30) -> str:
        """The end of each JVM's log, to say why something failed."""
        return daemons.tail_logs(self.logs, lines)


def _start(cluster: Cluster, name: str, args: Sequence[str], env: dict[str, str]) -> None:
    log = cluster.work_dir / f"{name}.log"
    cluster.logs.append(log)
    cluster.procs.append(
        daemons.start_logged([str(spark_home() / "bin" / "spark-class"), *args], log, env)
    )


def _wait(cluster: Cluster, what: str, ready: Any, timeout: float) -> None:
    def check() -> None:
        for p in cluster.procs:
            if p.poll() is not None:
                raise SparkClusterError(
                    f"a Spark JVM exited with status {p.returncode} while "
                    f"waiting for {what}:\n{cluster.tail()}"
                )

    if not daemons.wait_for(ready, timeout, check=check, poll_s=0.5):
        raise SparkClusterError(
            f"timed out after {timeout:g}s waiting for {what}:\n{cluster.tail()}"
        )


@contextlib.contextmanager
def local_cluster(
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    work_dir: str | os.PathLike | None = None,
    timeout: float = 120.0,
) -> Iterator[Cluster]:
    """Start a master and ``workers`` workers (``cores`` and ``memory`` each) on
    127.0.0.1; yield the :class:`Cluster`; stop all of it on the way out."""
    if workers < 1 or cores < 1:
        raise ValueError(f"need workers >= 1 and cores >= 1, got {workers} and {cores}")
    java()  # a clear message now rather than a JVM that cannot start
    own_dir = work_dir is None
    wd = Path(tempfile.mkdtemp(prefix="labs-spark-")) if own_dir else Path(work_dir)
    wd.mkdir(parents=True, exist_ok=True)
    port, ui_port = free_port(), free_port()
    env = _daemon_env(wd)
    cluster = Cluster(url=f"spark://{HOST}:{port}", ui_url=f"http://{HOST}:{ui_port}", work_dir=wd)
    try:
        _start_master(cluster, port, ui_port, env, timeout)
        for i in range(workers):
            _start_worker(cluster, f"worker-{i + 1}", cores, memory, env)
        _wait(
            cluster, f"{workers} workers", lambda: len(cluster.alive_workers()) >= workers, timeout
        )
        yield cluster
    finally:
        cluster.stop()
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)


def _daemon_env(wd: Path) -> dict[str, str]:
    """The daemons' environment: on 127.0.0.1, logs and work in ``wd``."""
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP=HOST,
        SPARK_LOCAL_HOSTNAME=HOST,
        SPARK_WORKER_DIR=str(wd),
        SPARK_LOG_DIR=str(wd),
        SPARK_DAEMON_MEMORY=env.get("SPARK_DAEMON_MEMORY", "256m"),
        SPARK_DAEMON_JAVA_OPTS=f"{env.get('SPARK_DAEMON_JAVA_OPTS', '')} {JVM_OPTIONS}".strip(),
    )
    return env


def _start_master(
    cluster: Cluster, port: int, ui_port: int, env: dict[str, str], timeout: float
) -> None:
    args = ["--host", HOST, "--port", str(port), "--webui-port", str(ui_port)]
    _start(cluster, "master", ["org.apache.spark.deploy.master.Master", *args], env)
    _wait(cluster, "the master", lambda: cluster.state().get("status") == "ALIVE", timeout)


def _start_worker(
    cluster: Cluster, name: str, cores: int, memory: str, env: dict[str, str]
) -> None:
    args = ["--host", HOST, "--cores", str(cores), "--memory", memory]
    args += ["--webui-port", str(free_port()), "--work-dir", str(cluster.work_dir), cluster.url]
    _start(cluster, name, ["org.apache.spark.deploy.worker.Worker", *args], env)
