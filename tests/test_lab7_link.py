"""Lab 7's slow link (``lab_utils.slow_link``) and the checks of notebook 1.

The link is tried for real where it can be made (root, or a user namespace): a job
inside it is shaped (a transfer takes at least what the token bucket allows, and the
same bytes unshaped, same job, take less), sees only its own loopback, leaves the
host's untouched, and leaves nothing behind when it is killed. No test here starts
torch: the jobs are small Python programs over TCP and UDP sockets.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import REPO

import lab7_checks as checks
import lab7_solutions as solutions
from lab_utils import slow_link
from lab_utils.checks import CheckFailed

SUPPORT = slow_link.available()
needs_link = pytest.mark.skipif(not SUPPORT, reason=f"no slow link here: {SUPPORT.reason}")
RATE_MBIT, BURST, MTU = 16, 64 * 1024, 16000  # 2 MB/s: 1 MB takes about half a second

# The job: stdlib only (no torch), run inside the link. It reports JSON lines.
PROBE = textwrap.dedent(
    """
    import errno, json, socket, subprocess, sys, threading, time
    from lab_utils import slow_link

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def tcp(n):
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
        out = {}
        def serve():
            c, _ = srv.accept(); got = 0
            while got < n:
                got += len(c.recv(1 << 20))
            c.sendall(b"k"); c.close()
        th = threading.Thread(target=serve); th.start()
        s = socket.create_connection(srv.getsockname())
        before = slow_link.counters()["bytes"]; t = time.perf_counter()
        s.sendall(b"x" * n); s.recv(1)
        dt = time.perf_counter() - t
        th.join(); s.close(); srv.close()
        time.sleep(0.05)  # the last acknowledgements
        return dt, slow_link.counters()["bytes"] - before

    # [1] one UDP datagram of 1000 bytes: the qdisc counts it with its headers
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("127.0.0.1", 0))
    w = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c0 = slow_link.counters()
    w.sendto(b"u" * 1000, r.getsockname()); r.recv(2000)
    c1 = slow_link.counters()
    say(udp_bytes=c1["bytes"] - c0["bytes"], udp_packets=c1["packets"] - c0["packets"])
    # [2] what the namespace can reach: its loopback only
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    try:
        socket.create_connection(("192.0.2.1", 9), timeout=2)  # TEST-NET-1 (RFC 5737)
        reach = "connected"
    except OSError as exc:
        reach = errno.errorcode.get(exc.errno, str(exc))
    say(links=[l.split(":")[1].strip() for l in links.splitlines()], outside=reach)
    # [3] shaped, then (the host is looked at meanwhile) the same bytes unshaped
    n = int(sys.argv[1])
    t, b = tcp(n)
    say(shaped_s=t, shaped_bytes=b, link=slow_link.current().spec())
    sys.stdin.readline()
    slow_link.set_rate(None)
    t, b = tcp(n)
    say(unshaped_s=t, unshaped_bytes=b, link=slow_link.current().spec())
    """
)


def host_qdisc() -> str:
    return subprocess.run(
        ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One job inside a 16 Mbit/s link; what it reported, and the host's loopback qdisc
    before, during and after it."""
    if not SUPPORT:
        pytest.skip(f"no slow link here: {SUPPORT.reason}")
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE)
    link = slow_link.Link(RATE_MBIT, BURST, mtu=MTU)
    before = host_qdisc()
    proc = subprocess.Popen(
        slow_link.wrap([sys.executable, str(script), str(1_000_000)], link),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = []
    try:
        for _ in range(3):
            lines.append(json.loads(proc.stdout.readline()))
        during = host_qdisc()  # the job is inside its shaped link now
        proc.stdin.write("\n")
        proc.stdin.flush()
        lines.append(json.loads(proc.stdout.readline()))
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = {k: v for line in lines for k, v in line.items()}
    return out, before, during, host_qdisc()


@needs_link
def test_the_link_shapes_what_crosses_it(probed):
    """The token bucket's bound: L bytes through a bucket of B at rate R take at least
    (L − B)/R (less 4 packets: the acknowledgements counted after the transfer); the
    same bytes, same job, with the qdisc replaced by an unshaping FIFO, take less than
    that bound. Seen failing: with a wrapper that left out the tc line (the bound missed
    by a factor of 100)."""
    out, *_ = probed
    rate = RATE_MBIT * 1e6 / 8
    bound = (out["shaped_bytes"] - BURST - 4 * (MTU + 14)) / rate
    assert out["shaped_bytes"] >= 1_000_000  # every byte crossed the link, headers on top
    assert bound > 0.3  # sized so that the bound means something
    assert out["shaped_s"] >= bound, (out, bound)
    assert out["unshaped_s"] < bound, (out, bound)
    assert slow_link.parse(out["link"]).rate_mbit is None  # set_rate(None) changed it


@needs_link
def test_the_qdisc_counts_each_packet_with_its_headers(probed):
    """A count: one UDP datagram of 1000 bytes is one packet of 1000 + 8 (UDP) + 20 (IPv4)
    + 14 (the Ethernet header lo's packets carry) bytes at the qdisc — the bytes the rate
    is charged on. Seen failing with the Ethernet header left out (1028)."""
    out, *_ = probed
    assert (out["udp_packets"], out["udp_bytes"]) == (1, 1000 + 8 + 20 + 14)


@needs_link
def test_only_the_jobs_own_loopback_exists_and_the_hosts_is_untouched(probed):
    """Inside: the loopback alone, nothing outside reachable. Outside: the host's
    loopback qdisc the same before, during and after the job. Seen failing with the
    wrapper's ``--net`` removed (the host's interfaces inside, and its lo shaped)."""
    out, before, during, after = probed
    assert out["links"] == ["lo"]
    assert out["outside"] == "ENETUNREACH"
    assert before == during == after
    assert "tbf" not in during


def _namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _holders(netns: str) -> list[int]:
    """Processes still in the network namespace ``netns``."""
    return [p for p in psutil.pids() if _namespace_of(p) == netns]


def _wait_until(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# A job with a tree of processes inside the link: a shell, two sleeping children.
TREE = ["sh", "-c", "sleep 301 & sleep 302 & wait"]


def _inner_sleeps(root: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    return [k for k in kids if k.name() == "sleep"]


@needs_link
@pytest.mark.parametrize("killed", ["its starter", "unshare"])
def test_a_killed_job_leaves_no_process_namespace_or_qdisc(killed):
    """SIGKILL — no clean-up code runs — to the process that started the wrapper (a
    crashed notebook kernel) or to ``unshare`` itself: within seconds no process of the
    job is left, nothing holds its network namespace (so the kernel has freed it with
    its qdisc), and the host's loopback is as before. Seen failing without
    ``--pdeathsig KILL`` (starter killed: the job lived on) and without ``--pid`` (the
    children outlived their shell)."""
    before = host_qdisc()
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)",
            *slow_link.wrap(TREE, slow_link.Link(RATE_MBIT)),
        ]
    )
    try:
        assert _wait_until(lambda: len(_inner_sleeps(starter.pid)) == 2)
        sleeps = _inner_sleeps(starter.pid)
        netns = _namespace_of(sleeps[0].pid)
        assert netns and netns != _namespace_of(os.getpid())
        unshare = next(
            p for p in psutil.Process(starter.pid).children(recursive=True) if p.name() == "unshare"
        )
        victim = starter.pid if killed == "its starter" else unshare.pid
        os.kill(victim, signal.SIGKILL)
        assert _wait_until(
            lambda: not any(s.is_running() and s.status() != "zombie" for s in sleeps)
        )
        assert _wait_until(lambda: not _holders(netns)), _holders(netns)
        assert host_qdisc() == before
    finally:
        if starter.poll() is None:
            starter.kill()
        starter.wait()


