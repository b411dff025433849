"""The suite's cost recorder (benchmarks/suite_cpu.py): what it records of a test, the
tables it makes of a recording, and the order file tests/conftest.py reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, SUITE_COSTS

from benchmarks import suite_cpu

pytest_plugins = ["pytester"]


def test_a_test_is_recorded_with_its_cpu_wall_and_launches(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("LABS_SUITE_CPU", str(tmp_path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(
        test_spin="""
        import time

        def test_spins():
            print("$ torchrun --nproc-per-node 2 /tmp/abc/job.py --out /tmp/abc/x.pt")
            print("not a command")
            end = time.process_time() + 0.5
            while time.process_time() < end:
                pass

        def test_idle():
            time.sleep(0.3)
        """
    )
    pytester.runpytest_inprocess("-p", "benchmarks.suite_cpu").assert_outcomes(passed=2)
    rows = {
        r["test"]: r
        for r in map(json.loads, (tmp_path / "main.jsonl").read_text().split("\n")[:-1])
    }
    spins, idle = rows["test_spin.py::test_spins"], rows["test_spin.py::test_idle"]
    # os.times counts in clock ticks: a 0.5 s spin reads a little over or under 0.5
    assert spins["cpu_s"] >= 0.4 and spins["launched"] == [
        "torchrun --nproc-per-node 2 /tmp/abc/job.py --out /tmp/abc/x.pt"
    ]
    assert idle["wall_s"] >= 0.3 and idle["cpu_s"] < 0.2 and idle["launched"] == []


def write_recording(folder: Path, rows: list[dict]) -> None:
    folder.mkdir()
    (folder / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tables_repeats_and_costs_of_a_recording(tmp_path, capsys):
    rec = tmp_path / "rec"
    job = "LABS_PROFILE=quick torchrun --nproc-per-node 2 scripts/a.py --out {}"
    write_recording(
        rec,
        [
            {
                "test": "tests/test_a.py::t1",
                "cpu_s": 3.0,
                "wall_s": 1.0,
                "launched": [job.format("/tmp/x/1.pt")],
            },
            {
                "test": "tests/test_a.py::t2",
                "cpu_s": 1.0,
                "wall_s": 5.0,
                # one test's own repeat of a job (a killed run, then its resumption)
                "launched": [job.format("/tmp/z/3.pt").replace("a.py", "c.py")] * 2,
            },
            {
                "test": "tests/test_b.py::t1",
                "cpu_s": 2.0,
                "wall_s": 2.0,
                "launched": [job.format("/tmp/y/2.pt")],
            },
        ],
    )
    assert suite_cpu.by_module(rec) == {"tests/test_a.py": 4.0, "tests/test_b.py": 2.0}
    assert suite_cpu.by_module(rec, "wall_s") == {"tests/test_a.py": 6.0, "tests/test_b.py": 2.0}
    # the same job from two tests, its temporary paths aside; one test's own repeats are
    # not a job several tests start
    assert suite_cpu.repeated(rec) == [
        (job.format("…"), ["tests/test_a.py::t1", "tests/test_b.py::t1"])
    ]
    costs = tmp_path / "costs.json"
    suite_cpu.main([str(rec), "--top", "1", "--write-costs", str(costs)])
    out = capsys.readouterr().out
    assert "| tests/test_a.py | 4 | 67% |" in out and "test_b" not in out.split("whole")[0]
    assert list(json.loads(costs.read_text()).items()) == [
        ("tests/test_a.py", 6.0),
        ("tests/test_b.py", 2.0),
    ]


def test_a_recording_without_wall_times_cannot_write_costs(tmp_path):
    write_recording(tmp_path / "old", [{"test": "tests/test_a.py::t", "cpu_s": 1.0}])
    with pytest.raises(SystemExit, match="without wall_s"):
        suite_cpu.by_module(tmp_path / "old", "wall_s")


def test_the_order_file_names_modules_that_exist():
    """A module renamed or removed would keep a stale cost: the next recording rewrites
    the file, and until then its name must not linger."""
    costs = json.loads(SUITE_COSTS.read_text())
    assert costs and all((REPO / m).is_file() for m in costs), [
        m for m in costs if not (REPO / m).is_file()
    ]
