"""Launcher environments for torch.distributed, and small collective helpers.

:func:`set_torch_env_from_launcher` is what PyTorch does not do itself: it turns the
environment of ``mpirun``, Slurm's ``srun``, ``horovodrun`` or a plain ``python`` into
the variables ``torch.distributed.init_process_group`` reads (Lab 2's scripts then make
the real calls themselves). The rest is plumbing for later labs and tests, built on it.

One :func:`init` works under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``),
``mpirun`` (OpenMPI's ``OMPI_COMM_WORLD_*``, MPICH/Intel's ``PMI_*``), ``horovodrun``
(``HOROVOD_*``), Slurm's ``srun`` and a plain single process. It picks NCCL when the
process has a GPU and Gloo otherwise, and gives every collective a timeout so a
crashed or missing peer ends the job with an error instead of a hang.

Importing this module changes nothing in the process, and no function here changes how
the process ends: a script that joins a group arms :func:`lab_utils.gloo_exit.arm`
itself, in one visible line (torch 2.13's Gloo threads would otherwise abort or hang a
job that finished its work; that module says why).
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import sys
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import metrics, port_agreement, profile
from .net import free_port

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None  # None for a single process without a process group
    device: torch.device
    launcher: str  # torchrun | mpirun | horovodrun | slurm | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process through its environment."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    job_id: str


def _int(env: dict[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def detect(env: dict[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous from whichever launcher started us."""
    env = dict(os.environ if env is None else env)
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT")
    if "HOROVOD_RANK" in env:
        launcher = "horovodrun"
        rank = _int(env, "HOROVOD_RANK")
        size = _int(env, "HOROVOD_SIZE")
        local_rank = _int(env, "HOROVOD_LOCAL_RANK", default=0)
        local_size = _int(env, "HOROVOD_LOCAL_SIZE", default=size)
        addr = addr or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        job = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "") + env.get("PMIX_NAMESPACE", "")
    elif "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", default=0)
        local_size = _int(env, "LOCAL_WORLD_SIZE", default=size)
        job = env.get("TORCHELASTIC_RUN_ID", "")
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "mpirun"
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=size)
        # The 32-bit job id repeats its 16-bit family across mpiruns by chance; the
        # address of this job's mpirun (the same for every rank) does not.
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE", "")
        job += env.get("OMPI_MCA_orte_hnp_uri", "")
    elif "PMI_RANK" in env:
        launcher = "mpirun"
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID", default=0)
        local_size = _int(env, "MPI_LOCALNRANKS", default=size)
        job = env.get("PMI_JOBID", "") or env.get("PMIX_NAMESPACE", "")
    elif "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        launcher = "slurm"
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", default=0)
        local_size = _slurm_tasks_here(env, size)
        job = env.get("SLURM_JOB_ID", "") + "." + env.get("SLURM_STEP_ID", "")
    else:
        return LaunchEnv("single", 0, 1, 0, 1, addr, port, "")
    if port is None and size > 1 and local_size != size:
        # No port given to a job across machines: every rank derives the same one from
        # the job id, below Linux's ephemeral ports (32768 up). One machine agrees on a
        # free port instead (with_port).
        port = 20000 + zlib.crc32(job.encode()) % 12000
    if addr is None and size > 1:
        if local_size != size:
            raise RuntimeError(
                f"{launcher} started a multi-node job of {size} processes but MASTER_ADDR is "
                "not set: export MASTER_ADDR=<host of rank 0> (and pass it to every rank, "
                "e.g. `mpirun -x MASTER_ADDR`)."
            )
        addr = "127.0.0.1"
    return LaunchEnv(launcher, rank, size, local_rank, local_size, addr, port, job)


def with_port(le: LaunchEnv, timeout_s: float | None = None) -> LaunchEnv:
    """``le`` with a rendezvous port: the launcher's, a free one for a single process,
    or, for the ranks of one machine, the free port rank 0 picked and published
    (:mod:`lab_utils.port_agreement`; the other ranks wait for it)."""
    if le.master_port is not None:
        return le
    if le.world_size == 1:
        port = free_port()
    else:
        job = le.job_id or f"parent-{os.getppid()}"  # a launcher that names no job
        if le.rank == 0:
            port = port_agreement.publish(job)
        else:
            port = port_agreement.wait_for(job, le.rank, timeout_s or default_timeout_s())
    return dataclasses.replace(le, master_port=port)


