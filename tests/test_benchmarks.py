"""The benchmark harness: its helpers, its command line, and a ``--quick`` run.

Nothing here asserts a timing: figures depend on the machine. The quick run checks that
the harness runs end to end (command line, machine, table, JSON) on the benchmarks whose
code and jobs are their own, and that each reports what it should. The others time a
lab's script, which that lab's tests launch themselves: the harness registers them, and
every record they read is one their script says it emits (the script's docstring, which
tests/test_script_contract.py holds to what it emits), so a renamed event or field fails
here without launching them again (``python -m benchmarks --quick`` runs them all).
"""

from __future__ import annotations

import ast
import json
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import REPO
from test_script_contract import documented

if str(REPO) not in sys.path:  # benchmarks/ is a folder of the repository, not installed
    sys.path.insert(0, str(REPO))

import benchmarks.__main__ as bench_main
from benchmarks import BENCHMARKS, grading, module, notebooks, time_to_accuracy
from benchmarks.__main__ import main, parse_args
from benchmarks.common import Report, Row, Settings, alternate, median, paired_ratios
from benchmarks.notebooks import discover
from benchmarks.table import (
    README_END,
    README_START,
    markdown,
    read_json,
    replace_block,
    text,
    update_readme,
    write_json,
)
from benchmarks.time_to_accuracy import figures, first_time_reaching, per_epoch


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
        ["--from-json", "a.json", "--quick"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
    assert parse_args(["--only", "loader", "--only", "ddp"]).only == ["loader", "ddp"]
    assert parse_args(["--only", "accuracy", "--readme"]).readme  # records that part only
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
    write_json(second, {**MACHINE, "cpu": "Other CPU"}, [redone], quick=False)
    with pytest.raises(SystemExit, match="another machine"):
        main(["--from-json", str(first), str(second)])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a results file"):
        main(["--from-json", str(tmp_path / "bad.json")])


def test_readme_parts_of_some_benchmarks_replace_only_their_own(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"intro\n{README_START}\n{markdown(MACHINE, _reports(), False)}\n{README_END}\n"
    )
    before = readme.read_text()
    redone = Report("ddp", "DDP")
    redone.add("speed-up", 1.8, "x", note="re-measured")
    redone.details.update(date="2030-01-02 00:00 UTC", commit="def")
    update_readme(readme, MACHINE, [redone], quick=False, partial=True)
    after = readme.read_text()
    old_parts, new_parts = before.split("\n### "), after.split("\n### ")
    assert new_parts[2] == (
        "2. DDP\n\n| measurement | value | target | | note |\n| --- | ---: | --- | --- | --- |\n"
        "| speed-up | 1.8 x |  |  | re-measured |\n\n- measured 2030-01-02 00:00 UTC, "
        "commit `def`, 0 s\n"
    )  # numbered as before, its own date and commit, no machine line (the header's)
    assert new_parts[:2] + new_parts[3:] == old_parts[:2] + old_parts[3:]  # the rest as it was
    elsewhere = {**MACHINE, "cpu": "Other CPU"}
    update_readme(readme, elsewhere, [redone], quick=False, partial=True)
    assert "- Machine: Other CPU (2 cores" in readme.read_text()  # said where it differs
    with pytest.raises(ValueError, match="no part"):
        update_readme(readme, MACHINE, [Report("new", "New")], quick=False, partial=True)


def _accuracy_report(accs: list[list[float]]) -> Report:
    """A run of the accuracy benchmark whose seed k had test accuracies accs[k] by epoch."""
    runs = [
        {
            "seed": seed,
            "args": ["--seed", str(seed), "--checkpoint", ""],
            "setup": "profile=cpu threads=2 | fmnist_cnn | batch 128x1 lr 0.05",
            "epochs": [{"val_acc": a, "time": 10.0 * (k + 1) + seed} for k, a in enumerate(row)],
        }
        for seed, row in enumerate(accs)
    ]
    report = Report(time_to_accuracy.NAME, time_to_accuracy.TITLE)
    report.details = {"threads": 2, "runs": runs, "date": "2030-01-01 00:00 UTC", "commit": "c0"}
    return report


def test_figures_give_every_epoch_of_the_runs():
    report = _accuracy_report([[0.876, 0.900, 0.9096], [0.885, 0.905, 0.9122], [0.880, 0.91, 0.91]])
    assert [e["epoch"] for e in per_epoch(report.details["runs"])] == [1, 2, 3]
    block = figures(MACHINE, report)
    assert "| 1 | 88.00 % | 87.60 – 88.50 % | 11.0 |" in block  # median, range, seconds
    assert "| 3 | 91.00 % | 90.96 – 91.22 % | 31.0 |" in block
    assert "90 % in 3 of 3 runs (after 20.0, 21.0, 22.0 s)" in block  # the first epoch there
    assert "91 % in 2 of 3 runs (after 22.0, 31.0 s)" in block
    assert "`python -m lab_utils.cli --seed 0 --checkpoint ''`" in block  # as a shell reads it
    assert "at commit `c0`" in block and "printed:** `profile=cpu threads=2 | fmnist_cnn" in block
    assert block.startswith(f"`{time_to_accuracy.REGENERATE}`")
    with pytest.raises(ValueError, match="worked"):
        figures(MACHINE, Report(time_to_accuracy.NAME, "", error="boom"))


def test_readme_records_parts_from_saved_results(tmp_path, monkeypatch):
    table, figures_in = tmp_path / "bench.md", tmp_path / "README.md"
    table.write_text(f"{README_START}\n{markdown(MACHINE, _reports(), False)}\n{README_END}\n")
    start, end = time_to_accuracy.FIGURES_START, time_to_accuracy.FIGURES_END
    figures_in.write_text(f"prose\n{start}\nold figures\n{end}\nmore prose\n")
    monkeypatch.setattr(bench_main, "README", table)
    monkeypatch.setattr(bench_main, "RECORDED", tmp_path / "recorded")
    monkeypatch.setattr(time_to_accuracy, "FIGURES_IN", figures_in)
    accuracy = _accuracy_report([[0.88, 0.91]])
    accuracy.title = "X"  # stands in the table's third part
    saved = write_json(tmp_path / "a.json", MACHINE, [accuracy], quick=False)
    assert main(["--from-json", str(saved), "--readme"]) == 0
    assert "| overhead | 1.2 % |" in table.read_text()  # the other parts stay
    assert "*FAILED: Boom: bad*" not in table.read_text()  # the part redone
    assert (
        figures_in.read_text()
        == f"prose\n{start}\n{figures(MACHINE, accuracy)}\n{end}\nmore prose\n"
    )
    _, [recorded], quick = read_json(tmp_path / "recorded" / "accuracy.json")
    assert recorded == accuracy and not quick
    write_json(saved, MACHINE, [accuracy], quick=True)
    with pytest.raises(SystemExit, match="not --quick"):
        main(["--from-json", str(saved), "--readme"])


def test_readme_quotes_the_recorded_trainer_run(tmp_path):
    """The figures README.md and benchmarks/README.md show for the command-line trainer
    are those of the run recorded in benchmarks/recorded/accuracy.json: regenerating them
    from it changes nothing. A figure edited by hand, or a table or block left over from
    another run, fails here; so does a README whose command would not regenerate them."""
    machine, [report], quick = read_json(bench_main.RECORDED / "accuracy.json")
    assert report.name == "accuracy" and not quick and not report.error and not report.skipped
    readme, table = tmp_path / "README.md", tmp_path / "bench.md"
    shutil.copy(REPO / "README.md", readme)
    shutil.copy(bench_main.README, table)
    replace_block(
        readme,
        time_to_accuracy.FIGURES_START,
        time_to_accuracy.FIGURES_END,
        figures(machine, report),
    )
    update_readme(table, machine, [report], quick=False, partial=True)
    assert readme.read_text() == (REPO / "README.md").read_text()
    assert table.read_text() == bench_main.README.read_text()
    command = shlex.split(time_to_accuracy.REGENERATE)
    assert command[:3] == ["python", "-m", "benchmarks"]
    args = parse_args(command[3:])
    assert args.readme and args.only == ["accuracy"] and not args.quick


def test_every_benchmark_module_has_the_interface():
    for name in BENCHMARKS:
        mod = module(name)
        assert name == mod.NAME and mod.TITLE and callable(mod.run)


def test_the_list_names_every_benchmark(capsys):
    """``python -m benchmarks --list`` (benchmarks/README.md), in this process: the quick
    run below starts ``python -m benchmarks`` from the root as a reader does."""
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(BENCHMARKS)
    assert all(module(name).TITLE in line for name, line in zip(BENCHMARKS, lines))


# Run end to end by the quick run: what the harness measures itself (the trainer, the
# loader, the accuracy curve, the all-reduce, the notebooks' timing, the cost model) and
# the grading of its own tiny job. The others launch a lab's script (the one their
# `SCRIPT`/`SCRIPTS` name), which that lab's tests run: see LAB_SCRIPTS.
QUICK_RUN = ["trainer", "loader", "accuracy", "allreduce", "notebooks", "grading", "lab6_cost"]
LAB_SCRIPTS = [name for name in BENCHMARKS if name not in QUICK_RUN]


def _scripts_named(name: str) -> list[Path]:
    """The lab scripts a benchmark's module launches: each ``*.py`` it names that one
    lab's ``scripts/`` folder holds."""
    source = Path(module(name).__file__).read_text(encoding="utf-8")
    names = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.endswith(".py")
    }
    return sorted(p for n in names for p in REPO.glob(f"labs/*/scripts/{n}"))


