"""The paths the check runs, in the order they run, at the sizes of a GPU run or the CPU form.

Groups (the table's order):

1. Lab 2 on the device, measured alone: ``train_serial.py`` and ``train_ddp.py`` (torchrun,
   one process: NCCL on one GPU) on the CIFAR-10 stand-in (``synthetic-cifar10``, the real
   file format) and on Fashion-MNIST, the ``gpu`` profile's model and batch, a few hundred
   steps: images/s and MFU against the card's published peak. Then Lab 6's probe.
2. Every script that takes one process (Labs 2-6), a few steps in the ``quick`` profile.
3. Two ranks on one GPU: NCCL refuses them, and the course says so clearly (a path
   checks that message); ``LABS_BACKEND=gloo`` then runs the two-rank scripts with Gloo
   over CUDA tensors, so their device placement runs for real. A collective Gloo does
   not run on CUDA tensors is a skip with PyTorch's own message, not a failure.
4. The grader on a ``gpu-1`` target with the DDP reference (the CIFAR-10 stand-in).
5. Every notebook, ``quick`` profile, solutions on, cheapest first.

The CPU form (``--cpu``) runs the same paths at the smallest sizes with CUDA hidden;
what needs CUDA is skipped with "no CUDA".
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils import launch

from .harness import Check

REPO = Path(__file__).resolve().parents[2]
LABS = REPO / "labs"
L2 = LABS / "lab2_data_parallel" / "scripts"
L3 = LABS / "lab3_large_batch" / "scripts"
L4 = LABS / "lab4_model_parallel" / "scripts"
L5 = LABS / "lab5_systems" / "scripts"
L6 = LABS / "lab6_efficiency" / "scripts"
GRADER_DDP = REPO / "assessment" / "solutions" / "reference_ddp.py"
TINY_SUBMISSION = REPO / "benchmarks" / "jobs" / "tiny_submission.py"

NO_CUDA = "no CUDA"
NO_HOROVOD = "Horovod is not installed (the GPU image has none: DESIGN.md §17)"
# Failures that are limits of PyTorch's Gloo on CUDA tensors, with its own message.
GLOO_LIMITS = (
    (
        r"(?i)(gloo[^\n]*(not support|unsupported|no support|not implemented)"
        r"|(not support|unsupported|not implemented)[^\n]*gloo|unsupported device type)",
        "PyTorch's Gloo does not run this on CUDA tensors",
    ),
    # Seen on an H200 with torch 2.11: Gloo's TCP transport writes a CUDA tensor's device
    # address as if it were host memory (send/recv, batch_isend_irecv: pipelines, rings).
    (
        r"writev .*Bad address",
        "PyTorch's Gloo cannot send or receive CUDA tensors point to point "
        "(pipeline and ring code needs NCCL: one GPU per rank)",
    ),
    # Seen there too: waiting on a functional collective (DTensor, FSDP2, DCP) over Gloo
    # and CUDA tensors kills the process; faulthandler's report ('line N in f', no commas)
    # names the frame, which a Python traceback never prints that way.
    (
        r'_functional_collectives\.py", line \d+ in \w+$',
        "PyTorch's Gloo crashes (SIGSEGV) in functional collectives on CUDA tensors "
        "(DTensor, FSDP2 and DCP need NCCL: one GPU per rank)",
    ),
)
NO_FASHION_MNIST = (
    (
        r"fashion-mnist: no complete copy found",
        "Fashion-MNIST is not on this machine (make gpu-bundle copies it)",
    ),
)
NOTEBOOK_LIMITS = (
    (r"No module named '?horovod|horovodrun is not installed", NO_HOROVOD),
    (
        r"NCCL needs one GPU per rank",
        "a two-rank train_ddp.py launch: the script picks NCCL itself (the lesson) and NCCL "
        "needs one GPU per rank; it runs on CPU in make test",
    ),
    (
        r"No module named '?pyspark|JAVA_HOME|Java gateway|Spark needs Java",
        "no Spark or Java on this machine (Lab 2.6)",
    ),
    *NO_FASHION_MNIST,
)


@dataclass
class Context:
    """What the catalogue needs to know about the machine and the run."""

    scratch: Path  # working folders, runs, the unpacked bundle: not the table's folder
    cpu: bool  # the CPU form: smallest sizes, CUDA hidden from every path
    cuda: bool = False
    gpus: int = 0
    device_name: str = "cpu"
    horovod: bool = False
    sandbox: str = "no sandbox checked"  # why the grader's sandbox cannot be made ("" if it can)
    notebooks_problem: str = ""  # why notebooks cannot run ("" when they can)
    env: dict[str, str] = field(default_factory=dict)  # every path's environment
    jobs: int = 1
    notebooks: list[Path] = field(default_factory=list)
    published_fp32: float | None = None
    published_tf32: float | None = None


def path_env(ctx: Context, profile: str = "quick", **extra: str) -> dict[str, str]:
    # faulthandler: a crash in native code prints the Python stack (the known limits read it)
    return {**ctx.env, "LABS_PROFILE": profile, "PYTHONFAULTHANDLER": "1", **extra}


def threads(ctx: Context) -> int:
    """Threads per process of a path that shares the machine with ``jobs - 1`` others."""
    return max(1, (os.cpu_count() or 1) // max(1, ctx.jobs))


# ------------------------------------------------------------------------- Lab 2, measured
@functools.cache
def train_flops_per_image(dataset: str, width: int) -> int:
    """FLOPs of one training image (forward and backward) of Lab 2's model, as
    ``FlopCounterMode`` counts them (``lab_utils.flops``), on the CPU."""
    import torch

    from lab_utils import flops, models

    if dataset == "fashion-mnist":
        model, x = (
            models.build("fmnist_cnn", width=width, batch_norm=False),
            torch.randn(2, 1, 28, 28),
        )
    else:
        model, x = models.build("resnet_cifar", width=width), torch.randn(2, 3, 32, 32)
    y = torch.zeros(2, dtype=torch.long)
    loss_fn = torch.nn.functional.cross_entropy
    return flops.count_flops(lambda: loss_fn(model(x), y).backward()) // 2


def lab2_numbers(
    ctx: Context, dataset: str, width: int
) -> Callable[[launch.LaunchResult], dict[str, Any]]:
    def numbers(job: launch.LaunchResult) -> dict[str, Any]:
        summary = job.event("summary")
        ips = float(summary["samples_per_s"])
        out: dict[str, Any] = {
            "images/s": ips,
            "steps": summary["steps"],
            "val_acc": summary["val_acc"],
        }
        per_image = train_flops_per_image(dataset, width)
        out["GFLOP/image"] = per_image / 1e9
        if ctx.published_fp32:
            out["mfu_fp32_peak"] = ips * per_image / ctx.published_fp32
        if ctx.published_tf32:  # cuDNN runs fp32 convolutions as TF32 by default
            out["mfu_tf32_peak"] = ips * per_image / ctx.published_tf32
        return out

    return numbers


def lab2_measured(ctx: Context) -> list[Check]:
    checks = []
    for dataset, key, steps in (
        ("synthetic-cifar10", "cifar", 300),
        ("fashion-mnist", "fmnist", 200),
    ):
        if ctx.cpu:
            width, profile = 8, "quick"
            args = ["--dataset", dataset, "--epochs", "1", "--max-steps", "3", "--n-train", "256"]
            args += ["--n-test", "128", "--width", str(width)]
        else:  # the gpu profile's model and batch; epochs enough for `steps` on the stand-in
            width, profile = 64, "gpu"
            args = ["--dataset", dataset, "--epochs", "20", "--max-steps", str(steps)]
        for script, launcher in (("train_serial.py", "python"), ("train_ddp.py", "torchrun")):
            kind = "serial" if launcher == "python" else "ddp"
            backend = "" if kind == "serial" else ("nccl, 1 GPU" if ctx.cuda else "gloo (CPU)")
            checks.append(
                Check(
                    name=f"lab2.{kind}.{key}",
                    group="Lab 2, measured",
                    what=f"{script} ({launcher}, 1 process) on {dataset}, {profile} profile, "
                    f"width {width}: images/s and MFU against the card's published peak",
                    script=str(L2 / script),
                    args=args,
                    launcher=launcher,
                    env=path_env(ctx, profile),
                    timeout=150,
                    min_seconds=30,
                    backend=backend,
                    exclusive=True,
                    known_limits=NO_FASHION_MNIST,
                    numbers=lab2_numbers(ctx, dataset, width),
                )
            )
    return checks


def lab6_rows(ctx: Context) -> Callable:
    """Lab 6's probe reports one row per part."""
    from .harness import FAILED, Result
    from .lab6_probe import PARTS

    def rows(base: Result, job: launch.LaunchResult) -> list[Result]:
        parts = {m["part"]: m for m in job.events("part")}
        out = []
        for part in PARTS:
            r = Result(
                f"lab6.{part}", base.group, base.what, FAILED, base.seconds, command=base.command
            )
            m = parts.get(part)
            if m is None:
                r.reason = "the probe ended before this part: " + (base.reason or "see its log")
                r.error = base.error
            else:
                r.status, r.reason = m["status"], m.get("reason", "")
                r.numbers = {
                    k: v for k, v in m.items() if k not in ("event", "part", "status", "reason")
                }
                r.error = base.error if r.status == FAILED else ""
            out.append(r)
        return out

    return rows