def _slurm_tasks_here(env: dict[str, str], size: int) -> int:
    """Tasks of this Slurm step on this node. ``SLURM_NTASKS_PER_NODE`` exists only with
    ``--ntasks-per-node``; ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: two tasks on each
    of three nodes, then one) always does, indexed by ``SLURM_NODEID``."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts: list[int] = []
    for part in filter(None, env.get("SLURM_STEP_TASKS_PER_NODE", "").split(",")):
        n, _, times = part.partition("(x")
        counts += [int(n)] * int(times.rstrip(")") or 1)
    node = _int(env, "SLURM_NODEID", default=0)
    return counts[node] if node < len(counts) else size


def set_torch_env_from_launcher(env: dict[str, str] | None = None) -> LaunchEnv:
    """Translate the launcher's environment into the variables ``init_process_group`` reads.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` itself; ``mpirun``, Slurm's ``srun`` and
    ``horovodrun`` set their own names instead, and a plain ``python script.py`` sets
    none. This fills in whatever is missing (a free port, which the ranks of one
    machine agree on through :func:`with_port`; loopback for Gloo on one machine), so
    that ``torch.distributed.init_process_group(backend)`` works the same under every
    launcher. Nothing else: the script makes the calls (and arms
    :func:`lab_utils.gloo_exit.arm` itself).
    """
    target = os.environ if env is None else env
    le = with_port(detect(target))
    if le.launcher == "single":
        le = dataclasses.replace(le, master_addr=le.master_addr or "127.0.0.1")
    values = {
        "RANK": le.rank,
        "WORLD_SIZE": le.world_size,
        "LOCAL_RANK": le.local_rank,
        "LOCAL_WORLD_SIZE": le.local_world_size,
        "MASTER_ADDR": le.master_addr,
        "MASTER_PORT": le.master_port,
    }
    for name, value in values.items():
        target.setdefault(name, str(value))
    gloo_on_loopback(le, target)
    return le


def gloo_on_loopback(le: LaunchEnv, env: MutableMapping[str, str]) -> None:
    """On one machine, Gloo talks over loopback (``GLOO_SOCKET_IFNAME=lo``) even where
    the default interface is odd (containers); a job that spans machines, or a value
    already set, is left alone: a multi-node job names its interface itself."""
    if le.local_world_size == le.world_size:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")


_info: DistInfo | None = None


def default_timeout_s() -> float:
    """Seconds a collective may wait (``$LABS_DIST_TIMEOUT``, default 120)."""
    return float(os.environ.get("LABS_DIST_TIMEOUT") or DEFAULT_TIMEOUT_S)


BACKEND_VAR = "LABS_BACKEND"
BACKENDS = ("gloo", "nccl")


def backend_override(env: dict[str, str] | None = None) -> str | None:
    """The backend ``$LABS_BACKEND`` asks for (``gloo`` or ``nccl``), or None when unset.

    An explicit switch, not a default: NCCL refuses two ranks on one GPU, so the GPU
    check (``python -m benchmarks.gpu_check``) sets ``LABS_BACKEND=gloo`` to run the
    device placement of two-rank code on a machine with one GPU, and says so in its
    table. A backend a script passes to :func:`init` itself still wins.
    """
    value = (os.environ if env is None else env).get(BACKEND_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def init(
    backend: str | None = None, timeout_s: float | None = None, group_if_alone: bool = False
) -> DistInfo:
    """Join the job (idempotent) and return who we are.

    A single plain process gets a :class:`DistInfo` with ``world_size == 1`` and no
    process group, so the same script runs with and without a launcher; with
    ``group_if_alone`` it gets a one-rank group instead (for code that needs a group
    at any size: FSDP, DTensor meshes, ZeRO). On CUDA, NCCL needs one GPU per rank:
    more local ranks than GPUs is a clear error, not NCCL's "duplicate GPU".
    ``$LABS_BACKEND`` (:func:`backend_override`) replaces the device's default backend.
    """
    global _info
    if _info is not None:
        return _info
    le = detect()
    profile.configure_threads()
    device = profile.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if le.world_size == 1 and not group_if_alone:
        _info = DistInfo(0, 1, 0, 1, None, device, le.launcher)
        return _info
    backend = backend or backend_override() or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and le.local_world_size > torch.cuda.device_count():
        raise RuntimeError(
            f"{le.local_world_size} ranks on this machine but {torch.cuda.device_count()} "
            "GPU(s): NCCL needs one GPU per rank. Start one process per GPU "
            "(torchrun --nproc-per-node N), or run on the CPU with CUDA_VISIBLE_DEVICES=''."
        )
    if le.world_size == 1:  # a one-rank group needs no rendezvous: an in-process store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _info = DistInfo(0, 1, 0, 1, backend, device, le.launcher)
        return _info
    if backend == "gloo":
        gloo_on_loopback(le, os.environ)
    le = with_port(le, timeout_s)
    os.environ.setdefault("MASTER_ADDR", str(le.master_addr))
    os.environ.setdefault("MASTER_PORT", str(le.master_port))
    wait = timedelta(seconds=timeout_s or default_timeout_s())
    try:
        dist.init_process_group(
            backend, init_method="env://", rank=le.rank, world_size=le.world_size, timeout=wait
        )
    except Exception as exc:
        raise RuntimeError(
            f"rank {le.rank}/{le.world_size} could not join the {backend} process group at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (launcher: {le.launcher}): "
            f"{exc}. If the port is taken, set MASTER_PORT; if a peer never started, look "
            "at its output above."
        ) from exc
    _info = DistInfo(
        le.rank, le.world_size, le.local_rank, le.local_world_size, backend, device, le.launcher
    )
    return _info


def info() -> DistInfo:
    """The :class:`DistInfo` of this process (calls :func:`init` if needed)."""
    return _info if _info is not None else init()


def _horovod() -> Any:
    """``horovod.torch`` if the script imported and initialised it, else None.

    A pure Horovod script has no torch process group; the helpers below then use
    Horovod's rank, size and all-reduce so the Trainer works there too.
    """
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd if hvd is not None and hvd.is_initialized() else None
    except (AttributeError, ValueError):
        return None


def rank() -> int:
    """This process's global rank: from the process group, Horovod, or the launcher's
    environment (so it stays right after :func:`shutdown`)."""
    if dist.is_initialized():
        return dist.get_rank()
    hvd = _horovod()
    if hvd is not None:
        return hvd.rank()
    return metrics.env_rank()


def world_size() -> int:
    """Number of processes in the job (1 without a process group or Horovod)."""
    if dist.is_initialized():
        return dist.get_world_size()
    hvd = _horovod()
    return hvd.size() if hvd is not None else 1


def is_main() -> bool:
    """True on rank 0: the only rank that prints progress and writes files."""
    return rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed at once so launched output stays in order."""
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def barrier() -> None:
    """Wait for every rank (no-op for a single process)."""
    if dist.is_initialized():
        dist.barrier()
    elif _horovod() is not None:
        _horovod().barrier()


def _collective_device() -> torch.device:
    # "nccl", or "cuda:nccl" where init_device_mesh made the group (seen with torch 2.11)
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over all ranks, as a new tensor on ``t``'s device."""
    if not dist.is_initialized():
        hvd = _horovod()
        if hvd is not None:
            return hvd.allreduce(t.detach().clone(), op=hvd.Sum)
        return t.clone()
    buf = t.detach().to(_collective_device(), copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over all ranks."""
    return all_reduce_sum(t) / world_size()


def average(x: float) -> float:
    """Mean of a Python number over all ranks."""
    return float(all_reduce_mean(torch.tensor(float(x), dtype=torch.float64)))


def average_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Average every value of ``metrics`` over all ranks in one collective."""
    keys = sorted(metrics)
    if not keys:
        return {}
    values = all_reduce_mean(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, values.tolist()))


def shutdown() -> None:
    """Leave the job: a barrier, then ``destroy_process_group()``.

    Every rank leaves together, so none tears down a connection a peer still uses. What
    else still holds the groups (DDP's reducer, FSDP's state, a DTensor's mesh) can
    still abort or hang the process at its exit under Gloo, unless the script armed
    :func:`lab_utils.gloo_exit.arm`.
    """
    global _info
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _info = None