@needs_link
def test_a_notebooks_job_that_times_out_leaves_nothing(tmp_path, capsys):
    """The notebook's path, ``slow_link.run``: the supervisor outside the namespaces ends
    the job at its timeout; nothing of it, nor its namespace, is left."""
    script = tmp_path / "tree.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "subprocess.Popen(['sleep', '303'])\n"
        "print(os.readlink('/proc/self/ns/net'), flush=True)\n"
        "time.sleep(600)\n"
    )
    before = host_qdisc()
    result = slow_link.run(
        script, link=slow_link.Link(RATE_MBIT), nprocs=1, launcher="python", timeout=3
    )
    assert result.timed_out
    assert "setpriv --pdeathsig KILL unshare" in capsys.readouterr().out  # the command shown
    netns = next(t for _, t in result.lines if t.startswith("net:["))
    assert netns != _namespace_of(os.getpid())
    assert _wait_until(lambda: not _holders(netns)), _holders(netns)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "303" in (p.info["cmdline"] or [])]
    assert host_qdisc() == before


GUARD_PROBE = textwrap.dedent(
    """
    import json, subprocess
    from lab_utils import slow_link
    cmd = [a for a in slow_link.wrap(["true"], slow_link.Link(1)) if a != "--net"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    mtu = open("/sys/class/net/lo/mtu").read().strip()
    print(json.dumps({"status": done.returncode, "stderr": done.stderr, "qdisc": qdisc.stdout,
                      "mtu": mtu}))
    """
)