def lab6_probe(ctx: Context) -> Check:
    return Check(
        name="lab6.probe",
        group="Lab 6 on the device",
        what="bf16 autocast; fp16 with GradScaler; forward peak memory without and with "
        "recomputation against saved_bytes; MFU against the measured and published peak; "
        "a profiler trace read by lab_utils.trace",
        script="benchmarks.gpu_check.lab6_probe",
        module=True,
        args=["--small"] if ctx.cpu else [],
        env=path_env(ctx),
        timeout=150,
        min_seconds=30,
        exclusive=True,
        rows=lab6_rows(ctx),
    )


# ---------------------------------------------------------------------- one process each
def one_process(ctx: Context) -> list[Check]:
    group = "one process on the device"
    backend = "nccl, 1 GPU" if ctx.cuda else "gloo (CPU)"
    fm = ["--n-train", "512", "--n-test", "256"]

    def check(
        name: str,
        script: Path,
        args: list[str],
        launcher: str = "torchrun",
        nprocs: int = 1,
        what: str = "",
    ) -> Check:
        return Check(
            name=name,
            group=group,
            what=what or f"{script.name}, a few steps in the quick profile",
            script=str(script),
            args=args,
            launcher=launcher,
            nprocs=nprocs,
            env=path_env(ctx),
            timeout=120,
            min_seconds=20,
            backend=backend if launcher == "torchrun" else "",
            threads=threads(ctx),
            known_limits=NO_FASHION_MNIST,
        )

    checks = [
        check(
            "lab3.large_batch.lars",
            L3 / "train_large_batch.py",
            ["--optimizer", "lars", "--epochs", "1", *fm],
        ),
        check(
            "lab3.large_batch.lamb",
            L3 / "train_large_batch.py",
            ["--optimizer", "lamb", "--epochs", "1", *fm],
        ),
        check("lab4.tensor_parallel.1", L4 / "tensor_parallel.py", []),
        check("lab4.sharded.1", L4 / "sharded.py", []),
        check("lab4.hybrid.1", L4 / "hybrid.py", ["--tp", "1"]),
        check("lab4.experts.1", L4 / "experts.py", []),
        check(
            "lab4.reshard_checkpoint.1",
            L4 / "reshard_checkpoint.py",
            ["--save", "ckpt", "--reference", "ref.pt"],
        ),
        check(
            "lab5.param_server.1worker",
            L5 / "param_server.py",
            ["--steps", "10", *fm],
            nprocs=2,
            what="param_server.py: one server and one worker over torch.distributed.rpc",
        ),
        check(
            "lab5.hogwild.1worker",
            L5 / "hogwild.py",
            ["--workers", "1", "--steps", "20", *fm],
            launcher="python",
        ),
        check("lab5.easgd.1", L5 / "easgd.py", ["--steps", "10", *fm]),
        check(
            "lab5.elastic_train.1",
            L5 / "elastic_train.py",
            ["--steps", "10", *fm, "--out", "elastic"],
        ),
        check("lab6.profile_ddp.1", L6 / "profile_ddp.py", ["--out", "traces"]),
        check("lab6.ddp_by_hand.1", L6 / "ddp_by_hand.py", ["--no-timing"]),
    ]
    if ctx.horovod:
        hvd = check(
            "lab2.horovod.1",
            L2 / "train_horovod.py",
            ["--max-steps", "3", *fm],
            launcher="horovodrun",
        )
    else:
        hvd = Check(
            "lab2.horovod.1", group, "train_horovod.py under horovodrun, 1 process", skip=NO_HOROVOD
        )
    return [*checks, hvd]


