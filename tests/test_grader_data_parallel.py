"""The grader tells a data-parallel job from one rank training alone.

The evidence is the kernel's (assessment/participation.py): each rank's TCP bytes
with the other ranks, read from the sockets' own counters from outside the job.
Unit tests check the counting on real sockets between real processes and the
thresholds; launched tests grade, on the small Fashion-MNIST target of the sandbox
tests, a rank 0 that trains alone while rank 1 spins or sleeps (``not_data_parallel``,
exit 1, rank 1 named; a warning where the target says ``data_parallel = "warn"``).
A rank 1 that exits at once (tests/submissions/lone_rank.py) and an honest
data-parallel job (good_linear.py, passes with every rank's bytes above the minimum)
are graded in tests/test_sandbox.py's class, which checks the same evidence. The slow ones
check the bytes of the references under every launcher, in the gradings
tests/test_grader.py checks the verdicts of (graded once per session).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import sandbox_or_skip

from assessment import grade, participation, targets
from assessment.participation import GpuWatch, SocketWatch

REPO = Path(__file__).resolve().parents[1]
SUBMISSIONS = REPO / "tests" / "submissions"
SANDBOX_TARGET = SUBMISSIONS / "sandbox.toml"  # Fashion-MNIST, linear model, ample budget
HAS_MPI = shutil.which("mpirun") is not None
HAS_HOROVOD = (
    importlib.util.find_spec("horovod") is not None
    and (Path(sys.executable).parent / "horovodrun").exists()
)

# A process of the unit tests: ``listen``/``connect`` (the two ends of a connection,
# moving NBYTES each way), ``self`` (a connection to itself, moving NBYTES), or
# ``idle`` (a connection to the test process, which sends it NBYTES); it holds its
# sockets until its standard input closes.
PEER = textwrap.dedent("""
    import socket, sys
    role, n = sys.argv[1], int(sys.argv[2])
    def pump(a, b):
        a.sendall(b"x" * n); got = 0
        while got < n: got += len(b.recv(1 << 16))
    held = []
    if role == "listen":
        lst = socket.create_server(("127.0.0.1", 0)); print(lst.getsockname()[1], flush=True)
        conn, _ = lst.accept(); held.append(conn)
        got = 0
        while got < n: got += len(conn.recv(1 << 16))
        conn.sendall(b"y" * n)
    elif role == "connect":
        c = socket.create_connection(("127.0.0.1", int(sys.argv[3]))); held.append(c)
        c.sendall(b"x" * n)
        got = 0
        while got < n: got += len(c.recv(1 << 16))
    elif role == "self":
        lst = socket.create_server(("127.0.0.1", 0))
        c = socket.create_connection(lst.getsockname()); s, _ = lst.accept(); held += [c, s]
        pump(c, s)
    elif role == "idle":
        c = socket.create_connection(("127.0.0.1", int(sys.argv[3]))); held.append(c)
        got = 0
        while got < n: got += len(c.recv(1 << 16))
    print("ready", flush=True)
    sys.stdin.read()