@needs_link
def test_a_wrapper_without_a_namespace_of_its_own_refuses_to_touch_the_loopback():
    """A wrapper that lost ``--net`` would run the setup in the caller's namespace and
    shape its loopback: the setup refuses instead. Tried inside a throwaway namespace
    (the "host" here), so that even a broken guard shapes nothing real."""
    outer = [*slow_link._namespace_flags(SUPPORT.user_namespace), sys.executable, "-c", GUARD_PROBE]
    done = subprocess.run(
        ["unshare", *outer],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["status"] == slow_link.REFUSED and "refused" in out["stderr"]
    assert "tbf" not in out["qdisc"] and out["mtu"] != "16000"


def test_set_rate_refuses_outside_a_link(monkeypatch):
    """The host's loopback is never changed: outside a namespace the wrapper made (even
    with its variables copied into the environment) ``set_rate`` refuses."""
    monkeypatch.setenv(slow_link.ENV_VAR, slow_link.Link(10).spec())
    monkeypatch.setenv(slow_link.NETNS_VAR, "net:[1]")
    assert slow_link.current() is None and slow_link.counters() is None
    with pytest.raises(RuntimeError, match="not inside one"):
        slow_link.set_rate(5)


def test_a_link_needs_its_mtu_below_the_burst():
    with pytest.raises(ValueError, match="below the burst"):
        slow_link.Link(10, burst_bytes=4096, mtu=16000)
    link = slow_link.Link(12.5, burst_bytes=32768, latency_ms=250, mtu=9000)
    assert slow_link.parse(link.spec()) == link
    assert link.qdisc() == ["tbf", "rate", "12.5mbit", "burst", "32768", "latency", "250ms"]


def test_available_says_why_not(monkeypatch):
    """Each missing piece gives its own reason (the cached answer is bypassed)."""
    check = slow_link.available.__wrapped__
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda t: None if t == "tc" else real_which(t) or t)
    assert "`tc` (iproute2)" in check().reason and not check()
    monkeypatch.setattr(shutil, "which", lambda t: f"/usr/bin/{t}")

    def probe_says(stderr: str):
        monkeypatch.setattr(
            slow_link, "_probe", lambda _: subprocess.CompletedProcess([], 1, "", stderr)
        )
        return check()

    denied = probe_says("unshare: unshare failed: Operation not permitted\n")
    assert not denied and "no permission" in denied.reason
    assert "user namespaces" in denied.reason
    no_tbf = probe_says("Error: Specified qdisc kind is unknown.\n")
    assert not no_tbf and "tbf" in no_tbf.reason
    monkeypatch.setattr(slow_link, "_probe", lambda _: subprocess.CompletedProcess([], 0, "", ""))
    assert check()
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "Linux" in check().reason


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists(),
    reason="needs root to become another user, and a system python3",
)
def test_a_normal_user_gets_a_user_namespace():
    """As ``nobody``: the link is made inside a user namespace where the system allows
    one (it does here), else the reason says so."""
    code = (
        "from lab_utils import slow_link as s; a = s.available(); "
        "print(a.ok, a.user_namespace, a.reason)"
    )
    out = subprocess.run(
        ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
        + ["/usr/bin/python3", "-c", code],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    ok, user_ns, *reason = out.stdout.split(" ", 2)
    assert user_ns == "True"
    assert ok == "True" or "no permission" in " ".join(reason)


# ------------------------------------------------------------------ notebook 1's checks
X = np.geomspace(2e5, 2e6, 6)
T = 4e-4 + X / 6.25e6 + np.array([1, -2, 1.5, -1, 0.5, 0]) * 1e-4


def test_the_fit_check_passes_the_reference():
    alpha, beta = checks.check_fit_alpha_beta(solutions.fit_alpha_beta, X, T)
    assert (alpha, beta) == solutions.fit_alpha_beta(X, T)
    slope, intercept = np.polyfit(X, T, 1)
    assert np.isclose(beta, slope, rtol=1e-9) and np.isclose(alpha, intercept, rtol=1e-6)


WRONG_FITS = {
    "swapped": (lambda x, t: tuple(np.polyfit(x, t, 1))[:2], "returns the slope first"),
    "through the origin": (lambda x, t: (0.0, float(x @ t / (x @ x))), "through the origin"),
    "mean ratio": (lambda x, t: (0.0, float(np.mean(np.divide(t, x)))), "mean of t / bytes"),
    "weighted (Lab 6.5's)": (
        lambda x, t: tuple(np.polyfit(x, t, 1, w=1 / np.asarray(t)))[::-1],
        "weighted by 1/t",
    ),
    "the rate": (
        lambda x, t: (solutions.fit_alpha_beta(x, t)[0], 1 / solutions.fit_alpha_beta(x, t)[1]),
        "inverse",
    ),
    "per bit": (
        lambda x, t: (solutions.fit_alpha_beta(x, t)[0], solutions.fit_alpha_beta(x, t)[1] / 8),
        "not per bit",
    ),
    "endpoints only": (
        lambda x, t: (
            float(t[0] - (t[-1] - t[0]) / (x[-1] - x[0]) * x[0]),
            float((t[-1] - t[0]) / (x[-1] - x[0])),
        ),
        "ordinary least squares",
    ),
}


@pytest.mark.parametrize("mistake", WRONG_FITS)
def test_the_fit_check_names_the_mistake(mistake):
    wrong, hint = WRONG_FITS[mistake]
    with pytest.raises(CheckFailed, match=hint):
        checks.check_fit_alpha_beta(wrong, X, T)


def _sweep(sizes, link_bytes, seconds):
    return {"sizes": sizes, "link_bytes": link_bytes, "seconds": seconds}


def test_the_byte_check_fails_when_the_ranks_talk_past_the_link():
    """2 ranks, 1 MB: at least 2 MB plus headers. Seen failing on half of it (one rank's
    traffic) and on nothing at all."""
    mb = 1 << 20
    checks.check_every_byte_crossed(_sweep([mb], [2.011 * mb], None), 2, MTU)
    for wrong in (1.01 * mb, 0.0):
        with pytest.raises(CheckFailed, match="counted"):
            checks.check_every_byte_crossed(_sweep([mb], [wrong], None), 2, MTU)
    assert checks.min_link_bytes(mb, 2, MTU) > 2 * mb
    assert checks.min_link_bytes(mb, 1, MTU) == 0


def test_the_slow_link_check_fails_on_a_time_the_bucket_forbids():
    """At 50 Mbit/s 1 MB on the link takes at least (1 MB − burst)/rate ≈ 149.5 ms, less
    one packet's allowance (2.6 ms): a run that took 100 ms was not on that link; an
    unshaped loopback as slow as the link shows nothing about the link. Each repetition
    is held to its own bytes: the mean must not let a repetition that carried more off."""
    rate = 50e6 / 8
    L = 1_000_000
    exact = (L - BURST) / rate
    allowed = exact - (MTU + 14) / rate
    shaped = _sweep([L // 2], [L], [[exact * 1.001] * 3])
    fast = _sweep([L // 2], [L], [[0.002, 0.003, 0.002]])
    kw = {"rate_mbit": 50, "burst_bytes": BURST, "mtu": MTU}
    checks.check_link_is_slow(shaped, fast, **kw)
    checks.check_link_is_slow(_sweep([L // 2], [L], [[allowed * 1.001] * 3]), fast, **kw)
    with pytest.raises(CheckFailed, match="beat the token bucket"):
        checks.check_link_is_slow(_sweep([L // 2], [L], [[exact, 0.1, exact]]), fast, **kw)
    with pytest.raises(CheckFailed, match="beat the token bucket"):
        checks.check_link_is_slow(_sweep([L // 2], [L], [[allowed * 0.999] * 3]), fast, **kw)
    # the mean L is 1 MB, but the second repetition carried 1.1 MB in the time 1 MB needs
    paired = {**shaped, "link_bytes_each": [[0.9 * L, 1.1 * L, L]]}
    with pytest.raises(CheckFailed, match="L = 1,100,000 B"):
        checks.check_link_is_slow(paired, fast, **kw)
    with pytest.raises(CheckFailed, match="unshaped loopback"):
        checks.check_link_is_slow(shaped, _sweep([L // 2], [L], [[exact] * 3]), **kw)


def test_the_step_check_fails_on_a_step_faster_than_its_bytes():
    ddp = {
        "link_bytes": {"naive": 1_000_000, "DDP": 1_000_000},
        "variants": {"naive": [0.16, 0.17], "DDP": [0.15, 0.16], "no communication": [0.01]},
    }
    kw = {"rate_mbit": 50, "burst_bytes": BURST, "mtu": MTU}
    assert 0.149 < checks.check_steps_bound(ddp, **kw) < 0.150  # (1 MB − 64 KiB)/rate
    ddp["variants"]["DDP"] = [0.15, 0.1]  # faster than 1 MB can cross at 50 Mbit/s
    with pytest.raises(CheckFailed, match="DDP: fastest 100.0 ms <"):
        checks.check_steps_bound(ddp, **kw)
    # with each step's own bytes and span: the second DDP step carried 1.1 MB in 0.16 s
    ddp["variants"]["DDP"] = [0.15, 0.16]
    ddp["link_bytes_each"] = {"naive": [1_000_000] * 2, "DDP": [900_000, 1_100_000]}
    ddp["spans"] = {"naive": [0.16, 0.17], "DDP": [0.15, 0.16]}
    with pytest.raises(CheckFailed, match="DDP: fastest 160.0 ms <"):
        checks.check_steps_bound(ddp, **kw)
    ddp["spans"]["DDP"] = [0.15, 0.17]
    checks.check_steps_bound(ddp, **kw)
