"""The grader's sandbox and batch grading, tried with hostile submissions.

One batch grades a class of good, bad and hostile submissions (tests/submissions/)
against a small Fashion-MNIST target and checks the table, then what each hostile
one tried and that nothing was left behind: no process, no change to the checkout or
the data. The other tests cover what a batch cannot: a job that ignores SIGTERM, the
second wall (hashes) when there is no sandbox, and the refusal to run without one.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import sandbox_or_skip

from assessment import batch, grade, integrity, jail, participation, sandbox, targets
from lab_utils import data

REPO = Path(__file__).resolve().parents[1]
SUBMISSIONS = REPO / "tests" / "submissions"
TARGET = SUBMISSIONS / "sandbox.toml"


def _checkout() -> dict[str, str]:
    """Hashes of the course code, the targets, the fixtures and the dataset files."""
    files = integrity.code_files(REPO) + sorted(SUBMISSIONS.iterdir())
    source = Path(data.load("fashion-mnist").source)
    files += sorted(p for p in source.iterdir() if p.is_file())
    return integrity.snapshot(files, [REPO / "lab_utils", REPO / "assessment"])


def _git_status() -> str | None:
    """``git status`` of the code, the targets and the fixtures (None where the checkout
    is not a git checkout; other folders may change under tests running beside)."""
    if shutil.which("git") is None:
        return None
    done = subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=all",
            "--",
            "lab_utils",
            "assessment",
            "tests/submissions",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return done.stdout if done.returncode == 0 else None


def _processes_with(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(p.info["cmdline"] or ()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return [p for p in found if p.pid != os.getpid()]


# student -> (status, verdict); the file each one is, in tests/submissions. The honest
# job is good_linear.py graded right after the tamperer (a batch goes by name): it passes,
# so the tamperer changed nothing, and its report is the evidence an honest job leaves.
# (A crash is here as memory_hog; crash_one_rank's verdict is tests/test_grader.py's,
# sandboxed under torchrun and mpirun: one job fewer, no claim less.)
CLASS = {
    "tamper": ("fail", "low_accuracy"),  # its edits were refused; its own model is untrained
    "tamper_then_innocent": ("pass", "passed"),  # good_linear.py, judged correctly
    "dataset_cache": ("fail", "low_accuracy"),
    "peek_test_split": ("fail", "low_accuracy"),
    "copy_checkpoint": ("broken", "no_checkpoint"),
    "refork_daemon": ("broken", "no_checkpoint"),
    "setsid_daemon": ("broken", "no_checkpoint"),
    "flood": ("fail", "low_accuracy"),
    "many_children": ("fail", "low_accuracy"),
    "network": ("fail", "low_accuracy"),
    "oversized": ("broken", "bad_checkpoint"),
    "memory_hog": ("broken", "crashed"),
    "lone_rank": ("fail", "not_data_parallel"),  # no rank exchanged gradients with another
    "syntax_error": ("broken", "syntax_error"),
}
EXIT = {"pass": 0, "fail": 1, "broken": 2, "error": 3}


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 14 jobs: about 60 s on 2 idle cores, far more when shared
def test_a_class_of_good_bad_and_hostile_submissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    sandbox_or_skip()
    folder = tmp_path / "class"
    folder.mkdir()
    for student in CLASS:
        src = {"tamper_then_innocent": "good_linear.py", "syntax_error": "syntax_error.py.txt"}.get(
            student, f"{student}.py"
        )
        shutil.copyfile(SUBMISSIONS / src, folder / f"{student}.py")
    # A trained checkpoint elsewhere on the machine, named in the job's environment.
    stolen = tmp_path / "stolen" / "checkpoint.pt"
    stolen.parent.mkdir()
    shutil.copyfile(SUBMISSIONS / "fast.toml", stolen)  # any file: it must not be reachable
    marker = f"lab-grade-fixture-daemon-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FIXTURE_STOLEN_CHECKPOINT", str(stolen))
    monkeypatch.setenv("FIXTURE_DAEMON_MARKER", marker)
    before, status_before = _checkout(), _git_status()
    rss_before = psutil.Process().memory_info().rss
    out = tmp_path / "grades"

    rows = batch.run_batch(folder, targets.load(TARGET), out)

    rss_growth_mb = (psutil.Process().memory_info().rss - rss_before) / 2**20
    table = {r["student"]: (r["status"], r["verdict"]) for r in rows}
    assert table == CLASS, {k: (v, CLASS.get(k)) for k, v in table.items() if v != CLASS.get(k)}
    for r in rows:
        assert r["exit_code"] == EXIT[r["status"]]
    # Nothing left behind, nothing changed.
    assert _processes_with(marker) == [], "a daemon outlived its job"
    assert _checkout() == before, integrity.changed(before, _checkout())
    assert _git_status() == status_before
    assert stolen.read_bytes() == (SUBMISSIONS / "fast.toml").read_bytes()

    reports = {s: json.loads((out / "reports" / f"{s}.json").read_text()) for s in CLASS}
    for s, rep in reports.items():
        assert rep["leftover_processes"] == 0, s
        assert not Path(rep["workdir"]).exists(), s
    text = {s: "\n".join(rep["output_tail"]) for s, rep in reports.items()}
    assert "refused" in text["tamper"] and "TAMPERED" not in text["tamper"]
    assert "WROTE" not in text["dataset_cache"] and "refused" in text["dataset_cache"]
    assert (
        "no test split visible" in text["peek_test_split"]
        and "FOUND" not in text["peek_test_split"]
    )
    # (an obfuscated search: the source check has nothing to warn about, the sandbox holds)
    assert not any("mentions the test split" in w for w in reports["peek_test_split"]["warnings"])
    assert (
        "no checkpoint to copy" in text["copy_checkpoint"]
        and "COPIED" not in text["copy_checkpoint"]
    )
    assert "CONNECTED" not in text["network"] and "no network to 1.1.1.1:80" in text["network"]
    assert "INTERFACES ['lo']" in text["network"]  # its own network namespace: loopback only
    assert "fork refused" in text["many_children"]
    assert "MB; the target allows at most 1 MB" in reports["oversized"]["message"]
    assert "memory limit" in reports["memory_hog"]["message"]
    assert "got all of it" not in text["memory_hog"]
    # The flood: 2 ranks x 50,000 lines of 2,000 bytes; the grader kept the last few.
    assert reports["flood"]["environment"]["output_lines"] >= 100_000
    assert rss_growth_mb < 150, f"the grader grew by {rss_growth_mb:.0f} MB"
    # One rank did all the work: not data-parallel (no bytes between the ranks), and
    # its CPU time shows which rank idled; a data-parallel job is neither.
    lone = [w for w in reports["lone_rank"]["warnings"] if w.startswith("rank 1 did not train")]
    assert lone, reports["lone_rank"]["warnings"]
    assert "rank 1 sent 0.00 MB and received 0.00 MB" in reports["lone_rank"]["message"]
    good = reports["tamper_then_innocent"]
    assert not any("did not train" in w or "not data-parallel" in w for w in good["warnings"])
    assert all(r["sent_mb"] > 0 for r in good["ranks"])
    assert [r["rank"] for r in good["ranks"]] == [0, 1]
    # The evidence of both, read here for tests/test_grader_data_parallel.py (the same
    # jobs: grading them again there would cost two more launches). The honest job: every
    # rank moved at least the gradients' bytes, all of them on the job's own loopback.
    assert not any("could not be checked" in w for w in good["warnings"]), good["warnings"]
    need_mb = participation.minimum_bytes(good["checkpoint"]["parameters"]) / 2**20
    for row in good["ranks"]:
        assert min(row["sent_mb"], row["received_mb"]) >= need_mb, good["ranks"]
    assert good["environment"]["namespace_lo_mb"] >= sum(row["sent_mb"] for row in good["ranks"])
    # The lone rank (rank 1 exits at once): it met the target, only the evidence fails
    # it, and the verdict is said once, not again as a warning.
    lone_rank = reports["lone_rank"]
    assert lone_rank["accuracy"] >= targets.load(TARGET).accuracy
    assert [row["sent_mb"] for row in lone_rank["ranks"]] == [0.0, 0.0]
    assert not any(w.startswith("not data-parallel") for w in lone_rank["warnings"])

    # The table on disk, and a resumed batch grades only what is missing.
    with open(out / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["student"]: (r["status"], r["verdict"]) for r in csv_rows} == CLASS
    assert f"{len(CLASS)} submissions graded" in (out / "summary.txt").read_text()
    state = json.loads((out / "results.json").read_text())
    state["rows"] = [r for r in state["rows"] if r["student"] != "syntax_error"]
    (out / "results.json").write_text(json.dumps(state))
    capsys.readouterr()
    again = batch.run_batch(folder, targets.load(TARGET), out)
    printed = capsys.readouterr().out
    assert {r["student"]: (r["status"], r["verdict"]) for r in again} == CLASS
    assert printed.count("already graded") == len(CLASS) - 1
    assert "syntax_error: grading" in printed


@pytest.mark.launcher
def test_a_job_ignoring_sigterm_is_killed_at_the_deadline() -> None:
    sandbox_or_skip()
    t = dataclasses.replace(targets.load(TARGET), budget_s=3.0, grace_s=2.0)
    r = grade.grade(SUBMISSIONS / "ignore_sigterm.py", t)
    assert (r.reason, r.exit_code, r.timed_out) == ("timeout", 1, True), r.text()
    assert r.leftover_processes == 0 and not Path(r.workdir).exists()
    assert _processes_with(str(Path(r.workdir).parent)) == []


@pytest.mark.launcher
def test_without_a_sandbox_the_hashes_catch_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second wall: graded unsafely, a submission changes a file the verdict
    depends on (here a stand-in added to the guarded files): judged ``tampered``."""
    guarded = tmp_path / "guarded.py"
    guarded.write_text("ORIGINAL = True\n")
    monkeypatch.setenv("FIXTURE_TAMPER_FILE", str(guarded))
    real = grade._guarded_files
    monkeypatch.setattr(grade, "_guarded_files", lambda *a: [*real(*a), guarded])
    r = grade.grade(
        SUBMISSIONS / "tamper.py", targets.load(SUBMISSIONS / "roomy.toml"), unsafe=True
    )
    assert (r.reason, r.exit_code, r.accuracy) == ("tampered", 2, None), r.text()
    assert str(guarded) in r.message and "tampered" in guarded.read_text()
    assert r.text().startswith("UNSAFE: graded without a sandbox")
    # The control: the same submission, when the file is left alone, is judged normally.
    monkeypatch.setattr(grade, "_guarded_files", real)
    r = grade.grade(
        SUBMISSIONS / "fake_accuracy.py", targets.load(SUBMISSIONS / "roomy.toml"), unsafe=True
    )
    assert r.reason == "low_accuracy", r.text()


