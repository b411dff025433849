"""Lab 4's model-parallel scripts, measured: shared by the ``pipeline``, ``sharding``
and ``tp`` benchmarks (one module each, so each can be run with ``--only``)."""

from __future__ import annotations

from lab_utils import launch, parallel

from .common import REPO_ROOT, Skip

SCRIPTS = REPO_ROOT / "labs" / "lab4_model_parallel" / "scripts"


def model_args(quick: bool) -> list[str]:
    """The char transformer and data of a benchmark run."""
    if quick:
        return [
            "--d-model",
            "32",
            "--layers",
            "4",
            "--seq-len",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "1",
            "--n-chars",
            "20000",
        ]
    # the cpu profile's model (parallel.MODEL), with a benchmark's own steps and corpus
    return [
        *parallel.MODEL.args("d_model", "layers", "seq_len", "batch_size", profile="cpu"),
        "--steps",
        "5",
        "--n-chars",
        "500000",
    ]


def launched(script: str, args: list[str], nprocs: int, timeout: float) -> launch.LaunchResult:
    """Run a Lab 4 script under torchrun (one thread per process); its records are
    ``.event(name)`` and ``.events(name)`` of what this returns."""
    path = SCRIPTS / script
    if not path.is_file():
        raise Skip(f"{path.relative_to(REPO_ROOT)} does not exist yet")
    result = launch.run(
        path,
        args,
        nprocs=nprocs,
        threads_per_proc=1,
        echo=False,
        timeout=timeout,
        env={"LABS_PROFILE": "quick"},
    ).check()
    return result