# ------------------------------------------------------------------- two ranks, one GPU
def two_ranks(ctx: Context) -> list[Check]:
    group = "two ranks on one GPU" if ctx.cuda else "two ranks (CPU)"
    backend = (
        "gloo over CUDA tensors (LABS_BACKEND=gloo)"
        if ctx.cuda
        else "gloo (CPU, LABS_BACKEND=gloo)"
    )
    fm = ["--n-train", "512", "--n-test", "256"]
    # NCCL and one GPU: the course's own clear refusal, not NCCL's "duplicate GPU"
    if ctx.cuda and ctx.gpus == 1:
        refusal = Check(
            "lab2.nccl_two_ranks_refused",
            group,
            "collectives_demo.py, 2 ranks, NCCL on 1 GPU: stops with the course's message",
            script=str(L2 / "collectives_demo.py"),
            launcher="torchrun",
            nprocs=2,
            env=path_env(ctx),
            timeout=90,
            backend="nccl, 2 ranks on 1 GPU",
            threads=threads(ctx),
            expect_failure=r"NCCL needs one GPU per rank",
        )
    else:
        why = NO_CUDA if not ctx.cuda else f"{ctx.gpus} GPUs here: NCCL has one per rank"
        refusal = Check(
            "lab2.nccl_two_ranks_refused", group, "NCCL's refusal of 2 ranks on 1 GPU", skip=why
        )

    def check(name: str, script: Path, args: list[str], what: str = "") -> Check:
        return Check(
            name=name,
            group=group,
            what=what or f"{script.name}, 2 ranks, a few steps in the quick profile",
            script=str(script),
            args=args,
            launcher="torchrun",
            nprocs=2,
            env=path_env(ctx, LABS_BACKEND="gloo"),
            timeout=150,
            min_seconds=25,
            backend=backend,
            threads=threads(ctx),
            known_limits=GLOO_LIMITS + NO_FASHION_MNIST,
        )

    if ctx.cuda and ctx.gpus < 2:
        ddp = Check(
            "lab2.train_ddp.2",
            group,
            "train_ddp.py, 2 ranks",
            skip="train_ddp.py picks NCCL itself (its step [1], the lesson) and NCCL refuses "
            "two ranks on one GPU; its two-rank path runs on CPU in make test",
        )
    else:
        ddp = check(
            "lab2.train_ddp.2", L2 / "train_ddp.py", ["--max-steps", "3", "--width", "8", *fm]
        )
    return [
        refusal,
        ddp,
        check("lab2.collectives_demo.2", L2 / "collectives_demo.py", []),
        check("lab2.ring_check.2", L2 / "ring_check.py", []),
        check("lab2.ddp_bench.2", L2 / "ddp_bench.py", []),
        check("lab2.uneven_shards.join.2", L2 / "uneven_shards.py", ["--fix", "join"]),
        check(
            "lab3.large_batch.lars.2",
            L3 / "train_large_batch.py",
            ["--optimizer", "lars", "--epochs", "1", *fm],
        ),
        check(
            "lab4.sharded.2", L4 / "sharded.py", [], "sharded.py, 2 ranks: DDP, ZeRO-1 and FSDP2"
        ),
        check(
            "lab4.tensor_parallel.2",
            L4 / "tensor_parallel.py",
            [],
            "tensor_parallel.py, 2 ranks: by hand and DTensor",
        ),
        check("lab4.hybrid.2", L4 / "hybrid.py", ["--tp", "2"]),
        check("lab4.pipeline.2", L4 / "pipeline.py", []),
        check("lab4.pipeline_schedules.2", L4 / "pipeline_schedules.py", []),
        check("lab4.context_parallel.2", L4 / "context_parallel.py", []),
        check("lab4.experts.2", L4 / "experts.py", []),
        check(
            "lab4.reshard_checkpoint.2",
            L4 / "reshard_checkpoint.py",
            ["--save", "ckpt", "--reference", "ref.pt"],
        ),
        check("lab5.easgd.2", L5 / "easgd.py", ["--steps", "10", *fm]),
        check("lab6.ddp_by_hand.2", L6 / "ddp_by_hand.py", ["--no-timing"]),
        check("lab6.profile_ddp.2", L6 / "profile_ddp.py", ["--out", "traces"]),
        check("lab6.predicted_bytes.2", L6 / "predicted_bytes.py", []),
    ]