def _is_index(node: ast.AST) -> bool:
    """``0``, ``-1``: a position in a list, not a field's name."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def records_read(source: str) -> dict[str, set[str]]:
    """The records a benchmark reads from a launch's result, with the fields it takes from
    them: ``x.event("name")`` and ``x.events("name")``, and ``["field"]`` or
    ``.get("field")`` on that call, on a name given it in the same function, or on the
    loop name of a comprehension over ``.events``."""
    read: dict[str, set[str]] = {}

    def event_of(call: ast.AST) -> str | None:
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("event", "events")
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            return call.args[0].value
        return None

    for scope in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]:
        names: dict[str, str] = {}
        for node in ast.walk(scope):
            if (event := event_of(node)) is not None:
                read.setdefault(event, set())
            if isinstance(node, ast.Assign) and (event := event_of(node.value)):
                names.update((t.id, event) for t in node.targets if isinstance(t, ast.Name))
            loop = isinstance(node, ast.comprehension) and isinstance(node.target, ast.Name)
            if loop and (event := event_of(node.iter)):
                names[node.target.id] = event
        for node in ast.walk(scope):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                value, field = node.value, node.slice.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                value, field = node.func.value, node.args[0].value
            else:
                continue
            if isinstance(value, ast.Subscript) and _is_index(value.slice):
                value = value.value  # one record of a list: .events(...)[-1]
            event = event_of(value)
            if event is None and isinstance(value, ast.Name):
                event = names.get(value.id)
            if event is not None and isinstance(field, str):
                read[event].add(field)
    return read


def test_the_record_reader_finds_events_and_fields():
    source = (
        "def f(job):\n"
        "    a = job.event('one')['x']\n"
        "    t = job.event('two')\n"
        "    b = t['y'] + t.get('z')\n"
        "    runs = {r['k']: r for r in job.events('three')}\n"
        "    last = job.events('four')\n"
        "    return runs['not a field'], last[-1].get('w')\n"
    )
    assert records_read(source) == {
        "one": {"x"},
        "two": {"y", "z"},
        "three": {"k"},
        "four": {"w"},
    }


def unlisted_reads(source: str, scripts: list[Path]) -> list[str]:
    """What ``source`` reads that none of ``scripts`` lists as emitted (``event`` or
    ``event.field``)."""
    listed: dict[str, set[str]] = {}
    for script in scripts:
        for event, fields in documented(script).items():
            listed.setdefault(event, set()).update(fields)
    missing = []
    for event, fields in sorted(records_read(source).items()):
        if event not in listed:
            missing.append(event)
        else:
            missing += [f"{event}.{field}" for field in sorted(fields - listed[event])]
    return missing


@pytest.mark.parametrize("name", LAB_SCRIPTS)
def test_a_benchmark_of_a_lab_script_reads_what_the_script_emits(name):
    """Every record (and field) the benchmark reads is one its script lists as emitted."""
    scripts = _scripts_named(name)
    assert scripts, f"{name}: names no script of a lab's scripts/ folder"
    source = Path(module(name).__file__).read_text(encoding="utf-8")
    missing = unlisted_reads(source, scripts)
    assert not missing, f"{name} reads what {[s.name for s in scripts]} do not emit: {missing}"


def test_a_read_the_script_does_not_emit_fails():
    ddp = [REPO / "labs" / "lab2_data_parallel" / "scripts" / "train_ddp.py"]
    read = "def f(job):\n    return job.event('{}')['{}']\n"
    assert unlisted_reads(read.format("summary", "samples_per_s"), ddp) == []
    assert unlisted_reads(read.format("summary", "images_per_s"), ddp) == ["summary.images_per_s"]
    assert unlisted_reads(read.format("totals", "samples_per_s"), ddp) == ["totals"]


@pytest.mark.slow
@pytest.mark.launcher
def test_quick_run_of_the_harness(tmp_path):
    out = tmp_path / "bench.json"
    only = [a for name in QUICK_RUN for a in ("--only", name)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", *only, "--json", str(out)],
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
    assert list(reports) == QUICK_RUN
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
    assert "check notebook" in metrics["notebooks"]
    assert "budget / time" in metrics["grading"]
