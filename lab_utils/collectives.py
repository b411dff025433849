"""Collectives built from point-to-point messages: a ring all-reduce and a parameter server.

Both algorithms are written against a tiny communicator, :class:`Comm`, with the two
calls of ``torch.distributed`` they need (``isend`` and ``recv``), so the same code runs

* in real processes over Gloo or NCCL (:class:`TorchComm`, inside a launched job), and
* in threads of one Python process (:func:`simulate`), where a message that never
  arrives raises :class:`DeadlockError` after a few seconds instead of hanging.

Every communicator counts the bytes and messages it sends and receives
(:class:`Traffic`), which is how Lab 2 shows that a parameter server's links carry
``N/2`` times the ring's traffic.

The ring all-reduce on ``N`` ranks splits the tensor into ``N`` chunks (sizes differ
by at most one element, so any length works) and runs two phases of ``N - 1`` steps:

1. **reduce-scatter**: at step ``s`` rank ``r`` sends chunk ``(r - s) mod N`` to its
   right neighbour and adds the chunk ``(r - s - 1) mod N`` it receives from its left
   neighbour; afterwards rank ``r`` holds the complete sum of chunk ``(r + 1) mod N``;
2. **all-gather**: the complete chunks travel once more round the ring, each rank
   overwriting its copy, until every rank has every complete chunk.

Each rank sends ``2 (N - 1) / N`` times the tensor's size, whatever ``N`` is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# In-place combination of a received chunk into the local one: op(local, received, out=local).
_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "mean": torch.add,  # summed, divided by N at the end
    "max": torch.maximum,
    "min": torch.minimum,
    "prod": torch.mul,
}
OPS = tuple(_COMBINE)


class DeadlockError(RuntimeError):
    """A simulated rank waited longer than the timeout for a message."""


@dataclass
class Traffic:
    """What one rank put on and took off the wire."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0

    @property
    def bytes_total(self) -> int:
        """Bytes in plus bytes out: what this rank's network link carried."""
        return self.bytes_sent + self.bytes_received


class Work:
    """Handle of a send that may still be in flight (``.wait()`` blocks until done)."""

    def __init__(self, inner: Any = None) -> None:
        self._inner = inner

    def wait(self) -> None:
        if self._inner is not None:
            self._inner.wait()


