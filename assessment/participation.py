"""Whether every rank of a job took part: evidence the kernel keeps, not the job.

A rank that trains alone while the others sleep, spin or exit looks like a
data-parallel job from the CPU time alone (a busy loop burns CPU). What a busy loop
cannot make is the exchange of gradients, so the grader reads, from outside and
while the job runs:

- **each rank's TCP bytes with the other ranks**: for every TCP socket a rank's
  processes hold, the kernel's own count of the bytes that connection received
  (``tcp_info.bytes_received``), read through a copy of the socket taken with
  ``pidfd_getfd`` (Linux 5.6+, root or the job's owner). Only connections whose
  other end is held by another rank count, so a rank talking to itself or to the
  launcher adds nothing; what one end received, the rank at the other end sent. Gloo (DDP, Horovod
  under horovodrun) and OpenMPI's TCP transport carry every all-reduce this way.
- **the bytes of the job's network namespace** (its ``lo`` in ``/proc/<pid>/net/dev``
  of any process inside it): the total the ranks moved, shown beside the per-rank
  counts and used alone when those cannot be read.
- **on GPUs, each rank's GPU utilisation samples** from NVML (``pynvml``), since
  NCCL moves gradients between GPUs of one machine over NVLink or shared memory,
  where no socket counts them.

The minimum: a data-parallel step all-reduces every gradient, which in a ring
makes each rank send and receive ``2 (N - 1) / N >= 1`` times the gradient bytes
(N >= 2). Counting the gradients in 16 bits (the smallest an honest job sends, with
compression), each rank must have sent and received at least
:data:`MIN_EXCHANGES` copies of ``2 x parameters`` bytes: four all-reduces, where a
run of an epoch makes hundreds. A rank that never joined, left at once, slept or
spun moves none of it; a rank that received the initial broadcast and then spun has
received one copy and sent none.

The counters are read every half second while the job runs (``sandbox._CpuWatch``), and
a connection's count goes with it when it closes: what a job exchanges after the last
reading before it closes is not seen. A run of the course's targets exchanges for a
minute; a job whose every all-reduce falls within half a second (a test fixture of a
few steps) must keep its connections open a moment after them to be judged.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

MIN_EXCHANGES = 4  # copies of the model's 16-bit gradients every rank must send and receive
BYTES_PER_PARAM = 2  # a 16-bit gradient: the least an honest all-reduce sends per parameter
IDLE_GPU = 0.25  # a rank with less than this share of the busiest rank's GPU use did not train
MODES = ("require", "warn")
_PIDFD_GETFD = 438  # the syscall number, the same on every architecture Linux added it to
_TCP_INFO_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux 4.1+)


class Unavailable(OSError):
    """The kernel does not let the grader read a socket of the job (the message says why)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def socket_bytes(
    pid: int, fd: int, libc: ctypes.CDLL | None = None
) -> tuple[tuple[str, int], tuple[str, int], int] | None:
    """``(local address, peer address, bytes received)`` of the connected TCP socket
    ``fd`` of process ``pid``; ``None`` for anything else."""
    if not hasattr(os, "pidfd_open"):  # not Linux
        raise Unavailable(38, "no pidfd_open on this system")
    libc = libc or _libc()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        mine = libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            err = ctypes.get_errno()
            if err in (1, 13, 38):  # EPERM, EACCES, ENOSYS: never readable here
                raise Unavailable(err, f"pidfd_getfd: {os.strerror(err)}")
            return None  # the socket was closed meanwhile
    finally:
        os.close(pidfd)
    sock = socket.socket(fileno=mine)
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        try:
            peer = sock.getpeername()[:2]
        except OSError:  # a listening socket
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCP_INFO_RECEIVED + 8:
            raise Unavailable(0, "this kernel's tcp_info has no byte counts")
        return sock.getsockname()[:2], peer, struct.unpack_from("Q", info, _TCP_INFO_RECEIVED)[0]
    finally:
        sock.close()  # closes the grader's copy only


def socket_fds(pid: int) -> list[int]:
    """The descriptors of process ``pid`` that are sockets."""
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    out.append(int(name))
    return out


def namespace_lo_bytes(pid: int) -> int | None:
    """Bytes sent on ``lo`` in the network namespace of ``pid``, or ``None`` where that
    namespace is the grader's own (no private namespace: the count would be the machine's)."""
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
            return None
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, counts = line.partition(":")
                if name.strip() == "lo":
                    return int(counts.split()[8])  # transmit bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class _Conn:
    rank: int
    local: tuple[str, int]
    peer: tuple[str, int]
    received: int = 0


