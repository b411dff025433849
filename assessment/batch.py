"""Grade a whole class: ``lab-grade batch SUBMISSIONS_DIR``.

    lab-grade batch submissions/ --target cpu-2proc --out grades/

Each entry of ``SUBMISSIONS_DIR`` is one student: ``alice.py``, or a folder
``bob/`` holding ``train.py`` (``--entry``). They are graded one after another under
the same target, each in its own sandbox, so no submission can change another's
verdict. After every student the grader rewrites ``results.json`` and
``results.csv`` (one row each: verdict, reason, accuracy, seconds, warnings) and
keeps the full report in ``reports/<student>.json``; ``summary.txt`` counts the
verdicts. Run it again after an interruption: students already graded with the
same submission file and target are not graded again (``--regrade`` forces it).
With ``--slurm`` each submission is one job of a Slurm job array instead
(:mod:`assessment.slurm`), with the same sandbox, target and results files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import grade as grade_mod
from . import jail, options, results, slurm
from . import targets as targets_mod
from .options import BatchOptions
from .report import EXIT_ERROR, EXIT_PASS


def run_batch(
    folder: Path, target: targets_mod.Target, out: Path, opts: BatchOptions | None = None
) -> list[dict[str, Any]]:
    """Grade every submission in ``folder`` (see the module docstring); the rows."""
    opts = opts or BatchOptions()
    out.mkdir(parents=True, exist_ok=True)
    (out / "reports").mkdir(exist_ok=True)
    state_file = out / "results.json"
    done: dict[str, dict[str, Any]] = {}
    if state_file.is_file() and not opts.regrade:
        try:
            done = {r["student"]: r for r in json.loads(state_file.read_text())["rows"]}
        except (ValueError, KeyError, TypeError):
            done = {}
    todo = results.students(folder, opts.entry)
    rows: dict[str, dict[str, Any]] = {}
    say = print if opts.echo else (lambda *a, **k: None)
    # One training-only copy of the data for the whole class (read-only in every job).
    shared = Path(tempfile.mkdtemp(prefix="lab-grade-data-"))
    try:
        data_dir = None if opts.unsafe else jail.training_copy(target.dataset, shared)
        _grade_all(todo, done, rows, target, out, say, opts, data_dir)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    results.save(out, rows, target.name)
    ordered = [rows[n] for n, _ in todo if n in rows]
    say(results.summary(ordered, target.name), end="")
    return ordered


def _grade_all(
    todo: list[tuple[str, Path]],
    done: dict[str, dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    target: targets_mod.Target,
    out: Path,
    say: Any,
    opts: BatchOptions,
    data_dir: Path | None,
) -> None:
    for i, (name, path) in enumerate(todo, 1):
        digest = results.fingerprint(path)
        old = done.get(name)
        if (
            old
            and old.get("sha256") == digest
            and old.get("target") == target.name
            and old.get("status") != "error"
        ):
            rows[name] = old
            say(
                f"[{i}/{len(todo)}] {name}: already graded ({old['status']}: {old['verdict']})",
                flush=True,
            )
            continue
        say(f"[{i}/{len(todo)}] {name}: grading ...", flush=True)
        report = grade_mod.grade(
            path,
            target,
            launcher=opts.launcher,
            nprocs=opts.nprocs,
            entry=opts.entry,
            unsafe=opts.unsafe,
            data_dir=data_dir,
        )
        report.write_json(out / "reports" / f"{name}.json")
        rows[name] = results.row_of(name, path, digest, target.name, report)
        acc = "" if report.accuracy is None else f" {report.accuracy:.2%}"
        secs = "" if report.elapsed_s is None else f" in {report.elapsed_s:.1f} s"
        say(
            f"[{i}/{len(todo)}] {name}: {report.status.upper()} {report.reason}{acc}{secs}",
            flush=True,
        )
        results.save(out, rows, target.name)


def parser() -> argparse.ArgumentParser:
    """The options of ``lab-grade batch``."""
    p = options.GraderParser(prog="lab-grade batch", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="one submission per student: NAME.py or NAME/ with --entry")
    options.add_target(p)
    options.add_launch(p)
    options.add_submission(p)
    p.add_argument("--out", default=None, help="results folder (default: FOLDER-grades)")
    p.add_argument("--regrade", action="store_true", help="grade everyone again")
    _add_slurm_options(p)
    return p


def _add_slurm_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slurm",
        action="store_true",
        help="one Slurm job per submission (a job array); see assessment/slurm.py",
    )
    p.add_argument("--partition", default=None, help="with --slurm: sbatch --partition")
    p.add_argument("--gres", default=None, help="with --slurm: sbatch --gres, e.g. gpu:4")
    p.add_argument(
        "--time",
        dest="time_limit",
        default=None,
        help="with --slurm: each job's time limit (default: 2 x (budget + grace) + 10 min)",
    )
    p.add_argument(
        "--sbatch-arg",
        dest="sbatch_args",
        action="append",
        default=[],
        help="with --slurm: one more sbatch option (repeat it), e.g. --account=X",
    )
    p.add_argument("--poll", type=float, default=5.0, help="with --slurm: seconds between polls")


def main(argv: list[str] | None = None) -> int:
    """``lab-grade batch``: grade a folder; 0 when every student got a verdict, else 3."""
    args = parser().parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"lab-grade batch: {folder} is not a folder", file=sys.stderr)
        return EXIT_ERROR
    target = options.load_target(args.target, "lab-grade batch")
    if target is None or not _sandbox_or_unsafe(args.unsafe):
        return EXIT_ERROR
    out = Path(args.out) if args.out else folder.with_name(folder.name.rstrip("/") + "-grades")
    opts = BatchOptions.from_args(args)
    if args.slurm:
        rows = _on_slurm(folder, target, out, opts)
        if rows is None:
            return EXIT_ERROR
    else:
        rows = run_batch(folder, target, out, opts)
    print(f"results: {out / 'results.csv'}, {out / 'results.json'}, {out / 'summary.txt'}")
    return EXIT_ERROR if any(r["status"] == "error" for r in rows) else EXIT_PASS


def _sandbox_or_unsafe(unsafe: bool) -> bool:
    """Whether the class may be graded: a sandbox can be made, or the caller said unsafe."""
    if unsafe:
        return True
    try:
        jail.check()
    except jail.JailError as e:
        print(
            f"lab-grade batch: no sandbox can be made, so nothing was run: {e}. To grade "
            "anyway, knowing that submissions can then read the test split and change "
            "your files, pass --unsafe-no-sandbox.",
            file=sys.stderr,
        )
        return False
    return True


def _on_slurm(
    folder: Path, target: targets_mod.Target, out: Path, opts: BatchOptions
) -> list[dict[str, Any]] | None:
    """The batch as a Slurm job array (assessment/slurm.py); None where Slurm failed."""
    try:
        return slurm.run_slurm_batch(folder, target, out, opts)
    except slurm.SlurmError as e:
        print(f"lab-grade batch --slurm: {e}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        return None


if __name__ == "__main__":
    sys.exit(main())
