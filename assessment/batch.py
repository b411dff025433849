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

import csv
import hashlib
import io
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import grade as grade_mod
from . import jail
from . import targets as targets_mod
from .report import EXIT_ERROR, EXIT_PASS

COLUMNS = (
    "student",
    "status",
    "verdict",
    "exit_code",
    "accuracy",
    "seconds",
    "warnings",
    "message",
    "submission",
    "sha256",
    "graded_at",
)


def students(folder: Path, entry: str = "train.py") -> list[tuple[str, Path]]:
    """``(name, path)`` of every submission in ``folder``, sorted by name."""
    out = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith((".", "_")):
            continue
        if p.is_file() and p.suffix == ".py":
            out.append((p.stem, p))
        elif p.is_dir():
            out.append((p.name, p))
    return out


def fingerprint(path: Path) -> str:
    """SHA-256 of a submission file, or of every file of a submission folder."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "warnings": " | ".join(r.get("warnings") or [])})
    return buf.getvalue()


def summary(rows: list[dict[str, Any]], target: str) -> str:
    """Counts of statuses and verdicts, in words."""
    by_status = Counter(r["status"] for r in rows)
    by_reason = Counter(r["verdict"] for r in rows)
    accs = [r["accuracy"] for r in rows if r["accuracy"] is not None]
    lines = [
        f"{len(rows)} submissions graded against {target}: "
        + ", ".join(f"{by_status[s]} {s}" for s in ("pass", "fail", "broken", "error")),
        "verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())),
    ]
    if accs:
        lines.append(
            f"measured accuracy: median {sorted(accs)[len(accs) // 2]:.2%}, best {max(accs):.2%}"
        )
    flagged = [
        r["student"] for r in rows if any(not w.startswith("target ") for w in r["warnings"] or [])
    ]
    if flagged:
        lines.append(f"with warnings (read their code): {', '.join(flagged)}")
    unsafe = [r["student"] for r in rows if r.get("unsafe")]
    if unsafe:
        lines.insert(0, "UNSAFE: graded without a sandbox; do not trust these verdicts")
    return "\n".join(lines) + "\n"


def run_batch(
    folder: Path,
    target: targets_mod.Target,
    out: Path,
    *,
    launcher: str | None = None,
    nprocs: int | None = None,
    entry: str = "train.py",
    unsafe: bool = False,
    regrade: bool = False,
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Grade every submission in ``folder`` (see the module docstring); the rows."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "reports").mkdir(exist_ok=True)
    state_file = out / "results.json"
    done: dict[str, dict[str, Any]] = {}
    if state_file.is_file() and not regrade:
        try:
            done = {r["student"]: r for r in json.loads(state_file.read_text())["rows"]}
        except (ValueError, KeyError, TypeError):
            done = {}
    todo = students(folder, entry)
    rows: dict[str, dict[str, Any]] = {}
    say = print if echo else (lambda *a, **k: None)
    # One training-only copy of the data for the whole class (read-only in every job).
    shared = Path(tempfile.mkdtemp(prefix="lab-grade-data-"))
    try:
        data_dir = None if unsafe else jail.training_copy(target.dataset, shared)
        _grade_all(
            todo,
            done,
            rows,
            target,
            out,
            say,
            launcher=launcher,
            nprocs=nprocs,
            entry=entry,
            unsafe=unsafe,
            data_dir=data_dir,
        )
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    _save(out, rows, target.name)
    ordered = [rows[n] for n, _ in todo if n in rows]
    say(summary(ordered, target.name), end="")
    return ordered


def _grade_all(
    todo: list[tuple[str, Path]],
    done: dict[str, dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    target: targets_mod.Target,
    out: Path,
    say: Any,
    **kw: Any,
) -> None:
    for i, (name, path) in enumerate(todo, 1):
        digest = fingerprint(path)
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
        report = grade_mod.grade(path, target, echo=False, **kw)
        report.write_json(out / "reports" / f"{name}.json")
        rows[name] = row_of(name, path, digest, target.name, report)
        acc = "" if report.accuracy is None else f" {report.accuracy:.2%}"
        secs = "" if report.elapsed_s is None else f" in {report.elapsed_s:.1f} s"
        say(
            f"[{i}/{len(todo)}] {name}: {report.status.upper()} {report.reason}{acc}{secs}",
            flush=True,
        )
        _save(out, rows, target.name)


def row_of(name: str, path: Path, digest: str, target: str, report: Any) -> dict[str, Any]:
    """One student's row of the results table, from their grading report."""
    return {
        "student": name,
        "status": report.status,
        "verdict": report.reason,
        "exit_code": report.exit_code,
        "accuracy": report.accuracy,
        "seconds": report.elapsed_s,
        "warnings": report.warnings,
        "message": report.message,
        "submission": str(path),
        "sha256": digest,
        "target": target,
        "unsafe": report.unsafe,
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _save(out: Path, rows: dict[str, dict[str, Any]], target: str) -> None:
    ordered = [rows[k] for k in sorted(rows)]
    _atomic_write(
        out / "results.json", json.dumps({"target": target, "rows": ordered}, indent=2) + "\n"
    )
    _atomic_write(out / "results.csv", _csv(ordered))
    _atomic_write(out / "summary.txt", summary(ordered, target))


def main(argv: list[str] | None = None) -> int:
    # Usage errors exit with the grader-error code, as lab-grade's do.
    p = grade_mod._Parser(prog="lab-grade batch", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="one submission per student: NAME.py or NAME/ with --entry")
    p.add_argument("--target", default=None, help="target name or .toml (default: by hardware)")
    p.add_argument("--launcher", choices=targets_mod.LAUNCHERS, default=None)
    p.add_argument("--nprocs", "-n", type=int, default=None)
    p.add_argument("--entry", default="train.py", help="entry script of folder submissions")
    p.add_argument("--out", default=None, help="results folder (default: FOLDER-grades)")
    p.add_argument("--regrade", action="store_true", help="grade everyone again")
    p.add_argument(
        "--unsafe-no-sandbox",
        dest="unsafe",
        action="store_true",
        help="grade without the sandbox where none can be made (see lab-grade --help)",
    )
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
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"lab-grade batch: {folder} is not a folder", file=sys.stderr)
        return EXIT_ERROR
    try:
        target = targets_mod.load(args.target or grade_mod.default_target())
    except targets_mod.TargetError as e:
        print(f"lab-grade batch: {e}", file=sys.stderr)
        return EXIT_ERROR
    if not args.unsafe:
        try:
            jail.check()
        except jail.JailError as e:
            print(
                f"lab-grade batch: no sandbox can be made, so nothing was run: {e}. To grade "
                "anyway, knowing that submissions can then read the test split and change "
                "your files, pass --unsafe-no-sandbox.",
                file=sys.stderr,
            )
            return EXIT_ERROR
    out = Path(args.out) if args.out else folder.with_name(folder.name.rstrip("/") + "-grades")
    if args.slurm:
        rows = _on_slurm(folder, target, out, args)
        if rows is None:
            return EXIT_ERROR
    else:
        rows = run_batch(
            folder,
            target,
            out,
            launcher=args.launcher,
            nprocs=args.nprocs,
            entry=args.entry,
            unsafe=args.unsafe,
            regrade=args.regrade,
        )
    print(f"results: {out / 'results.csv'}, {out / 'results.json'}, {out / 'summary.txt'}")
    return EXIT_ERROR if any(r["status"] == "error" for r in rows) else EXIT_PASS


def _on_slurm(
    folder: Path, target: targets_mod.Target, out: Path, args: Any
) -> list[dict[str, Any]] | None:
    """The batch as a Slurm job array (assessment/slurm.py); None where Slurm failed."""
    from . import slurm

    try:
        return slurm.run_slurm_batch(
            folder,
            target,
            out,
            launcher=args.launcher,
            nprocs=args.nprocs,
            entry=args.entry,
            unsafe=args.unsafe,
            regrade=args.regrade,
            partition=args.partition,
            gres=args.gres,
            time_limit=args.time_limit,
            extra=args.sbatch_args,
            poll_s=args.poll,
        )
    except slurm.SlurmError as e:
        print(f"lab-grade batch --slurm: {e}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        return None


if __name__ == "__main__":
    sys.exit(main())