""")
NBYTES = 1_000_000


def _peer(role: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PEER, role, str(NBYTES), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_only_bytes_between_ranks_count(tmp_path: Path) -> None:
    """Ranks 0 and 1 exchange 1 MB each way; rank 0 also pumps 1 MB to itself, and
    rank 2 only gets 1 MB from a process that is no rank (a launcher, here the test)."""
    launcher = socket.create_server(("127.0.0.1", 0))
    procs = []
    try:
        r0 = _peer("listen")
        procs.append(r0)
        port = r0.stdout.readline().strip()
        r1 = _peer("connect", port)
        own = _peer("self")  # a second process of rank 0: its bytes stay inside rank 0
        r2 = _peer("idle", str(launcher.getsockname()[1]))
        procs += [r1, own, r2]
        to_r2, _ = launcher.accept()
        to_r2.sendall(b"z" * NBYTES)
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        watch = SocketWatch()
        watch.sample(
            [
                (psutil.Process(r0.pid), 0),
                (psutil.Process(r1.pid), 1),
                (psutil.Process(own.pid), 0),
                (psutil.Process(r2.pid), 2),
                (psutil.Process(), None),
            ]
        )  # a process of no rank: not read
        if watch.unavailable:
            pytest.skip(
                f"the kernel does not let this user read another's sockets: {watch.unavailable}"
            )
        sent, received = watch.per_rank(3)
    finally:
        for p in procs:
            p.communicate(timeout=30)
        launcher.close()
        if "to_r2" in locals():
            to_r2.close()
    # The counts are the kernel's: exactly what crossed between ranks 0 and 1.
    assert (sent, received) == ({0: NBYTES, 1: NBYTES, 2: 0}, {0: NBYTES, 1: NBYTES, 2: 0})
    # A model whose minimum fits under 1 MB: rank 2 alone is named.
    params = NBYTES // (participation.MIN_EXCHANGES * participation.BYTES_PER_PARAM)
    found = participation.idle_ranks_by_bytes(sent, received, params)
    assert len(found) == 1 and found[0].startswith("rank 2 took no part"), found
    # One parameter more and ranks 0 and 1 fall short too.
    again = participation.idle_ranks_by_bytes(sent, received, params + 1)
    assert again[0].startswith("no rank exchanged gradients"), again


def test_the_minimum_is_a_count_of_gradient_bytes() -> None:
    need = participation.minimum_bytes(1000)
    assert need == participation.MIN_EXCHANGES * participation.BYTES_PER_PARAM * 1000
    ok = {0: need, 1: need}
    assert participation.idle_ranks_by_bytes(ok, ok, 1000) == []
    short = participation.idle_ranks_by_bytes({0: need, 1: need - 1}, ok, 1000)
    assert "rank 1 took no part" in short[0] and "rank 0" not in short[0]
    # Receiving the initial broadcast and then spinning: received, never sent.
    bcast = participation.idle_ranks_by_bytes({0: need, 1: 0}, {0: 0, 1: need}, 1000)
    assert bcast[0].startswith("no rank exchanged") and "rank 1 sent 0.00 MB" in bcast[0]


def test_without_socket_counts_the_namespace_total_decides_or_nothing_does() -> None:
    need = participation.minimum_bytes(1000)
    w = SocketWatch(unavailable="pidfd_getfd: Operation not permitted")
    findings, why = participation.judge(2, 1000, w, None)
    assert findings == [] and "no network namespace" in why  # a warning, never a verdict
    w.lo_bytes = 2 * need - 1
    findings, why = participation.judge(2, 1000, w, None)
    assert why == "" and "cannot be told here" in findings[0]
    w.lo_bytes = 2 * need
    assert participation.judge(2, 1000, w, None) == ([], "")
    assert participation.judge(1, 1000, SocketWatch(), None) == ([], "")  # one process


def test_gpu_use_names_the_idle_rank_and_missing_nvml_is_said() -> None:
    assert participation.idle_ranks_by_gpu({0: 400.0, 1: 390.0}, 2) == []
    idle = participation.idle_ranks_by_gpu({0: 400.0, 1: 20.0}, 2)
    assert len(idle) == 1 and idle[0].startswith("rank 1 used 5%")
    assert participation.idle_ranks_by_gpu({0: 400.0}, 2)[0].startswith("rank 1 used 0%")
    if importlib.util.find_spec("pynvml") is None:
        gpu = GpuWatch()
        findings, why = participation.judge(2, 1000, SocketWatch(), gpu)
        assert findings == [] and "no NVML here" in why


def test_the_target_option_is_checked_and_shipped() -> None:
    raw = {
        "dataset": "fashion-mnist",
        "accuracy": 0.9,
        "budget_s": 60,
        "processes": 2,
        "archs": ["fmnist_cnn"],
    }
    assert targets.from_dict(raw).data_parallel == "require"  # the default
    assert targets.from_dict({**raw, "data_parallel": "warn"}).data_parallel == "warn"
    with pytest.raises(targets.TargetError, match="data_parallel"):
        targets.from_dict({**raw, "data_parallel": "maybe"})
    for name in targets.available():
        assert targets.load(name).data_parallel == "require", name


# --------------------------------------------------------------------------- graded jobs
# Rank 0 trains a linear model alone (the same steps as tests/submissions/good_linear.py,
# without DDP) and saves; the other ranks do what MODE says.
ALONE = textwrap.dedent('''
    """Not data-parallel: rank 0 trains alone while the other ranks {mode}."""
    import os, sys, time
    import torch
    import torch.nn.functional as F
    from lab_utils import data, models

    MODE = "{mode}"
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank != 0:
        end = time.monotonic() + 240  # bounded, should rank 0 fail
        while not os.path.exists("checkpoint.pt") and time.monotonic() < end:
            if MODE == "sleep":
                time.sleep(0.1)
        sys.exit(0)
    torch.manual_seed(0)
    ds = data.load("fashion-mnist").holdout(0.05)
    x = (ds.x_train[:24000].float() / 255 - ds.mean[0]) / ds.std[0]
    model = models.build("linear", in_channels=1, image_size=28, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(0, len(x), 100):
        loss = F.cross_entropy(model(x[i:i + 100]), ds.y_train[i:i + 100])
        opt.zero_grad()
        loss.backward()
        opt.step()
    models.save("saving.pt", model)
    os.replace("saving.pt", "checkpoint.pt")
''')
# (A rank 1 that exits at once: tests/submissions/lone_rank.py, in test_sandbox.py's class.)
MODES = {
    "spin": "busy-spin until the checkpoint appears",
    "sleep": "sleep until the checkpoint appears",
}


def _sandbox_or_skip() -> targets.Target:
    sandbox_or_skip()
    return targets.load(SANDBOX_TARGET)


def _alone(tmp_path: Path, mode: str) -> Path:
    path = tmp_path / f"alone_{mode}.py"
    path.write_text(ALONE.format(mode=mode))
    return path


@pytest.mark.launcher
@pytest.mark.parametrize("mode", list(MODES))
def test_a_rank_training_alone_is_not_data_parallel(tmp_path: Path, mode: str) -> None:
    t = _sandbox_or_skip()
    r = grade.grade(_alone(tmp_path, mode), t)
    assert (r.reason, r.exit_code) == ("not_data_parallel", 1), r.text()
    assert r.accuracy >= t.accuracy  # it met the target: only the evidence fails it
    assert "rank 1 sent 0.00 MB and received 0.00 MB" in r.message, r.message
    assert [row["sent_mb"] for row in r.ranks] == [0.0, 0.0]
    assert "FAIL: not_data_parallel" in r.text()
    assert not any(w.startswith("not data-parallel") for w in r.warnings)  # said once


@pytest.mark.launcher
def test_with_warn_the_target_keeps_its_verdict_and_says_why(tmp_path: Path) -> None:
    t = dataclasses.replace(_sandbox_or_skip(), data_parallel="warn")
    r = grade.grade(_alone(tmp_path, "spin"), t)
    assert (r.reason, r.exit_code) == ("passed", 0), r.text()
    said = [w for w in r.warnings if w.startswith("not data-parallel")]
    assert len(said) == 1 and "rank 1 sent 0.00 MB" in said[0], r.warnings


# In the opposite order of tests/test_grader.py's: where the two modules reach the
# references at the same time on two workers, each grades a different one first.
REFERENCES = [
    pytest.param(
        "reference_horovod.py",
        "horovodrun",
        marks=[pytest.mark.skipif(not HAS_HOROVOD, reason="no Horovod"), pytest.mark.horovod],
    ),
    pytest.param(
        "reference_horovod.py",
        "mpirun",
        marks=[
            pytest.mark.skipif(not (HAS_MPI and HAS_HOROVOD), reason="no mpirun or Horovod"),
            pytest.mark.horovod,
        ],
    ),
    pytest.param(
        "reference_ddp.py", "mpirun", marks=pytest.mark.skipif(not HAS_MPI, reason="no mpirun")
    ),
    ("reference_ddp.py", "torchrun"),
]


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.parametrize("script, launcher", REFERENCES)
def test_the_references_pass_as_data_parallel(script: str, launcher: str, graded_reference) -> None:
    """Every rank of every reference moved at least the gradients' bytes. The gradings
    are the ones test_grader.py checks the verdicts of (conftest.graded_reference: the
    shipped CPU targets with four times their budget, one epoch on the CIFAR-10
    stand-in), made once per session."""
    sandbox_or_skip()
    r = graded_reference(script, launcher)
    assert (r.reason, r.exit_code) == ("passed", 0), r.text()
    need_mb = participation.minimum_bytes(r.checkpoint["parameters"]) / 2**20
    assert min(min(row["sent_mb"], row["received_mb"]) for row in r.ranks) >= need_mb, r.ranks


def test_a_fault_of_the_evidence_is_never_judged_on() -> None:
    """A sampler that raises leaves the counts empty: that must read as "could not
    check" (a warning), never as ranks that exchanged nothing (a verdict)."""
    import time

    from assessment import sandbox

    class Faulty(SocketWatch):
        def sample(self, procs: object) -> None:
            raise RuntimeError("a bug in the sampler")

    faulty = Faulty()
    watch = sandbox._CpuWatch(every_s=0.05, observers=[faulty])
    watch.start()
    time.sleep(0.3)
    watch.stop()
    assert len(watch.samples) > 2  # the CPU sampling went on
    findings, why = participation.judge(2, 1000, faulty, None)
    assert findings == [] and "a bug in the sampler" in why