def test_no_sandbox_means_no_run_unless_unsafe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jail, "bwrap", lambda: None)
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    r = grade.grade(script, targets.load(SUBMISSIONS / "roomy.toml"))
    assert (r.reason, r.exit_code, r.elapsed_s) == ("grader_error", 3, None)
    assert "bubblewrap" in r.message and "--unsafe-no-sandbox" in r.message
    assert not marker.exists()
    assert batch.main([str(tmp_path), "--target", str(SUBMISSIONS / "roomy.toml")]) == 3
    assert not marker.exists()


def test_the_sandbox_sees_only_the_training_split(tmp_path: Path) -> None:
    full = data.load("synthetic-cifar10")
    dest = jail.training_copy("synthetic-cifar10", tmp_path)
    folder = dest / "synthetic-cifar10"
    assert not (folder / "test_batch").exists() and (folder / data.TRAINING_ONLY).is_file()
    only = data.load("synthetic-cifar10", root=folder, download=False)
    assert len(only.x_test) == 0 and only.x_train.shape == full.x_train.shape
    assert only.mean == full.mean
    val = only.holdout(0.1)
    assert len(val.x_test) == len(full.x_train) // 10
    assert len(val.x_train) + len(val.x_test) == len(full.x_train)
    # Without the marker the same folder is incomplete (the test split is required), so
    # the loader passes it by for a complete copy.
    (folder / data.TRAINING_ONLY).unlink()
    again = data.load("synthetic-cifar10", root=folder, download=False)
    assert Path(again.source) != folder.resolve() and len(again.x_test) == len(full.x_test)


