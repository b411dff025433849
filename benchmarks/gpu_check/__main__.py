"""Command line: ``python -m benchmarks.gpu_check --out DIR [--cpu] [--budget S] [--only GLOB]``.

Exit status: 0 when no path failed (passed or skipped with a reason), 1 when one
failed, 2 for bad arguments. The table goes to ``DIR/gpu_check.md`` and
``DIR/gpu_check.json``, each path's whole output to ``DIR/logs/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from . import bundle, catalogue, report
from .harness import Deadline, Result, run_all, run_check

DEFAULT_BUDGET_S = 450.0  # of the 8 minutes: the rest is start-up and the report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description="Run every lab's GPU paths on this machine's GPU within a deadline; "
        "write a table of what passed, failed (with the error) or was skipped (with why).",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/gpu_check"), help="folder of the table and logs"
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU form: CUDA hidden, smallest sizes (proves the harness; make test runs it)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds for everything (default %(default)s)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="paths at a time after the measured ones (default: 6 on a GPU, 2 on CPU)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="run only the paths whose name matches (repeatable)",
    )
    p.add_argument(
        "--bundle",
        type=Path,
        default=bundle.DEFAULT_DIR,
        help="the wheels and data made by make gpu-bundle",
    )
    p.add_argument(
        "--notebooks",
        nargs="*",
        type=Path,
        default=None,
        help="these notebooks instead of every lab's",
    )
    p.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="keep what the paths write here (default: a temporary folder, removed)",
    )
    p.add_argument("--list", action="store_true", help="list the paths and exit")
    args = p.parse_args(argv)
    if args.budget <= 0 or (args.jobs is not None and args.jobs < 1):
        p.error("--budget and --jobs must be positive")
    return args


def notebooks_problem(env: dict[str, str]) -> str:
    """Why notebooks cannot run with this environment ("" when they can)."""
    probe = "import nbformat, nbclient, ipykernel, ipywidgets"
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"{last} (make gpu-bundle, carry .gpu_bundle; CONTRIBUTING.md, GPU check)"


def context(args: argparse.Namespace, scratch: Path) -> tuple[catalogue.Context, dict[str, str]]:
    """The machine, the paths' environment, and the facts the table's header shows."""
    import torch

    from lab_utils import data, flops

    cuda = torch.cuda.is_available() and not args.cpu
    env = {
        "LABS_RUNS": str(scratch / "runs"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "JUPYTER_RUNTIME_DIR": str(scratch / "jupyter"),
        "PYTHONPATH": str(catalogue.REPO),
    }
    info = {
        "form": "CPU form (CUDA hidden, smallest sizes)" if args.cpu else "GPU run",
        "started": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""),
    }
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # every path sees no GPU, whatever the machine has
    site_note = "none"
    if args.bundle.is_dir():
        unpacked = bundle.unpack(args.bundle, scratch / "site")
        if unpacked["problem"]:
            site_note = unpacked["problem"]
        else:
            env["PYTHONPATH"] = os.pathsep.join([unpacked["site"], str(catalogue.REPO)])
            site_note = f"{len(unpacked['unpacked'])} wheels unpacked, the image's own {len(unpacked['kept_own'])} kept"
        if (args.bundle / "data").is_dir() and not os.environ.get("LABS_DATA"):
            env["LABS_DATA"] = str(args.bundle / "data")
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    info["bundle"] = f"{args.bundle}: {site_note}"
    ctx = catalogue.Context(scratch=scratch, cpu=args.cpu, cuda=cuda, env=env)
    ctx.jobs = args.jobs or (6 if cuda else 2)
    if cuda:
        ctx.gpus = torch.cuda.device_count()
        ctx.device_name = torch.cuda.get_device_name(0)
        ctx.published_fp32 = flops.published_peak(ctx.device_name, torch.float32)
        ctx.published_tf32 = flops.published_peak(ctx.device_name, torch.float32, tf32=True)
        card = flops.published_card(ctx.device_name)
        info["device"] = f"{ctx.gpus} × {ctx.device_name}"
        info["published peak"] = (
            f"{card.name}: fp32 {ctx.published_fp32 or 0:.3g}, TF32 {ctx.published_tf32 or 0:.3g} FLOP/s ({card.source})"
            if card
            else f"{ctx.device_name} is not in lab_utils.flops.PUBLISHED_PEAKS: no MFU against a data sheet"
        )
    else:
        info["device"] = "cpu" + ("" if args.cpu else " (no CUDA on this machine)")
    ctx.horovod = importlib.util.find_spec("horovod") is not None
    ctx.sandbox = catalogue.sandbox_problem()
    full_env = {**os.environ, **env}
    ctx.notebooks_problem = notebooks_problem(full_env)
    found = args.notebooks if args.notebooks is not None else catalogue.LABS.rglob("*.ipynb")
    ctx.notebooks = sorted(p.resolve() for p in found if ".ipynb_checkpoints" not in p.parts)
    try:  # written once here, in the real file format, not by paths racing to write it
        data.load("synthetic-cifar10")
        info["CIFAR-10 stand-in"] = "synthetic-cifar10 (the cifar-10-batches-py format)"
    except Exception as e:  # the paths that need it then say why
        info["CIFAR-10 stand-in"] = f"could not be written: {type(e).__name__}: {e}"
    info["two ranks on one GPU"] = (
        "LABS_BACKEND=gloo (Gloo over CUDA tensors): NCCL refuses two ranks on one device"
        if cuda
        else "LABS_BACKEND=gloo, on CPU"
    )
    info["grader sandbox"] = (
        f"none, --unsafe-no-sandbox: {ctx.sandbox}" if ctx.sandbox else "bubblewrap"
    )
    info["Horovod"] = "installed" if ctx.horovod else "not installed"
    info["jobs"] = f"{ctx.jobs} paths at a time after the measured ones"
    return ctx, info


def selected(checks: list, only: Sequence[str] | None) -> list:
    if not only:
        return checks
    return [c for c in checks if any(fnmatch.fnmatchcase(c.name, g) for g in only)]


def progress(start: float) -> Callable[[Result], None]:
    def show(r: Result) -> None:
        extra = report.numbers_text(r.numbers) if r.status == "passed" else r.reason
        print(
            f"[{time.monotonic() - start:5.0f}s] {report.MARK[r.status]:<10} {r.name} ({r.seconds:.0f} s) {extra}"[
                :400
            ],
            file=sys.stderr,
            flush=True,
        )

    return show


def main(argv: Sequence[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    deadline = Deadline(args.budget)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # What the paths write (checkpoints, traces, runs, the unpacked wheels) stays out of
    # the table's folder, which a GPU machine's runner copies back.
    scratch = (
        args.scratch.resolve() if args.scratch else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    )
    try:
        return run(args, out, scratch, deadline, start, argv)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def run(
    args: argparse.Namespace,
    out: Path,
    scratch: Path,
    deadline: Deadline,
    start: float,
    argv: Sequence[str] | None,
) -> int:
    ctx, info = context(args, scratch)
    checks = selected(catalogue.all_checks(ctx), args.only)
    if args.list:
        for c in checks:
            print(f"{c.name:<34} {c.what}")
        return 0
    print(
        f"gpu_check: {len(checks)} paths, {args.budget:.0f} s budget, {info['device']}",
        file=sys.stderr,
        flush=True,
    )
    runner = functools.partial(run_check, scratch=scratch)
    results = run_all(checks, out, deadline, jobs=ctx.jobs, run=runner, progress=progress(start))
    info["wall time"] = f"{time.monotonic() - start:.0f} s of a {args.budget:.0f} s budget"
    info["command"] = "python -m benchmarks.gpu_check " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    j, m = report.write(out, info, results)
    print(report.markdown(info, results))
    print(f"{report.summary_line(results)}; wrote {m} and {j}", file=sys.stderr)
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
