"""Run profiles: one switch (``LABS_PROFILE``) that sizes every lab.

``quick``  every code path in seconds on 2 CPU cores (what CI runs);
``cpu``    real results on a laptop in minutes;
``gpu``    the full course on one or more GPUs.

A lab's sizes by profile live in its ``labN_settings.py`` (:mod:`lab_utils.settings`),
read for the profile this module names, so that a single environment variable switches
the whole course (``tests/test_settings.py`` fails a size chosen by profile elsewhere).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TypeVar

import torch

PROFILES = ("quick", "cpu", "gpu")
T = TypeVar("T")

_threads_set = False


@dataclass(frozen=True)
class Profile:
    """The active run profile and the hardware it runs on."""

    name: str
    device: torch.device
    threads: int
    procs: int

    def pick(self, quick: T, cpu: T, gpu: T) -> T:
        """Return the value given for this profile."""
        return {"quick": quick, "cpu": cpu, "gpu": gpu}[self.name]

    def __str__(self) -> str:
        return f"profile={self.name} device={self.device} threads={self.threads} procs={self.procs}"


def default_name() -> str:
    """``gpu`` when CUDA is available, else ``cpu``."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def local_rank() -> int:
    """This process's rank on its machine, from whichever launcher started it."""
    for var in (
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "HOROVOD_LOCAL_RANK",
        "SLURM_LOCALID",
    ):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def device() -> torch.device:
    """The device this process should use: its local rank's GPU if CUDA is available."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op thread count once per process and return it.

    Launched workers share the cores, so each takes ``cores // local processes``
    unless ``n`` or ``OMP_NUM_THREADS`` says otherwise.
    """
    global _threads_set
    if n is None and "OMP_NUM_THREADS" in os.environ:
        n = int(os.environ["OMP_NUM_THREADS"])
    if n is None:
        local = int(
            os.environ.get("LOCAL_WORLD_SIZE")
            or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
            or os.environ.get("HOROVOD_LOCAL_SIZE")
            or 1
        )
        n = max(1, (os.cpu_count() or 1) // local)
    if not _threads_set or torch.get_num_threads() != n:
        torch.set_num_threads(n)
        _threads_set = True
    return n


def current(name: str | None = None) -> Profile:
    """The active profile: ``name``, else ``$LABS_PROFILE``, else :func:`default_name`."""
    name = (name or os.environ.get("LABS_PROFILE") or default_name()).strip().lower()
    if name not in PROFILES:
        raise ValueError(f"LABS_PROFILE={name!r} is not one of {', '.join(PROFILES)}")
    dev = device()
    threads = configure_threads()
    procs = max(1, torch.cuda.device_count()) if name == "gpu" and dev.type == "cuda" else 2
    return Profile(name=name, device=dev, threads=threads, procs=procs)


class _DefaultsHelp(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and adds "(default: …)" to every option."""


def script_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows each option's default as the current
    profile sets it, and names that profile (defaults differ between profiles)."""
    name = (os.environ.get("LABS_PROFILE") or default_name()).strip().lower()
    return argparse.ArgumentParser(
        description=description,
        formatter_class=_DefaultsHelp,
        epilog=f"Defaults shown are those of the {name!r} profile; set LABS_PROFILE="
        "quick|cpu|gpu to see another's.",
    )
