"""A slow network made by the kernel: a job's processes on a rate-limited private loopback.

:func:`wrap` puts a command (a launcher: ``torchrun ...``, ``mpirun ...``, ``python ...``)
into network, PID and mount namespaces of its own, whose loopback the kernel's
token-bucket filter (TBF) rate-limits::

    setpriv --pdeathsig KILL unshare --net --pid --kill-child --mount-proc sh -c '
        ip link set lo up && ip link set lo mtu 16000 &&
        tc qdisc add dev lo root tbf rate 50mbit burst 65536 latency 1000ms && ... "$@"' \\
        slow-link torchrun --standalone --nproc-per-node 2 script.py

(a normal user gets ``unshare --user --map-root-user`` as well, where the system allows
user namespaces). Every rank of the job meets the others on that loopback, so everything
they send crosses the shaped link, and nothing can leave it: the namespace has no other
interface. The host's own loopback is never touched.

Nothing is left behind, by construction rather than by clean-up code: the namespace and
its qdisc exist only while a process is inside. The first process inside is PID 1 of
its PID namespace; when it ends the kernel kills every other process in the namespace.
``unshare --kill-child`` kills that PID 1 when ``unshare`` dies, and ``setpriv
--pdeathsig KILL`` kills ``unshare`` when whoever started it dies (a crashed notebook
kernel, a killed supervisor, Ctrl-C). The last process gone, the kernel frees the
namespace, its loopback and the qdisc.

The TBF (``man tc-tbf``): a bucket of ``burst`` bytes fills at ``rate``; a packet leaves
when the bucket holds its length in tokens, so in any time t at most burst + rate·t bytes
pass. A packet larger than the burst could never leave and is dropped (Linux's
``tbf_enqueue`` in net/sched/sch_tbf.c first splits a GSO packet into segments), hence
the loopback's MTU is set below the burst. Packets that would wait longer than
``latency`` are dropped; a large latency keeps TCP from losing any. Inside the job, :func:`counters` reads the bytes the qdisc let through (``tc -s``),
the same bytes the rate is charged on (with their Ethernet, IP and TCP headers).

From a notebook, :func:`run` starts a lab script as :func:`lab_utils.launch.run` does,
inside a link. From a terminal::

    python -m lab_utils.slow_link --check
    python -m lab_utils.slow_link --rate-mbit 50 -- torchrun --standalone --nproc-per-node 2 s.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ENV_VAR = "LABS_SLOW_LINK"  # the link's settings, set inside the namespace for the job
NETNS_VAR = "LABS_SLOW_LINK_NETNS"  # the namespace the wrapper made (``net:[inode]``)
TOOLS = ("setpriv", "unshare", "ip", "tc")  # util-linux and iproute2

# Every collective of the job goes over the shaped loopback: Gloo's and NCCL's sockets
# on lo, and NCCL without its faster paths (GPU peer-to-peer, shared memory, InfiniBand),
# which would bypass the network altogether.
JOB_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
}


@dataclass(frozen=True)
class Link:
    """A loopback link: ``rate_mbit`` megabits per second (tc's ``mbit``: 10⁶ bits),
    ``None`` for an unshaped one (a plain FIFO that only counts the bytes); a bucket of
    ``burst_bytes``; packets dropped after waiting ``latency_ms``; the loopback's ``mtu``
    (below the burst, so that every packet fits in the bucket)."""

    rate_mbit: float | None
    burst_bytes: int = 64 * 1024
    latency_ms: float = 1000.0
    mtu: int = 16000

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(
                f"rate_mbit must be positive (or None: unshaped), not {self.rate_mbit}"
            )
        if self.mtu + 14 > self.burst_bytes:  # 14: the Ethernet header lo's packets carry
            raise ValueError(
                f"mtu {self.mtu} + 14 header bytes exceeds burst {self.burst_bytes}: a full "
                "packet could never leave the bucket; set the MTU below the burst"
            )
        if not 68 <= self.mtu <= 65536:
            raise ValueError(f"mtu {self.mtu} is outside what lo accepts (68 … 65536)")

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The rate in bytes per second (``None``: unshaped)."""
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

    @property
    def label(self) -> str:
        if self.rate_mbit is None:
            return "unshaped (the job's own loopback, no rate limit)"
        return f"{self.rate_mbit:g} Mbit/s"

    def qdisc(self) -> list[str]:
        """``tc`` arguments after ``qdisc add|replace dev lo root``."""
        if self.rate_mbit is None:
            return ["pfifo"]  # no shaping; the qdisc still counts what passes
        return [
            "tbf",
            "rate",
            f"{self.rate_mbit:g}mbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms:g}ms",
        ]

    def spec(self) -> str:
        """The settings as one word (``ENV_VAR``'s value), read back by :func:`parse`."""
        rate = "none" if self.rate_mbit is None else f"{self.rate_mbit:g}"
        return f"rate_mbit={rate},burst_bytes={self.burst_bytes},latency_ms={self.latency_ms:g},mtu={self.mtu}"


def parse(spec: str) -> Link:
    """The :class:`Link` of :meth:`Link.spec`."""
    fields = dict(item.split("=", 1) for item in spec.split(","))
    rate = fields["rate_mbit"]
    return Link(
        rate_mbit=None if rate == "none" else float(rate),
        burst_bytes=int(fields["burst_bytes"]),
        latency_ms=float(fields["latency_ms"]),
        mtu=int(fields["mtu"]),
    )


@dataclass(frozen=True)
class Support:
    """Whether jobs can run on a slow link here (true in a boolean context), and if not,
    ``reason``; ``user_namespace``: a user namespace is needed (not root)."""

    ok: bool
    reason: str = ""
    user_namespace: bool = False

    def __bool__(self) -> bool:
        return self.ok


def _namespace_flags(user_namespace: bool) -> list[str]:
    user = ["--user", "--map-root-user"] if user_namespace else []
    return [*user, "--net", "--pid", "--kill-child", "--mount-proc"]


def diagnose(stderr: str) -> str:
    """Why a probe inside a namespace failed, from what it printed, in words."""
    low = stderr.lower()
    if "qdisc kind is unknown" in low or ("tbf" in low and "unknown" in low):
        return "this kernel has no token-bucket filter (the tbf qdisc, module sch_tbf)"
    if "operation not permitted" in low or "permission denied" in low:
        return (
            "no permission to create network namespaces: run as root, or as a user where "
            "the system allows unprivileged user namespaces (sysctl user.max_user_namespaces "
            "> 0, and kernel.unprivileged_userns_clone = 1 or AppArmor's "
            "kernel.apparmor_restrict_unprivileged_userns = 0 where those exist)"
        )
    return "a namespace with a shaped loopback could not be made: " + (
        stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    )


def _probe(user_namespace: bool) -> subprocess.CompletedProcess:
    setup = "ip link set lo up && tc qdisc add dev lo root tbf rate 1mbit burst 4096 latency 10ms"
    return subprocess.run(
        ["setpriv", "--pdeathsig", "KILL", "unshare", *_namespace_flags(user_namespace)]
        + ["sh", "-c", setup],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


@functools.lru_cache(maxsize=1)
def available() -> Support:
    """Whether a job can run on a shaped private loopback here, tried once (a probe
    makes one and sets a TBF on it, ~0.1 s): the tools (util-linux's ``setpriv`` and
    ``unshare``, iproute2's ``ip`` and ``tc``), the permission (root, else a user
    namespace) and the kernel's ``tbf`` qdisc. False with ``reason`` otherwise."""
    if not sys.platform.startswith("linux"):
        return Support(False, f"network namespaces are Linux's; this is {sys.platform}")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pkgs = {
            "setpriv": "util-linux",
            "unshare": "util-linux",
            "ip": "iproute2",
            "tc": "iproute2",
        }
        return Support(
            False,
            "missing " + ", ".join(f"`{t}` ({pkgs[t]})" for t in missing) + " on PATH",
        )
    user_ns = os.geteuid() != 0
    try:
        probe = _probe(user_ns)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Support(False, f"the probe could not run: {exc}", user_ns)
    if probe.returncode == 0:
        return Support(True, "", user_ns)
    return Support(False, diagnose(probe.stderr), user_ns)


REFUSED = 97  # the setup's exit status when it is not in a namespace of its own


def setup_script(link: Link, outer_netns: str) -> str:
    """The shell line run first inside the new namespaces: the loopback up, its MTU, the
    qdisc, the job's environment; then the job itself (``"$@"``), not ``exec``'d, so
    that the shell stays PID 1 and the job's exit ends it. It first refuses (status
    :data:`REFUSED`) unless its network namespace differs from ``outer_netns``, the one
    the wrapper was made in: a wrapper that did not get a namespace of its own (a flag
    lost, an ``unshare`` that ignored it) must never reshape the host's loopback."""
    exports = " ".join(f"{k}={v}" for k, v in JOB_ENV.items())
    return (
        f'if [ "$(readlink /proc/self/ns/net)" = "{outer_netns}" ]; then '
        "echo 'slow-link: refused: not in a network namespace of its own (this loopback "
        f"is the host one)' >&2; exit {REFUSED}; fi; "
        f"ip link set lo up && ip link set lo mtu {link.mtu} && "
        f"tc qdisc add dev lo root {' '.join(link.qdisc())} && "
        f"export {exports} {ENV_VAR}={link.spec()} "
        f'{NETNS_VAR}="$(readlink /proc/self/ns/net)" && "$@"'
    )


def prefix(link: Link, support: Support | None = None) -> list[str]:
    """What goes before a command to run it on ``link`` (:func:`wrap` is ``prefix + cmd``).

    Raises ``RuntimeError`` with the reason when :func:`available` says it cannot work."""
    support = available() if support is None else support
    if not support:
        raise RuntimeError(f"no slow link here: {support.reason}")
    return [
        "setpriv",
        "--pdeathsig",
        "KILL",  # [3] whoever started us dies: unshare dies too
        "unshare",
        *_namespace_flags(support.user_namespace),  # [1] own network, PIDs, /proc
        "sh",
        "-c",
        setup_script(link, _netns()),  # [2] lo up, MTU, qdisc; then the job as PID 1's child
        "slow-link",  # $0 of that shell
    ]


def wrap(cmd: Sequence[str], link: Link, support: Support | None = None) -> list[str]:
    """``cmd`` run in a private network namespace whose loopback is ``link``."""
    return [*prefix(link, support), *map(str, cmd)]


# ----------------------------------------------------------------- inside the job


def current() -> Link | None:
    """The link this process runs on, when it runs inside a namespace :func:`wrap` made
    (its settings, possibly changed since by :func:`set_rate`); ``None`` elsewhere."""
    spec, made = os.environ.get(ENV_VAR), os.environ.get(NETNS_VAR)
    if not spec or not made or _netns() != made:
        return None
    return parse(spec)


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _tc(*args: str) -> str:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def counters() -> dict[str, Any] | None:
    """What the job's loopback qdisc has let through so far: ``bytes`` (each packet
    with its Ethernet, IP and TCP headers, as the rate charges them), ``packets``,
    ``drops`` and the qdisc ``kind``; ``None`` outside a namespace :func:`wrap` made
    (the host's loopback carries everybody's traffic)."""
    if current() is None:
        return None
    root = [q for q in json.loads(_tc("-s", "-j", "qdisc", "show", "dev", "lo")) if q.get("root")]
    q = root[0]
    return {
        "bytes": int(q["bytes"]),
        "packets": int(q["packets"]),
        "drops": int(q.get("drops", 0)),
        "kind": q["kind"],
    }


def set_rate(rate_mbit: float | None) -> Link:
    """Change the job's own link to ``rate_mbit`` (``None``: unshaped), keeping its
    burst, latency and MTU; returns the new link. Only inside a namespace :func:`wrap`
    made (else ``RuntimeError``: never the host's loopback). Call it on one rank
    between two barriers, when nothing is in flight: replacing a qdisc drops what it
    still queues."""
    link = current()
    if link is None:
        raise RuntimeError(
            "set_rate changes only a link made by lab_utils.slow_link: this process is not "
            "inside one (run the job under slow_link.wrap / python -m lab_utils.slow_link)"
        )
    new = Link(rate_mbit, link.burst_bytes, link.latency_ms, link.mtu)
    verb = "change" if link.rate_mbit is not None and rate_mbit is not None else "replace"
    _tc("qdisc", verb, "dev", "lo", "root", *new.qdisc())
    os.environ[ENV_VAR] = new.spec()
    return new


# ----------------------------------------------------------------- from a notebook


def run(script: str | os.PathLike, args: Sequence[str] = (), *, link: Link | None, **options: Any):
    """:func:`lab_utils.launch.run` (its ``options``: nprocs, launcher, timeout, env, cwd,
    echo, …) with the job inside ``link`` (``None``: on the host's shared loopback,
    unshaped, as ``launch.run`` would start it).

    It prints the whole command it starts and returns the same ``LaunchResult``. The
    wrapper goes between the supervisor (:mod:`lab_utils.reaper`, outside the
    namespaces) and the launcher, so a timeout or an interrupted cell ends the tree as
    usual, and whatever happens the namespace goes with its last process."""
    from . import launch

    return launch.run(script, args, wrapper=prefix(link) if link is not None else (), **options)


def host_loopback_qdisc() -> str:
    """The host's ``tc qdisc show dev lo`` (what a job's link must never change)."""
    return _tc("qdisc", "show", "dev", "lo")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m lab_utils.slow_link",
        description="Run CMD with its processes on a rate-limited private loopback.",
        usage="%(prog)s [--check] [--rate-mbit R ...] -- CMD [ARGS ...]",
    )
    p.add_argument("--check", action="store_true", help="say whether it works here, and exit")
    p.add_argument("--rate-mbit", type=float, default=None, help="rate (default: unshaped)")
    p.add_argument("--burst-bytes", type=int, default=Link.burst_bytes)
    p.add_argument("--latency-ms", type=float, default=Link.latency_ms)
    p.add_argument("--mtu", type=int, default=Link.mtu)
    p.add_argument("--print", action="store_true", help="print the command, do not run it")
    a = p.parse_args(argv)
    support = available()
    if a.check:
        print("slow link: " + ("available" if support else f"not available: {support.reason}"))
        return 0 if support else 1
    if not cmd:
        p.error("give the command after --")
    if not support:
        print(f"slow link: not available: {support.reason}", file=sys.stderr)
        return 1
    full = wrap(cmd, Link(a.rate_mbit, a.burst_bytes, a.latency_ms, a.mtu), support)
    if a.print:
        print(shlex.join(full))
        return 0
    os.execvp(full[0], full)  # the wrapper replaces us: our parent is setpriv's parent
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