def test_the_sandbox_command_confines_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if jail.bwrap() is None:
        pytest.skip("bubblewrap is not installed")
    monkeypatch.setattr(jail, "gpu_devices", lambda: ["/dev/nvidia0", "/dev/nvidiactl"])
    cmd = jail.command(["python", "x.py"], workdir=tmp_path, data_dir=None, repo=REPO, gpu=True)
    text = " ".join(cmd)
    for flag in (
        "--unshare-pid",
        "--unshare-net",
        "--die-with-parent",
        "--cap-drop ALL",
        "--dev-bind /dev/nvidia0 /dev/nvidia0",
        "--dev-bind /dev/nvidiactl",
        f"--bind {tmp_path} {tmp_path}",
        "--tmpfs /tmp",
    ):
        assert flag in text
    assert f"--ro-bind {REPO / 'lab_utils'}" in text and f"--ro-bind {REPO} " not in text
    cpu = " ".join(jail.command(["python"], workdir=tmp_path, data_dir=None, repo=REPO))
    assert "nvidia" not in cpu


@pytest.mark.launcher
def test_inside_the_sandbox_writes_outside_the_workdir_fail(tmp_path: Path) -> None:
    sandbox_or_skip()
    work = tmp_path / "work"
    work.mkdir()
    probe = (
        "import pathlib, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        pathlib.Path(p).write_text('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.strerror)\n"
    )
    inside = work / "ok.txt"
    outside = [
        REPO / "lab_utils" / "probe.txt",
        REPO / "probe.txt",
        Path(sys.prefix) / "probe.txt",
        Path("/etc/probe.txt"),
    ]
    private = tmp_path / "probe.txt"  # in the job's own /tmp: allowed, never seen here
    cmd = jail.command(
        [sys.executable, "-c", probe, str(inside), str(private), *map(str, outside)],
        workdir=work,
        data_dir=None,
        repo=REPO,
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"WROTE {inside}" in done.stdout and inside.read_text() == "x"
    assert f"WROTE {private}" in done.stdout and not private.exists()
    for p in outside:
        assert not p.exists(), f"the job wrote {p}"
        # A checkout under /tmp lies in the job's own empty /tmp (only lab_utils is shown
        # there): a write to its root lands in that private folder, which vanishes with
        # the job; anywhere else it is refused.
        private_tmp = p == REPO / "probe.txt" and REPO.is_relative_to("/tmp")
        assert f"refused {p}" in done.stdout or (private_tmp and f"WROTE {p}" in done.stdout)
    assert sandbox.TAG_VAR  # the tag the clean-up checks use is still defined
