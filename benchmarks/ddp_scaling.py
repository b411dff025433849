"""4. Data-parallel scaling on CPU: DDP with 2 processes vs 1, and Horovod vs DDP.

Runs Lab 2's scripts the way the notebook does (``lab_utils.launch``), one
intra-op thread per process, the batch per process fixed (weak scaling, as in the
lab). One process is ``train_serial.py`` (no process group, no DDP: the baseline a
student starts from); two are ``train_ddp.py`` under ``torchrun``. Throughput is what the script itself reports: images per second over its
timed steps (the first step of each epoch, with connection set-up, is excluded),
averaged over ranks. Scaling efficiency = throughput(2) / (2 × throughput(1)).
Horovod runs ``train_horovod.py`` (the same training, converted to Horovod) under
``horovodrun`` next to ``train_ddp.py`` under ``torchrun``.
"""

from __future__ import annotations

from pathlib import Path

from lab_utils import launch

from .common import (
    REPO_ROOT,
    Report,
    Settings,
    Skip,
    alternate,
    horovod_problem,
    median,
    paired_ratios,
    spread,
)

NAME = "ddp"
TITLE = "DDP scaling 1 -> 2 processes (1 thread each); Horovod vs DDP"
SCRIPTS = REPO_ROOT / "labs" / "lab2_data_parallel" / "scripts"
TARGET_SPEEDUP = 1.7


def seconds_per_image(
    script: Path, launcher: str, nprocs: int, args: list[str], timeout: float
) -> float:
    """Launch ``script`` and return 1 / (the images per second it reports)."""
    result = launch.run(
        script,
        args,
        nprocs=nprocs,
        launcher=launcher,
        threads_per_proc=1,
        echo=False,
        timeout=timeout,
    ).check()
    summaries = result.events("summary")
    if not summaries or not summaries[-1].get("samples_per_s"):
        raise RuntimeError(f"{script.name} reported no throughput:\n{result.output[-2000:]}")
    return 1.0 / float(summaries[-1]["samples_per_s"])


def script_args(quick: bool) -> tuple[list[str], float]:
    """The arguments every contender's script gets, and its timeout."""
    if quick:  # the smallest run that still takes timed steps after the first
        return [
            "--epochs",
            "1",
            "--max-steps",
            "4",
            "--batch-size",
            "32",
            "--width",
            "8",
            "--n-train",
            "512",
            "--n-test",
            "128",
            "--dataset",
            "fashion-mnist",
        ], 120.0
    return [
        "--epochs",
        "1",
        "--max-steps",
        "60",
        "--batch-size",
        "128",
        "--width",
        "32",
        "--n-train",
        "20000",
        "--n-test",
        "1000",
        "--dataset",
        "fashion-mnist",
    ], 600.0


def run(settings: Settings) -> Report:
    serial_script, ddp_script = SCRIPTS / "train_serial.py", SCRIPTS / "train_ddp.py"
    for script in (serial_script, ddp_script):
        if not script.is_file():
            raise Skip(f"{script.relative_to(REPO_ROOT)} does not exist yet")
    report = Report(NAME, TITLE)
    args, timeout = script_args(settings.quick)
    rounds = settings.rounds(full=3)

    def launcher(script: Path, how: str, nprocs: int):
        return lambda: seconds_per_image(script, how, nprocs, args, timeout)

    contenders = {
        "serial": launcher(serial_script, "python", 1),
        "ddp": launcher(ddp_script, "torchrun", 2),
    }
    hvd_script = SCRIPTS / "train_horovod.py"
    problem = horovod_problem()
    if not hvd_script.is_file():
        problem = f"{hvd_script.relative_to(REPO_ROOT)} does not exist yet"
    if not problem:
        contenders["horovod"] = launcher(hvd_script, "horovodrun", 2)
    # All of them in every round, in alternating order: both ratios are side by side.
    times = alternate(contenders, rounds=rounds, warmup=0)

    def rate(name: str) -> float:
        return median([1 / s for s in times[name]])

    ratios = paired_ratios(times["serial"], times["ddp"])
    speedup = median(ratios)
    lo, hi = spread(ratios)
    report.add("serial script, 1 process", rate("serial"), "img/s")
    report.add("DDP, 2 processes", rate("ddp"), "img/s")
    report.add(
        "DDP speed-up, 2 vs 1 process",
        speedup,
        "x",
        target=f">= {TARGET_SPEEDUP:g}x",
        met=speedup >= TARGET_SPEEDUP,
        note=f"rounds {lo:.2f}..{hi:.2f}x",
    )
    report.add("DDP scaling efficiency", 100 * speedup / 2, "%")
    if problem:
        report.add("Horovod / DDP throughput, 2 processes", None, "x", note=f"skipped: {problem}")
    else:
        hvd = paired_ratios(times["ddp"], times["horovod"])
        report.add("Horovod, 2 processes", rate("horovod"), "img/s")
        report.add(
            "Horovod / DDP throughput, 2 processes",
            median(hvd),
            "x",
            note=f"rounds {min(hvd):.2f}..{max(hvd):.2f}x",
        )
    report.details = {"args": args, "rounds": rounds, "seconds_per_image": times}
    report.notes.append(
        f"`{' '.join(args)}`; 1 thread per process; median of {rounds} "
        "alternating rounds; each run's first step excluded by the script."
    )
    return report
