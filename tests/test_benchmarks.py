"""The benchmark harness: its helpers, its command line, and a full ``--quick`` run.

Nothing here asserts a timing: figures depend on the machine. The quick run checks
that every benchmark still runs end to end and reports what it should.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import nbformat
import pytest
from conftest import REPO

if str(REPO) not in sys.path:  # benchmarks/ is a folder of the repository, not installed
    sys.path.insert(0, str(REPO))

from benchmarks import BENCHMARKS, grading, module, notebooks
from benchmarks.__main__ import main, parse_args
from benchmarks.common import Report, Row, Settings, alternate, median, paired_ratios
from benchmarks.notebooks import discover
from benchmarks.table import (
    README_END,
    README_START,
    markdown,
    text,
    update_readme,
    write_json,
)
from benchmarks.time_to_accuracy import first_time_reaching


def test_alternate_reverses_order_each_round_and_drops_warmup():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name) or 1.0) for name in "AB"}
    times = alternate(contenders, rounds=3, warmup=1)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert times == {"A": [1.0, 1.0, 1.0], "B": [1.0, 1.0, 1.0]}


def test_alternate_times_the_call_when_the_contender_returns_none():
    times = alternate({"sleep": lambda: __import__("time").sleep(0.01)}, rounds=2, warmup=0)
    assert len(times["sleep"]) == 2 and all(t >= 0.009 for t in times["sleep"])
    with pytest.raises(ValueError, match="rounds"):
        alternate({"x": lambda: 0.0}, rounds=0)


def test_ratios_and_median():
    assert paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        median([])


def test_settings_rounds_and_threads():
    assert Settings(quick=True).rounds(full=9) == 1
    assert Settings().rounds(full=9) == 9
    assert Settings(repeats=2).rounds(full=9) == 2
    assert Settings(quick=True).threads == 1


@pytest.mark.parametrize(
    "value, unit, shown",
    [
        (1234.5, "img/s", "1,234 img/s"),
        (12.345, "s", "12.3 s"),
        (1.5, "x", "1.5 x"),
        (0.0012, "", "0.0012"),
        (None, "s", "n/a"),
        (3.0, "%", "3 %"),
    ],
)
def test_row_formatting(value, unit, shown):
    assert Row("m", value, unit).formatted_value() == shown


def test_first_time_reaching_a_threshold():
    epochs = [
        {"val_acc": 0.88, "time": 10.0},
        {"val_acc": 0.905, "time": 20.0},
        {"val_acc": 0.912, "time": 30.0},
    ]
    assert first_time_reaching(epochs, 0.90) == 20.0
    assert first_time_reaching(epochs, 0.91) == 30.0
    assert first_time_reaching(epochs, 0.95) is None


def test_discover_finds_notebooks_but_not_checkpoint_copies(tmp_path):
    for rel in ("lab1/a.ipynb", "lab2/b.ipynb", "lab2/.ipynb_checkpoints/b-checkpoint.ipynb"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nbformat.v4.new_notebook(), tmp_path / rel)
    assert [p.relative_to(tmp_path).as_posix() for p in discover(tmp_path)] == [
        "lab1/a.ipynb",
        "lab2/b.ipynb",
    ]


def test_a_failing_notebook_is_reported_and_the_others_still_timed(monkeypatch):
    good, bad = notebooks.LABS / "lab9" / "good.ipynb", notebooks.LABS / "lab9" / "bad.ipynb"
    monkeypatch.setattr(notebooks, "discover", lambda: [bad, good])

    def fake_execute(path, env, cell_timeout=600):
        assert env["LABS_PROFILE"] == "quick" and env["LABS_SOLUTIONS"] == "1"
        if path == bad:
            raise RuntimeError("cell 3 raised\nZeroDivisionError: division by zero")
        return 1.5

    monkeypatch.setattr(notebooks, "execute", fake_execute)
    report = notebooks.run(Settings(repeats=2))
    rows = {row.metric: row for row in report.rows}
    assert rows["lab9/good.ipynb"].value == 1.5
    assert rows["lab9/bad.ipynb"].value is None
    assert "ZeroDivisionError" in rows["lab9/bad.ipynb"].note
    assert "lab9/bad.ipynb" in report.error


def test_grading_sets_each_time_against_the_real_budget(monkeypatch):
    seconds = {
        "reference_ddp.py": [60.0, 64.0],
        "starter.py": [90.0, 100.0],
        "reference_horovod.py": [80.0, 70.0],
    }
    graded = []

    def fake(script, target, launcher):
        graded.append((script.name, launcher, target.budget_s))
        return seconds[script.name].pop(0), 0.92 if script.name != "starter.py" else 0.912

    monkeypatch.setattr(grading, "graded_seconds", fake)
    monkeypatch.setattr(grading, "fashion_mnist", lambda: None)
    monkeypatch.setattr(grading, "horovod_problem", lambda: "")
    report = grading.run(Settings(repeats=2))
    real = grading.targets.load("cpu-2proc")
    assert {b for _, _, b in graded} == {real.budget_s * 4}  # widened: every run is timed
    assert ("reference_horovod.py", "mpirun", real.budget_s * 4) in graded
    rows = {row.metric.split(":")[0]: row for row in report.rows}
    assert rows["reference DDP (torchrun)"].value == pytest.approx(real.budget_s / 62.0)
    assert rows["starter (torchrun)"].value == pytest.approx(95.0 / real.budget_s)
    assert rows["reference Horovod (mpirun)"].value == pytest.approx(real.budget_s / 75.0)
    for row in report.rows:  # each verdict follows from the figure and the 1.1x margin
        assert row.met == (row.value >= grading.MIN_ROOM)


def test_quick_grading_grades_the_tiny_job_on_the_standin(monkeypatch):
    graded = []

    def fake(script, target, launcher):
        graded.append((script, target, launcher))
        return 9.0, 0.2

    monkeypatch.setattr(grading, "graded_seconds", fake)
    report = grading.run(Settings(quick=True))
    standin = grading.targets.load("cpu-cifar-standin")
    [(script, target, launcher)] = graded  # one grading, of the job of a few seconds
    assert (script, launcher) == (grading.TINY_JOB, "torchrun")
    assert (target.dataset, target.archs) == (standin.dataset, ("linear",))
    assert target.accuracy == grading.QUICK_ACCURACY < 0.2
    assert target.budget_s > standin.budget_s  # widened: the job is timed to its end
    [row] = report.rows
    assert row.metric.startswith("tiny DDP job (torchrun): budget / time")
    assert row.value == pytest.approx(standin.budget_s / 9.0)


def _reports() -> list[Report]:
    ok = Report("trainer", "Trainer | bare")
    ok.add("overhead", 1.2, "%", target="<= 3 %", met=True, note="a|b")
    return [ok, Report("ddp", "DDP", skipped="no Horovod"), Report("x", "X", error="Boom: bad")]


MACHINE = {
    "date": "2030-01-01 00:00 UTC",
    "cpu": "Test CPU",
    "logical_cpus": 2,
    "physical_cores": 2,
    "memory_gib": 4.0,
    "torch_threads": 2,
    "device": "cpu",
    "torch": "2.x",
    "horovod": "",
    "python": "3.11",
    "os": "Linux",
    "commit": "abc",
    "load_average_start": (0.5, 0.4, 0.3),
    "load_average_end": (0.6, 0.5, 0.4),
}


def test_tables_show_values_skips_and_failures():
    plain = text(MACHINE, _reports(), quick=True)
    assert "Test CPU (2 cores / 2 threads" in plain and "QUICK MODE" in plain
    assert "1.2 %" in plain and "met" in plain
    assert "skipped: no Horovod" in plain and "FAILED: Boom: bad" in plain
    md = markdown(MACHINE, _reports(), quick=False)
    assert "| overhead | 1.2 % | <= 3 % | ✔ | a\\|b |" in md  # pipes escaped
    assert "0.5/0.4/0.3 at the start" in md


def test_update_readme_replaces_only_the_results_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\nintro\n{README_START}\nold\n{README_END}\nfooter\n")
    update_readme(readme, MACHINE, _reports(), quick=False)
    new = readme.read_text()
    assert new.startswith("# Title\nintro\n") and new.endswith(f"{README_END}\nfooter\n")
    assert "old" not in new and "| overhead |" in new
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="section"):
        update_readme(readme, MACHINE, _reports(), quick=False)


def test_command_line_rejects_bad_arguments(capsys):
    for argv in (
        ["--only", "nope"],
        ["--repeats", "0"],
        ["--readme", "--quick"],
        ["--readme", "--only", "loader"],
        ["--from-json", "a.json", "--quick"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
    assert parse_args(["--only", "loader", "--only", "ddp"]).only == ["loader", "ddp"]
    with pytest.raises(ValueError, match="unknown benchmark"):
        module("nope")


def test_results_saved_as_json_can_be_shown_and_combined(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    write_json(first, MACHINE, _reports()[:1], quick=False)
    redone = Report("trainer", "Trainer | bare")
    redone.add("overhead", 0.7, "%", target="<= 3 %", met=True)
    write_json(second, MACHINE, [redone, _reports()[1]], quick=False)
    assert main(["--from-json", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "0.7 %" in out and "1.2 %" not in out  # the later file wins
    assert "skipped: no Horovod" in out
    with pytest.raises(SystemExit, match="missing: loader"):  # README needs every benchmark
        main(["--from-json", str(first), "--readme"])
    write_json(second, {**MACHINE, "cpu": "Other CPU"}, [redone], quick=False)
    with pytest.raises(SystemExit, match="another machine"):
        main(["--from-json", str(first), str(second)])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a results file"):
        main(["--from-json", str(tmp_path / "bad.json")])


def test_every_benchmark_module_has_the_interface():
    for name in BENCHMARKS:
        mod = module(name)
        assert name == mod.NAME and mod.TITLE and callable(mod.run)


@pytest.mark.slow
@pytest.mark.launcher
def test_quick_run_of_every_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Machine:" in proc.stdout and "QUICK MODE" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    for key in ("cpu", "physical_cores", "logical_cpus", "torch", "torch_threads", "device"):
        assert doc["machine"][key] not in (None, ""), key
    reports = {r["name"]: r for r in doc["benchmarks"]}
    assert list(reports) == list(BENCHMARKS)
    for name, r in reports.items():
        assert not r["error"], f"{name}: {r['error']}"
        if r["skipped"]:
            continue
        assert r["rows"], name
        measured = [row["value"] for row in r["rows"] if row["value"] is not None]
        assert measured and all(math.isfinite(v) for v in measured), (name, r["rows"])
    # What each benchmark must report when it runs.
    metrics = {name: " | ".join(row["metric"] for row in r["rows"]) for name, r in reports.items()}
    assert "Trainer overhead" in metrics["trainer"]
    assert "speed-up vs the faster DataLoader" in metrics["loader"]
    assert "time to 91% test accuracy" in metrics["accuracy"]
    assert "largest relative difference" in metrics["allreduce"]
    assert reports["allreduce"]["details"]["2_procs"][0]["max_rel_err"] < 1e-5
    if not reports["ddp"]["skipped"]:
        assert "DDP speed-up, 2 vs 1 process" in metrics["ddp"]
    assert "check notebook" in metrics["notebooks"]
    assert "budget / time" in metrics["grading"]
