"""Horovod on a local Spark standalone cluster: the Lab 2.6 script, and a failing rank.

Every process the script starts (master, workers, executors, Python workers, Horovod
ranks) inherits a marker in its environment; after the run none may be left. The
training and the failing job run on one cluster started once for this file (the
script's ``--master``): each leaves no executor behind on it, and none of its processes
outlives it. The interrupt test starts the script's own cluster, as a student does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_started

from lab_utils import launch, spark_cluster

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "labs" / "lab2_data_parallel" / "scripts"
SCRIPT = SCRIPTS / "train_horovod_spark.py"
SMALL = ["--n-train", "256", "--n-test", "128", "--batch-size", "32"]


def _missing() -> str | None:
    try:
        import horovod.spark  # noqa: F401  (imports pyspark too)
        import pyarrow  # noqa: F401
    except ImportError as e:
        return f"needs Horovod and the spark extra ({e}); run `make setup`"
    from lab_utils import spark_cluster

    try:
        spark_cluster.java()
    except spark_cluster.SparkClusterError as e:
        return str(e)
    return None


MISSING = _missing()
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI must run the Spark tests: {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def command_line(p: psutil.Process) -> str:
    """``p``'s command line, or "" once it has ended (it may turn zombie at any moment)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``LABS_SPARK_TEST=marker``."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and p.environ().get("LABS_SPARK_TEST") == marker
            ):
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_none_left(marker: str, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = []
    for p in left:
        try:
            out.append(" ".join(p.cmdline())[:200])
        except psutil.Error:
            continue
    return out


def test_marker_finds_processes():
    """The leftover check can fail: a marked process is found until it ends."""
    marker = secrets.token_hex(8)
    proc = subprocess.Popen(["sleep", "30"], env=dict(os.environ, LABS_SPARK_TEST=marker))
    try:
        wait_started(proc, "sleep 30")
        assert [p.pid for p in marked(marker)] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert wait_none_left(marker) == []


@pytest.fixture(scope="class")
def cluster():
    """One standalone cluster (a master, two workers of one core) for the jobs of
    :class:`TestOnOneCluster`, stopped before the next test starts a cluster of its own.
    Its JVMs and every executor they start carry a marker of their own: once it has
    stopped, none may be left."""
    marker = secrets.token_hex(8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABS_SPARK_TEST", marker)  # local_cluster passes its environment on
        with spark_cluster.local_cluster(workers=2, cores=1) as c:
            mp.delenv("LABS_SPARK_TEST")  # the jobs' drivers carry the test's own marker
            yield c
    assert wait_none_left(marker) == []


def executors(c: spark_cluster.Cluster) -> list[str]:
    """The command lines of ``c``'s live executors: none once a job has ended."""
    return [line for p in c.processes() if "ExecutorBackend" in (line := command_line(p))]


def wait_no_executors(c: spark_cluster.Cluster, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := executors(c)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [line[:200] for line in left]


def test_executor_check_finds_an_executor(tmp_path):
    """The check that a job left no executor can fail: a process named like one, below
    a cluster's daemon, is found until it ends."""
    daemon = subprocess.Popen(["bash", "-c", "exec -a CoarseGrainedExecutorBackend sleep 30"])
    c = spark_cluster.Cluster(url="spark://x:1", ui_url="http://x:2", work_dir=tmp_path)
    c.procs.append(daemon)
    try:
        wait_started(daemon, "CoarseGrainedExecutorBackend 30")
        assert len(executors(c)) == 1
    finally:
        daemon.kill()
        daemon.wait()
    assert wait_no_executors(c, timeout=5) == []


@pytest.mark.slow
class TestOnOneCluster:
    """The script's jobs on a running cluster (``--master``), as on a shared one."""

    def test_script_trains_on_two_executors(self, cluster):
        marker = secrets.token_hex(8)
        job = launch.run(
            SCRIPT,
            [*SMALL, "--master", cluster.url],
            nprocs=1,
            launcher="python",
            timeout=600,
            env={"LABS_SPARK_TEST": marker},
            cwd=SCRIPTS.parent,
        )
        job.check()
        s = job.metrics[-1]
        assert s["script"] == "horovod_spark" and s["world_size"] == 2
        assert sorted(r["rank"] for r in s["ranks"]) == [0, 1]
        executors = {r["executor_id"] for r in s["ranks"]}
        assert len(executors) == 2, f"both ranks in one executor: {s['ranks']}"
        # The Spark UI's record of the Horovod job: one task per rank, on those executors.
        horovod_tasks = [t for t in s["tasks"] if t["executor_id"] in executors]
        assert {t["executor_id"] for t in horovod_tasks} == executors
        assert sum(s["class_counts"].values()) == 256
        assert 0.0 <= s["val_acc"] <= 1.0 and s["steps"] == 4  # 256 / (2 ranks × 32)
        assert wait_none_left(marker) == []
        assert wait_no_executors(cluster) == []

    def test_failing_training_function_ends_the_job(self, tmp_path, cluster):
        """A training function that raises fails the Spark job; its error reaches the
        driver's output, and no JVM or Python worker is left. The ranks fail before
        reading any data, so the driver skips Spark's data step (the training test runs
        it): the job is the Horovod one alone."""
        driver = tmp_path / "broken_driver.py"
        driver.write_text(
            textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(SCRIPTS)!r})
            import train_horovod_spark as t

            def broken(*args, **kwargs):
                import horovod.torch as hvd
                hvd.init()
                raise ValueError(f"rank {{hvd.rank()}} broke on purpose")

            t.train_fn = broken
            t.prepare = lambda spark, ds, store: {{}}
            t.main(sys.argv[1:])
        """)
        )
        marker = secrets.token_hex(8)
        job = launch.run(
            driver,
            [*SMALL, "--timeout", "120", "--master", cluster.url],
            nprocs=1,
            launcher="python",
            timeout=600,
            env={"LABS_SPARK_TEST": marker},
            cwd=tmp_path,
        )
        assert not job.ok
        assert "broke on purpose" in job.output, job.output[-3000:]
        assert wait_none_left(marker) == []
        assert wait_no_executors(cluster) == []


@pytest.mark.slow
def test_interrupt_stops_the_cluster(tmp_path):
    """Ctrl-C while Spark's executors are up: the script's `with` block stops every
    JVM of the cluster it started itself (no supervisor in between)."""
    marker = secrets.token_hex(8)
    env = dict(os.environ, LABS_SPARK_TEST=marker, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *SMALL],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not any("CoarseGrainedExecutorBackend" in command_line(p) for p in marked(marker)):
            assert proc.poll() is None, "the script ended before its executors started"
            assert time.monotonic() < deadline, "no Spark executor started"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            for p in marked(marker):  # a failed wait: the JVMs the killed script left
                with contextlib.suppress(psutil.Error):
                    p.kill()
    assert wait_none_left(marker) == []


def test_local_cluster_bad_input():
    from lab_utils import spark_cluster

    with pytest.raises(ValueError, match="workers"), spark_cluster.local_cluster(workers=0):
        pass


def test_daemons_start_with_cheap_jvm_options(tmp_path, monkeypatch):
    """The master and workers start with the C1-only, serial-GC options, after any the
    user set: the quick runs' JVMs cost about half the CPU that way."""
    monkeypatch.setenv("SPARK_DAEMON_JAVA_OPTS", "-Dlabs.mine=1")
    env = spark_cluster._daemon_env(tmp_path)
    assert env["SPARK_DAEMON_JAVA_OPTS"] == f"-Dlabs.mine=1 {spark_cluster.JVM_OPTIONS}"
    assert set(spark_cluster.session_options().values()) == {spark_cluster.JVM_OPTIONS}