def test_a_rank_seen_before_its_exec_is_still_found() -> None:
    """Between fork and exec a launcher's child has the launcher's environment (no
    rank) under the pid and start time it keeps: a later look must find its rank."""
    from assessment import sandbox

    class Forked:  # what psutil shows of the child: first the fork, then the rank
        environs = [{"PATH": "/bin"}, {"PATH": "/bin", "RANK": "1"}]

        def environ(self) -> dict[str, str]:
            return self.environs.pop(0) if len(self.environs) > 1 else self.environs[0]

    watch, child, key = sandbox._CpuWatch(), Forked(), (4321, 1.5)
    assert watch._rank_of(key, child) is None
    assert watch._rank_of(key, child) == 1
    assert watch._rank_of(key, child) == 1


def test_gpu_watch_adds_each_ranks_nvml_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML stood in by a fake module (no GPU here): each rank's samples are summed,
    each sample once (NVML is asked only for samples newer than the last one seen)."""
    import types
    from collections import namedtuple

    sample = namedtuple("sample", "pid timeStamp smUtil")
    feed = [
        [sample(100, 1, 90), sample(200, 1, 5), sample(300, 1, 50)],
        [sample(100, 2, 80), sample(200, 2, 0)],
    ]
    asked: list[int] = []

    class NVMLError(Exception):
        pass

    def utilisation(handle: object, since: int) -> list:
        asked.append(since)
        if not feed:
            raise NVMLError("no new samples")
        return [s for s in feed.pop(0) if s.timeStamp > since]

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetProcessUtilization=utilisation,
        NVMLError=NVMLError,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpu = GpuWatch()
    assert gpu.unavailable == ""

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    procs = [(Proc(100), 0), (Proc(200), 1), (Proc(300), None)]  # 300: no rank (a launcher)
    for _ in range(3):
        gpu.sample(procs)
    gpu.close()
    assert asked == [0, 1, 2] and gpu.use == {0: 170.0, 1: 5.0}
    findings, why = participation.judge(2, 1000, SocketWatch(), gpu)
    assert why == "" and len(findings) == 1 and findings[0].startswith("rank 1 used 3%")