class Comm:
    """A rank's view of a group of ``world_size`` ranks that exchange tensors.

    Subclasses implement :meth:`_isend` and :meth:`_recv`; this class checks the
    arguments and counts the traffic.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.traffic = Traffic(rank)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` to rank ``dst``; do not modify it before ``.wait()``."""
        self._check_peer(dst, "send to")
        self.traffic.bytes_sent += _nbytes(tensor)
        self.traffic.messages_sent += 1
        return self._isend(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive a message from rank ``src`` into ``tensor`` (same size and dtype)."""
        self._check_peer(src, "receive from")
        self._recv(tensor, src)
        self.traffic.bytes_received += _nbytes(tensor)
        self.traffic.messages_received += 1
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send and wait until the message has left (blocking)."""
        self.isend(tensor, dst).wait()

    def _check_peer(self, peer: int, verb: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"rank {self.rank} tried to {verb} rank {peer}, but the group has "
                f"ranks 0..{self.world_size - 1}"
            )
        if peer == self.rank:
            raise ValueError(f"rank {self.rank} tried to {verb} itself")

    def _isend(self, tensor: torch.Tensor, dst: int) -> Work:
        raise NotImplementedError

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        raise NotImplementedError


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------ torch.distributed
class TorchComm(Comm):
    """A :class:`Comm` over ``torch.distributed`` (the job must have a process group).

    ``group`` restricts it to a sub-group (``dist.new_group(ranks)``); ranks are then
    numbered within the group. Tensors must live on :attr:`device`: the current GPU
    with NCCL, the CPU with Gloo.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchComm needs a process group: call lab_utils.dist.init() "
                "in a script started by torchrun, mpirun or horovodrun"
            )
        self._dist = dist
        self.group = group
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))

    def _isend(self, tensor: torch.Tensor, dst: int) -> Work:
        return Work(self._dist.isend(tensor.contiguous(), group=self.group, group_dst=dst))

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.is_contiguous():
            self._dist.recv(tensor, group=self.group, group_src=src)
        else:
            buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            self._dist.recv(buf, group=self.group, group_src=src)
            tensor.copy_(buf)


def gather_traffic(comm: Comm) -> list[Traffic]:
    """Every rank's :class:`Traffic`, on every rank (one small all-reduce)."""
    counts = torch.zeros(comm.world_size, 4, dtype=torch.int64)
    t = comm.traffic
    counts[comm.rank] = torch.tensor(
        [t.bytes_sent, t.bytes_received, t.messages_sent, t.messages_received]
    )
    if isinstance(comm, TorchComm):
        on_device = counts.to(comm.device)
        comm._dist.all_reduce(on_device, group=comm.group)
        counts = on_device.cpu()
    elif comm.world_size > 1:
        raise TypeError(
            "gather_traffic needs a TorchComm; simulate() returns every rank's traffic already"
        )
    return [Traffic(r, *map(int, row)) for r, row in enumerate(counts.tolist())]


# ---------------------------------------------------------------- thread simulation
class _Mailboxes:
    """One FIFO queue per ordered pair (src, dst), shared by the simulated ranks."""

    def __init__(self, world_size: int) -> None:
        self.boxes = {
            (s, d): queue.Queue() for s in range(world_size) for d in range(world_size) if s != d
        }
        self.abort = threading.Event()


class ThreadComm(Comm):
    """A :class:`Comm` between threads of this process, for exercises and tests.

    A send copies the tensor into the receiver's mailbox and returns at once (like a
    network with unbounded buffers); a receive waits at most ``timeout`` seconds.
    """

    def __init__(self, rank: int, world_size: int, mail: _Mailboxes, timeout: float) -> None:
        super().__init__(rank, world_size)
        self._mail = mail
        self.timeout = timeout

    def _isend(self, tensor: torch.Tensor, dst: int) -> Work:
        self._mail.boxes[(self.rank, dst)].put(tensor.detach().clone())
        return Work()

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        deadline = time.monotonic() + self.timeout
        box = self._mail.boxes[(src, self.rank)]
        while True:
            if self._mail.abort.is_set():
                raise DeadlockError(
                    f"rank {self.rank} stopped waiting for rank {src}: another rank failed"
                )
            try:
                msg = box.get(timeout=0.05)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise DeadlockError(
                        f"rank {self.rank} waited {self.timeout:g}s for a message from rank "
                        f"{src} that never came: every rank is probably waiting in recv() for "
                        "another. Post the send (isend) before the matching recv."
                    ) from None
        if msg.numel() != tensor.numel() or msg.dtype != tensor.dtype:
            raise ValueError(
                f"rank {self.rank} received {msg.numel()} {msg.dtype} elements from rank {src} "
                f"into a buffer of {tensor.numel()} {tensor.dtype}: both sides must agree on "
                "which chunk is sent at each step"
            )
        tensor.copy_(msg.view_as(tensor))


class Simulated(NamedTuple):
    """What :func:`simulate` returns: each rank's output and traffic."""

    outputs: list[Any]
    traffic: list[Traffic]


def simulate(
    fn: Callable[..., Any], inputs: Sequence[Any], *args: Any, timeout: float = 5.0, **kwargs: Any
) -> Simulated:
    """Run ``fn(inputs[r], comm, *args, **kwargs)`` for every rank ``r`` in its own thread.

    ``len(inputs)`` is the world size; tensors are cloned so ranks share nothing but
    messages. If a rank raises, the others are told to stop and the first real error
    (not a consequence of it) is raised with the rank that raised it.
    """
    n = len(inputs)
    if n < 1:
        raise ValueError("simulate needs at least one rank's input")
    mail = _Mailboxes(n)
    comms = [ThreadComm(r, n, mail, timeout) for r in range(n)]
    outputs: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def worker(r: int) -> None:
        x = inputs[r]
        x = x.clone() if isinstance(x, torch.Tensor) else x
        try:
            outputs[r] = fn(x, comms[r], *args, **kwargs)
        except BaseException as exc:  # reported below, in the caller's thread
            errors[r] = exc
            mail.abort.set()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        root = [(r, e) for r, e in failed if not isinstance(e, DeadlockError)] or failed
        r, exc = root[0]
        raise type(exc)(f"rank {r} of {n}: {exc}") from exc
    pending = [pair for pair, box in mail.boxes.items() if not box.empty()]
    if pending:
        raise RuntimeError(
            "messages were sent but never received (src → dst): "
            + ", ".join(f"{s} → {d}" for s, d in pending)
        )
    return Simulated(outputs, [c.traffic for c in comms])


# -------------------------------------------------------------------- ring all-reduce
def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the ``world_size`` chunks of a tensor of ``numel`` elements.

    The first ``numel % world_size`` chunks get one extra element, so lengths that do
    not divide evenly (and tensors shorter than the ring) work; chunks may be empty.
    """
    base, extra = divmod(numel, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def _exchange(comm: Comm, send_chunk: torch.Tensor, recv_buf: torch.Tensor) -> None:
    """Send to the right neighbour while receiving from the left one (no deadlock:
    the send is posted before this rank blocks in its receive)."""
    right = (comm.rank + 1) % comm.world_size
    left = (comm.rank - 1) % comm.world_size
    work = comm.isend(send_chunk, right) if send_chunk.numel() else Work()
    if recv_buf.numel():
        comm.recv(recv_buf, left)
    work.wait()


def ring_reduce_scatter(chunks: Sequence[torch.Tensor], comm: Comm, op: str = "sum") -> int:
    """Phase 1, in place: afterwards this rank's chunk ``(rank + 1) mod N`` is complete.

    Returns the index of that complete chunk.
    """
    n, r = comm.world_size, comm.rank
    combine = _COMBINE[op]
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        _exchange(comm, chunks[send_i], buf)
        combine(chunks[recv_i], buf, out=chunks[recv_i])
    return (r + 1) % n


def ring_all_gather(chunks: Sequence[torch.Tensor], comm: Comm) -> None:
    """Phase 2, in place: pass the complete chunks round until every rank has all of them.

    Expects rank ``r`` to hold the complete chunk ``(r + 1) mod N`` (what
    :func:`ring_reduce_scatter` leaves).
    """
    n, r = comm.world_size, comm.rank
    for step in range(n - 1):
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        _exchange(comm, chunks[send_i], chunks[recv_i])


def _check_op(op: str, tensor: torch.Tensor) -> None:
    """Refuse a bad ``op`` before any rank sends: a late error would leave the others waiting."""
    if op not in _COMBINE:
        raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op='mean' needs a floating-point tensor, not {tensor.dtype}; "
            "use op='sum' and divide yourself"
        )


def ring_all_reduce(
    tensor: torch.Tensor, comm: Comm | None = None, op: str = "sum"
) -> torch.Tensor:
    """All-reduce ``tensor`` over ``comm``'s ranks with the ring algorithm.

    Returns a new tensor (``tensor`` itself is unchanged) equal on every rank to what
    ``dist.all_reduce`` computes. ``op`` is ``sum``, ``mean`` (floating point only),
    ``max``, ``min`` or ``prod``. ``comm`` defaults to a :class:`TorchComm` over the
    whole job.
    """
    _check_op(op, tensor)
    comm = comm if comm is not None else TorchComm()
    result = tensor.detach().clone().contiguous()
    n = comm.world_size
    if n > 1:
        chunks = list(torch.split(result.view(-1), chunk_sizes(result.numel(), n)))
        ring_reduce_scatter(chunks, comm, op)
        ring_all_gather(chunks, comm)
    if op == "mean":
        result /= n
    return result


# ------------------------------------------------------------------ parameter server
def server_all_reduce(
    tensor: torch.Tensor, comm: Comm | None = None, server: int = 0, op: str = "sum"
) -> torch.Tensor:
    """All-reduce through one central rank: everyone sends to ``server``, which combines
    and sends the result back. Same answer as the ring; the server's link carries
    ``2 (N - 1)`` times the tensor's size."""
    _check_op(op, tensor)
    comm = comm if comm is not None else TorchComm()
    result = tensor.detach().clone().contiguous()
    n = comm.world_size
    if not 0 <= server < n:
        raise ValueError(f"server rank {server} is not in a group of {n}")
    if comm.rank == server:
        buf = torch.empty_like(result)
        for worker in range(n):
            if worker != server:
                comm.recv(buf, worker)
                _COMBINE[op](result, buf, out=result)
        if op == "mean":
            result /= n
        works = [comm.isend(result, w) for w in range(n) if w != server]
        for w in works:
            w.wait()
    elif n > 1:
        comm.send(result, server)
        comm.recv(result, server)
    return result


class ParameterServer:
    """Synchronous data-parallel SGD with a parameter server.

    Rank ``server`` holds the master copy of the weights. At every :meth:`step`, each
    rank (the server computes gradients too) pushes its gradient; the server averages
    them, takes an SGD step and every other rank pulls the new weights. The result is
    the same as averaging gradients with an all-reduce; the traffic is not.
    """

    def __init__(
        self, weights: torch.Tensor, comm: Comm | None = None, lr: float = 0.1, server: int = 0
    ) -> None:
        self.comm = comm if comm is not None else TorchComm()
        if not 0 <= server < self.comm.world_size:
            raise ValueError(f"server rank {server} is not in a group of {self.comm.world_size}")
        self.server = server
        self.lr = lr
        self.weights = weights.detach().clone().contiguous()

    @property
    def is_server(self) -> bool:
        return self.comm.rank == self.server

    def step(self, grad: torch.Tensor) -> torch.Tensor:
        """Push ``grad``, let the server update, pull and return the new weights."""
        comm, n = self.comm, self.comm.world_size
        grad = grad.detach().contiguous()
        if grad.shape != self.weights.shape:
            raise ValueError(
                f"gradient of shape {tuple(grad.shape)} for weights of shape "
                f"{tuple(self.weights.shape)}"
            )
        if self.is_server:
            total = grad.clone()
            buf = torch.empty_like(grad)
            for worker in range(n):
                if worker != self.server:
                    comm.recv(buf, worker)  # push
                    total += buf
            self.weights -= self.lr * total / n
            works = [comm.isend(self.weights, w) for w in range(n) if w != self.server]  # pull
            for w in works:
                w.wait()
        elif n > 1:
            comm.send(grad, self.server)
            comm.recv(self.weights, self.server)
        return self.weights.clone()


# ---------------------------------------------------------------------- cost models
def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: ``2 (N-1)/N · S``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def server_bytes(nbytes: float, world_size: int) -> float:
    """Bytes the server receives (and sends) in a server all-reduce: ``(N-1) · S``."""
    return float(world_size - 1) * nbytes


def ring_time(nbytes: float, world_size: int, latency_s: float, bandwidth: float) -> float:
    """α–β model of a ring all-reduce: ``2 (N-1) α + 2 (N-1)/N · S / B`` seconds."""
    if world_size < 2:
        return 0.0
    return 2 * (world_size - 1) * latency_s + ring_bytes_per_rank(nbytes, world_size) / bandwidth