@dataclass
class SocketWatch:
    """Samples, while a job runs, each rank's TCP connections and the namespace's bytes.

    Counters only grow while a connection lives, and a connection's counters vanish
    with it, so each one keeps the largest value seen: the last sample before the job
    closed it (bytes moved in the last sampling interval may be missed).
    """

    conns: dict[tuple[int, int, int], _Conn] = field(default_factory=dict)  # (pid, fd, inode)
    lo_bytes: int | None = None
    unavailable: str = ""  # why the per-rank counts could not be read
    _libc: ctypes.CDLL | None = None

    def sample(self, procs: Iterable[tuple[psutil.Process, int | None]]) -> None:
        """Read the sockets of every process that belongs to a rank (``rank`` not None)."""
        libc = self._libc = self._libc or _libc()
        for p, rank in procs:
            lo = namespace_lo_bytes(p.pid)
            if lo is not None:
                self.lo_bytes = max(self.lo_bytes or 0, lo)
            if rank is None or self.unavailable:
                continue
            for fd in socket_fds(p.pid):
                try:
                    inode = os.stat(f"/proc/{p.pid}/fd/{fd}").st_ino
                    got = socket_bytes(p.pid, fd, libc)
                except Unavailable as e:
                    self.unavailable = str(e.strerror or e)
                    break
                except OSError:
                    continue
                if got is None:
                    continue
                local, peer, received = got
                conn = self.conns.setdefault((p.pid, fd, inode), _Conn(rank, local, peer))
                conn.received = max(conn.received, received)

    def per_rank(self, nprocs: int) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes each rank sent to and received from the other ranks: each connection
        between two ranks counts, at its receiving end, what the other end sent."""
        owner = {c.local: c.rank for c in self.conns.values()}
        sent = dict.fromkeys(range(nprocs), 0)
        received = dict.fromkeys(range(nprocs), 0)
        for c in self.conns.values():
            other = owner.get(c.peer)
            if other is None or other == c.rank or c.rank not in sent or other not in sent:
                continue
            received[c.rank] += c.received
            sent[other] += c.received
        return sent, received


class GpuWatch:
    """Each rank's GPU use from NVML's per-process utilisation samples (``pynvml``).

    Untested on real GPUs in the suite (its machine has none); where ``pynvml`` or a
    driver is missing, :attr:`unavailable` says so and nothing is judged from it.
    """

    def __init__(self) -> None:
        self.use: dict[int, float] = {}  # rank -> sum of SM utilisation (%) over its samples
        self.unavailable = ""
        self._last: dict[int, int] = {}
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except Exception as e:  # ImportError, or NVMLError without a driver
            self._nvml, self._handles = None, []
            self.unavailable = f"no NVML here ({type(e).__name__}: {e})"

    def sample(self, procs: Iterable[tuple[psutil.Process, int | None]]) -> None:
        if self._nvml is None:
            return
        rank_of = {p.pid: r for p, r in procs if r is not None}
        for i, h in enumerate(self._handles):
            try:
                samples = self._nvml.nvmlDeviceGetProcessUtilization(h, self._last.get(i, 0))
            except self._nvml.NVMLError:  # no sample since the last call, or not supported
                continue
            for s in samples:
                self._last[i] = max(self._last.get(i, 0), s.timeStamp)
                if s.pid in rank_of:
                    r = rank_of[s.pid]
                    self.use[r] = self.use.get(r, 0.0) + float(s.smUtil)

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


# --------------------------------------------------------------------------- the judgement
def minimum_bytes(parameters: int) -> int:
    """What every rank of a data-parallel run must send, and receive, at the least."""
    return MIN_EXCHANGES * BYTES_PER_PARAM * parameters


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def idle_ranks_by_bytes(
    sent: dict[int, int], received: dict[int, int], parameters: int
) -> list[str]:
    """The ranks that sent or received less than :func:`minimum_bytes` to and from the
    other ranks, each with its counts (empty when every rank exchanged enough)."""
    need = minimum_bytes(parameters)
    short = [r for r in sorted(sent) if min(sent[r], received[r]) < need]
    if not short:
        return []
    who = (
        "no rank exchanged gradients with another"
        if len(short) == len(sent)
        else f"rank{'s' if len(short) > 1 else ''} {', '.join(map(str, short))} took no part "
        "in the exchange"
    )
    counts = ", ".join(
        f"rank {r} sent {_mb(sent[r])} and received {_mb(received[r])}" for r in short
    )
    return [
        f"{who} ({counts}; each rank of a data-parallel run sends and receives at least "
        f"{_mb(need)}: {MIN_EXCHANGES} all-reduces of {parameters:,} 16-bit gradients)"
    ]


def idle_ranks_by_gpu(use: dict[int, float], nprocs: int) -> list[str]:
    """One line per rank whose GPU use was far below the busiest rank's."""
    most = max(use.values(), default=0.0)
    if most <= 0:
        return []
    return [
        f"rank {r} used {use.get(r, 0.0) / most:.0%} of the GPU time of the busiest rank (NVML)"
        for r in range(nprocs)
        if use.get(r, 0.0) < IDLE_GPU * most
    ]


def judge(
    nprocs: int, parameters: int, watch: SocketWatch, gpu: GpuWatch | None
) -> tuple[list[str], str]:
    """``(findings, unavailable)``: a line per rank that did not take part (empty when
    every rank did), and why the evidence could not be read ("" when it could)."""
    if nprocs < 2:
        return [], ""
    if gpu is not None:
        if gpu.unavailable:
            return [], gpu.unavailable
        return idle_ranks_by_gpu(gpu.use, nprocs), ""
    if not watch.unavailable:
        sent, received = watch.per_rank(nprocs)
        return idle_ranks_by_bytes(sent, received, parameters), ""
    if watch.lo_bytes is None:
        return [], (
            f"per-rank socket counts cannot be read ({watch.unavailable}) and the job "
            "has no network namespace of its own"
        )
    need = nprocs * minimum_bytes(parameters)  # lo counts every byte a rank sends, once
    if watch.lo_bytes < need:
        return [
            f"the job's network namespace carried {_mb(watch.lo_bytes)} in all, less than "
            f"its {nprocs} ranks must send ({_mb(need)}); which rank stayed out cannot be "
            f"told here (per-rank socket counts: {watch.unavailable})"
        ], ""
    return [], ""