# --------------------------------------------------------------------------------- grader
def grader_target(ctx: Context) -> Path:
    """``gpu-1`` with the CIFAR-10 stand-in's data and accuracy (the GPU machine has no
    CIFAR-10); on the CPU form the tiny job (``benchmarks/jobs``, two processes, as
    ``python -m benchmarks --quick`` grades it) on the stand-in."""
    if ctx.cpu:
        values = dict(
            name="cpu-2proc-standin-check", dataset="synthetic-cifar10", accuracy=0.15, budget_s=120,
            grace_s=30, processes=2, threads_per_proc=1, profile="quick", archs=["linear"],
            data_parallel="require",
        )  # fmt: skip
    else:
        values = dict(
            name="gpu-1-standin-check", dataset="synthetic-cifar10", accuracy=0.55, budget_s=90,
            grace_s=20, processes=1, threads_per_proc=0, profile="gpu", archs=["resnet_cifar"],
            data_parallel="require",
        )  # fmt: skip
    values.update(description="the GPU check's grading target", status="test", launcher="torchrun")
    values["max_checkpoint_mb"] = 64
    lines = []
    for k, v in values.items():
        if isinstance(v, str):
            lines.append(f'{k} = "{v}"')
        elif isinstance(v, list):
            lines.append(f"{k} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in v)}]")
        else:
            lines.append(f"{k} = {v}")
    path = ctx.scratch / f"{values['name']}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def grader(ctx: Context) -> Check:
    target = grader_target(ctx)
    report = ctx.scratch / "work" / "grader.gpu-1" / "grade.json"
    args = [
        str(TINY_SUBMISSION if ctx.cpu else GRADER_DDP),
        "--target",
        str(target),
        "--json",
        str(report),
        "-q",
    ]
    note = "sandboxed (bubblewrap)"
    if ctx.sandbox:
        args.append("--unsafe-no-sandbox")
        note = f"without the sandbox: {ctx.sandbox}"

    def numbers(job: launch.LaunchResult) -> dict[str, Any]:
        r = json.loads(report.read_text())
        return {k: r[k] for k in ("reason", "accuracy", "elapsed_s", "budget_s") if k in r}

    def verdict(job: launch.LaunchResult) -> str:
        """The grader's own verdict, not its last line of output."""
        if not report.is_file():
            return ""
        r = json.loads(report.read_text())
        return f"{r.get('reason')}: {r.get('message', '')}"

    submission = "the tiny DDP job" if ctx.cpu else "the DDP reference"
    return Check(
        name="grader.gpu-1",
        group="grader",
        what=f"lab-grade {submission} on {target.stem} (gpu-1's launch with the CIFAR-10 "
        f"stand-in's data and accuracy), {note}",
        script="assessment.cli",
        module=True,
        args=args,
        env=path_env(ctx),
        timeout=240,
        min_seconds=60,
        backend=note,
        numbers=numbers,
        failure_reason=verdict,
    )


# ------------------------------------------------------------------------------ notebooks
def notebook_cost(path: Path) -> float:
    """A rough cost from the source, to run the cheapest first: every process launch
    costs seconds, every cell a little."""
    source = path.read_text()
    return 10 * source.count("launch.run(") + 0.5 * source.count('"cell_type": "code"')


def notebooks(ctx: Context) -> list[Check]:
    group = "notebooks (quick profile, solutions on)"
    out = []
    for nb in sorted(ctx.notebooks, key=notebook_cost):
        label = str(nb.relative_to(LABS)) if nb.is_relative_to(LABS) else nb.name
        name = "nb." + label.removesuffix(".ipynb").replace("/", ".")
        if ctx.notebooks_problem:
            out.append(Check(name, group, label, skip=ctx.notebooks_problem))
            continue
        out.append(
            Check(
                name=name,
                group=group,
                what=f"{label} top to bottom in a fresh kernel (nbclient)",
                script="benchmarks.gpu_check.notebook",
                module=True,
                args=[str(nb)],
                env=path_env(ctx, LABS_SOLUTIONS="1", LABS_BACKEND="gloo"),
                timeout=240,
                min_seconds=30,
                backend="two-rank launches: gloo (LABS_BACKEND=gloo)" if ctx.cuda else "",
                threads=threads(ctx),
                known_limits=NOTEBOOK_LIMITS + GLOO_LIMITS,
            )
        )
    return out


def all_checks(ctx: Context) -> list[Check]:
    return [
        *lab2_measured(ctx),
        lab6_probe(ctx),
        *one_process(ctx),
        *two_ranks(ctx),
        grader(ctx),
        *notebooks(ctx),
    ]


def sandbox_problem() -> str:
    """Why the grader's sandbox cannot be made here ("" when it can): bubblewrap absent
    (the GPU image has none), or present but refused by this kernel or container."""
    from assessment import jail

    try:
        jail.check()
    except jail.JailError as e:
        return str(e).splitlines()[0] if str(e) else "bubblewrap cannot run here"
    return ""
