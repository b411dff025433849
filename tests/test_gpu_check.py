"""The GPU check (``python -m benchmarks.gpu_check``): its harness, its table, its CPU form.

The GPU run itself needs a GPU; here the harness's logic is tested on small processes
that fail, hang or succeed on purpose, and the CPU form runs a representative subset of
the real paths (a measured Lab 2 script, Lab 6's probe, a two-rank Gloo script, NCCL's
refusal, a notebook) end to end, so the check cannot rot between GPU machines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

if str(REPO) not in sys.path:  # benchmarks/ is a folder of the repository, not installed
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import bundle, catalogue, report
from benchmarks.gpu_check.harness import (
    FAILED,
    NO_TIME,
    PASSED,
    SKIPPED,
    Check,
    Deadline,
    Result,
    error_tail,
    judge,
    run_all,
    run_check,
)
from benchmarks.notebooks import quick_notebook
from lab_utils import dist as labdist
from lab_utils import launch


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(body)
    return str(path)


FAILS = """
import sys
print("step 1 ok", flush=True)
print("step 2 ok", flush=True)
raise ValueError("boom: the third step")
"""


def test_a_failing_path_shows_its_last_error_lines(tmp_path):
    check = Check("fails", "g", "fails on purpose", script=script(tmp_path, FAILS))
    (r,) = run_check(check, tmp_path, Deadline(60))
    assert r.status == FAILED
    assert r.reason == "ValueError: boom: the third step"
    assert "Traceback (most recent call last)" in r.error and r.error.endswith(
        "ValueError: boom: the third step"
    )
    assert "boom" in (tmp_path / "logs" / "fails.log").read_text()  # the whole output kept


def test_the_cause_is_found_above_the_launchers_summary():
    out = "\n".join(
        [
            "[rank 0] Traceback (most recent call last):",
            '[rank 0]   File "x.py", line 3, in <module>',
            "[rank 0] RuntimeError: the real cause",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "==========",
            "  exitcode  : 1",
        ]
    )
    assert error_tail(out).splitlines()[-1] == "[rank 0] RuntimeError: the real cause"
    assert error_tail("[rank 0] error: --tp 2 does not divide 1\nmore") == (
        "[rank 0] error: --tp 2 does not divide 1"
    )


def test_a_path_past_the_deadline_is_skipped_with_no_time_left(tmp_path):
    clock = iter([0.0, 95.0]).__next__  # created at 0, asked at 95 of a 100 s budget
    check = Check("late", "g", "never starts", script=script(tmp_path, "print(1)"), min_seconds=10)
    (r,) = run_check(check, tmp_path, Deadline(100, clock=clock))
    assert r.status == SKIPPED and r.reason.startswith(NO_TIME)
    assert not (tmp_path / "logs" / "late.log").exists()  # it never ran


def test_the_deadline_stops_a_running_path_and_its_own_timeout_fails_it(tmp_path):
    sleeper = script(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    cut = Check("cut", "g", "sleeps", script=sleeper, timeout=60, min_seconds=1)
    start = time.monotonic()
    (r,) = run_check(cut, tmp_path, Deadline(2.5))
    assert r.status == SKIPPED and r.reason.startswith(
        f"{NO_TIME}: stopped at the check's deadline"
    )
    assert time.monotonic() - start < 30
    hang = Check("hang", "g", "sleeps", script=sleeper, timeout=1.5, min_seconds=1)
    (r,) = run_check(hang, tmp_path, Deadline(60))
    assert r.status == FAILED and r.reason.startswith("timed out")


def test_a_known_limit_is_a_skip_with_its_line_and_anything_else_a_failure(tmp_path):
    limit = 'raise RuntimeError("ProcessGroupGloo does not support reduce_scatter on CUDA")'
    check = Check(
        "gloo", "g", "x", script=script(tmp_path, limit), known_limits=catalogue.GLOO_LIMITS
    )
    (r,) = run_check(check, tmp_path, Deadline(60))
    assert r.status == SKIPPED
    assert r.reason.startswith("PyTorch's Gloo does not run this on CUDA tensors: RuntimeError:")
    check.script = script(tmp_path, 'raise RuntimeError("CUDA error: illegal memory access")')
    (r,) = run_check(check, tmp_path, Deadline(60))
    assert r.status == FAILED and "illegal memory access" in r.reason


def test_an_expected_refusal_passes_only_with_its_message(tmp_path):
    said = 'raise SystemExit("error: NCCL needs one GPU per rank")'
    check = Check("refusal", "g", "x", script=script(tmp_path, said), expect_failure="NCCL needs")
    assert run_check(check, tmp_path, Deadline(60))[0].status == PASSED
    check.script = script(tmp_path, 'raise SystemExit("some other error")')
    assert run_check(check, tmp_path, Deadline(60))[0].status == FAILED
    check.script = script(tmp_path, "print('ran')")
    assert run_check(check, tmp_path, Deadline(60))[0].status == FAILED


def test_run_all_runs_measured_paths_first_then_the_rest_in_order(tmp_path):
    started: list[str] = []

    def fake(check: Check, out: Path, deadline: Deadline) -> list[Result]:
        started.append(check.name)
        return [Result(check.name, check.group, check.what, PASSED)]

    checks = [Check("a", "g", ""), Check("m", "g", "", exclusive=True), Check("b", "g", "")]
    checks.append(Check("c", "g", ""))
    results = run_all(checks, tmp_path, Deadline(60), jobs=1, run=fake)
    assert started == ["m", "a", "b", "c"]
    assert [r.name for r in results] == ["a", "m", "b", "c"]  # the catalogue's order


def _results() -> list[Result]:
    return [
        Result("lab2.serial", "Lab 2", "w", PASSED, 3.2, numbers={"images/s": 1234.5, "mfu": 0.31}),
        Result("lab6.fp16", "Lab 6", "w", SKIPPED, reason="no CUDA"),
        Result(
            "nb.x",
            "nb",
            "w",
            FAILED,
            1.0,
            reason="ValueError: bad | pipe",
            error="a\nValueError: bad | pipe",
        ),
        Result("nb.y", "nb", "w", SKIPPED, reason=f"{NO_TIME} (3 s of the budget left)"),
    ]


def test_the_json_and_the_markdown_say_the_same(tmp_path):
    results = _results()
    j, m = report.write(tmp_path, {"device": "cpu"}, results)
    info, back = report.read_json(j)
    assert info == {"device": "cpu"} and back == results
    text = m.read_text()
    assert report.read_markdown_rows(text) == [(r.name, r.status) for r in results]
    assert json.loads(j.read_text())["counts"] == {PASSED: 1, FAILED: 1, SKIPPED: 2}
    assert "1 passed, 1 failed, 2 skipped (4 paths)" in text
    assert "images/s 1234" in text and "ValueError: bad \\| pipe" in text  # a | stays in its cell
    assert "```\na\nValueError: bad | pipe\n```" in text  # the failed path's last lines


def test_labs_backend_switches_the_default_backend(monkeypatch):
    assert labdist.backend_override({}) is None
    assert labdist.backend_override({"LABS_BACKEND": " Gloo "}) == "gloo"
    with pytest.raises(ValueError, match="LABS_BACKEND='mpi' is not one of gloo, nccl"):
        labdist.backend_override({"LABS_BACKEND": "mpi"})
    monkeypatch.setenv("LABS_BACKEND", "nccl")
    assert labdist.backend_override() == "nccl"


def test_a_wheel_unpacks_into_an_import_tree(tmp_path):
    whl = tmp_path / "wheels" / "demo_pkg-1.0-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo_pkg/__init__.py", "VALUE = 42\n")
        z.writestr("demo_pkg-1.0.dist-info/METADATA", "Name: demo-pkg\nVersion: 1.0\n")
        z.writestr("demo_pkg-1.0.data/purelib/demo_extra.py", "X = 1\n")
        z.writestr("demo_pkg-1.0.data/data/share/jupyter/kernel.json", "{}")
    (tmp_path / "manifest.json").write_text(json.dumps({"python": "2.7"}))
    assert "for Python 2.7" in bundle.unpack(tmp_path, tmp_path / "site")["problem"]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tmp_path / "manifest.json").write_text(json.dumps({"python": here}))
    got = bundle.unpack(tmp_path, tmp_path / "site")
    assert got["problem"] == "" and got["unpacked"] == ["demo-pkg"]
    site = tmp_path / "site"
    assert (site / "demo_pkg" / "__init__.py").is_file() and (site / "demo_extra.py").is_file()
    assert not (site / "share").exists()
    out = subprocess.run(
        [sys.executable, "-c", "import demo_pkg, demo_extra; print(demo_pkg.VALUE)"],
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "42", out.stderr
    assert "no bundle" in bundle.unpack(tmp_path / "none", tmp_path / "s2")["problem"]


# ------------------------------------------------------------------ the CPU form, end to end
CPU_FORM = [
    "lab2.serial.cifar",
    "lab6.probe",
    "lab4.tensor_parallel.2",
    "lab2.nccl_two_ranks_refused",
    "nb.*",
]


@pytest.fixture(scope="module")
def cpu_form(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    nb = quick_notebook(tmp)
    out = tmp / "out"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--cpu",
        "--out",
        str(out),
        "--budget",
        "240",
    ]
    cmd += [a for name in CPU_FORM for a in ("--only", name)] + [
        "--notebooks",
        str(nb),
        "--jobs",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.slow
@pytest.mark.launcher
def test_the_cpu_form_runs_the_real_paths_and_writes_the_table(cpu_form):
    proc, out = cpu_form
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info, results = report.read_json(out / report.JSON_NAME)
    by = {r.name: r for r in results}
    assert info["form"].startswith("CPU form") and info["device"] == "cpu"
    assert list(by) == [
        "lab2.serial.cifar",
        *(f"lab6.{p}" for p in ("bf16", "fp16_scaler", "recompute_memory", "mfu", "trace")),
        "lab2.nccl_two_ranks_refused",
        "lab4.tensor_parallel.2",
        "nb.harness_check",
    ]
    lab2 = by["lab2.serial.cifar"]
    assert lab2.status == PASSED and lab2.numbers["images/s"] > 0 and lab2.numbers["steps"] == 3
    assert lab2.numbers["GFLOP/image"] > 0  # counted by FlopCounterMode
    assert (
        by["lab6.bf16"].status == PASSED and by["lab6.bf16"].numbers["logits_dtype"] == "bfloat16"
    )
    for part in ("fp16_scaler", "recompute_memory"):
        assert by[f"lab6.{part}"].status == SKIPPED and by[f"lab6.{part}"].reason.startswith(
            "no CUDA"
        )
    assert by["lab6.trace"].status == PASSED and by["lab6.trace"].numbers["steps"] == 3
    assert by["lab2.nccl_two_ranks_refused"].reason == "no CUDA"
    tp = by["lab4.tensor_parallel.2"]
    assert tp.status == PASSED and "LABS_BACKEND=gloo" in tp.backend
    assert tp.numbers["procs"] == 2 and tp.numbers["weights_rel_err"] < 1e-4
    assert by["nb.harness_check"].status == PASSED
    rows = report.read_markdown_rows((out / report.MARKDOWN_NAME).read_text())
    assert rows == [(r.name, r.status) for r in results]
    assert (out / "logs" / "lab6.probe.log").is_file()
    assert not (out / "work").exists()  # what the paths wrote stayed in the scratch folder


def test_every_path_of_a_gpu_run_is_named_once(tmp_path):
    ctx = catalogue.Context(scratch=tmp_path, cpu=False, cuda=True, gpus=1, notebooks=[])
    names = [c.name for c in catalogue.all_checks(ctx)]
    assert len(names) == len(set(names))
    assert names[:4] == [
        "lab2.serial.cifar",
        "lab2.ddp.cifar",
        "lab2.serial.fmnist",
        "lab2.ddp.fmnist",
    ]
    two = [c for c in catalogue.two_ranks(ctx) if not c.skip and not c.expect_failure]
    assert two and all(c.env.get("LABS_BACKEND") == "gloo" and c.nprocs == 2 for c in two)
    refusal = next(c for c in catalogue.two_ranks(ctx) if c.expect_failure)
    assert "LABS_BACKEND" not in refusal.env  # NCCL's own refusal, no override
    gpu_lab2 = catalogue.lab2_measured(ctx)[0]
    assert gpu_lab2.env["LABS_PROFILE"] == "gpu" and gpu_lab2.exclusive


def test_the_cause_is_found_behind_torchs_own_rank_tag():
    # torch prints a rank's exception as "[rank0]: ...", and launch tags it again
    out = "\n".join(
        [
            "[rank 0] [rank0]:     work = group.allreduce([tensor], opts)",
            "[rank 0] [rank0]: RuntimeError: No backend type associated with device type cpu",
            "[rank 0] step 2: loss 4.468",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        ]
    )
    assert error_tail(out).splitlines()[-1].endswith("device type cpu")


def test_a_fatal_signal_shows_the_stack_faulthandler_printed_after_it():
    out = "\n".join(
        [
            "[rank 0] Fatal Python error: Segmentation fault",
            "[rank 0] Thread 0x7f (most recent call first):",
            '[rank 0]   File "/x/torch/distributed/_functional_collectives.py", line 138 in wait_tensor',
            '[rank 0]   File "/x/tensor_parallel.py", line 110 in full',
            "  exitcode  : -11 (pid: 1455)",
        ]
    )
    tail = error_tail(out, n=3)
    assert tail.splitlines()[0] == "[rank 0] Fatal Python error: Segmentation fault"
    assert "wait_tensor" in tail and "exitcode" not in tail


def _failed_job(lines: list[str]) -> launch.LaunchResult:
    return launch.LaunchResult(["x"], 1, 1.0, lines=[(0, line) for line in lines])


@pytest.mark.parametrize(
    "line, limit",
    [
        (
            "RuntimeError: [gloo/transport/tcp/pair.cc:339] writev [127.0.0.1]:3: Bad address",
            "point to point",
        ),
        ('  File "/t/distributed/_functional_collectives.py", line 138 in wait_tensor', "SIGSEGV"),
    ],
)
def test_gloos_limits_on_cuda_tensors_seen_on_a_gpu_are_skips(line, limit):
    check = Check("p", "g", "w", script="s.py", known_limits=catalogue.GLOO_LIMITS)
    status, reason = judge(
        check, _failed_job(["Fatal Python error: Segmentation fault", line]), False
    )
    assert status == SKIPPED and limit in reason


def test_a_python_traceback_through_functional_collectives_is_no_known_limit():
    # a Python exception's frame reads 'line N, in f' (commas): a bug of ours, not Gloo's crash
    check = Check("p", "g", "w", script="s.py", known_limits=catalogue.GLOO_LIMITS)
    line = '  File "/t/distributed/_functional_collectives.py", line 138, in wait_tensor'
    status, _ = judge(check, _failed_job([line, "ValueError: ours"]), False)
    assert status == FAILED


def test_notebooks_that_need_what_a_one_gpu_machine_lacks_are_skips():
    check = Check("nb", "g", "w", script="s.py", known_limits=catalogue.NOTEBOOK_LIMITS)
    for line, why in [
        ("LaunchError: horovodrun is not installed (looked beside python3 and on PATH)", "Horovod"),
        ("SparkClusterError: Spark needs Java 17 or newer", "Java"),
        (
            "RuntimeError: 2 ranks on this machine but 1 GPU(s): NCCL needs one GPU per rank.",
            "NCCL",
        ),
    ]:
        status, reason = judge(check, _failed_job([line]), False)
        assert status == SKIPPED and why in reason, line


@pytest.mark.slow
def test_a_notebook_whose_launched_rank_hit_a_known_limit_is_a_skip(tmp_path):
    # A notebook's launch prints its ranks' output into the cell, and the exception that
    # ends the cell (a LaunchError) may show only the launcher's summary. The notebook path
    # must pass on all the cell printed, or a known limit reads as a failure (seen on an
    # H200: two-rank notebooks over Gloo on CUDA tensors, a rank's error 6,000 characters
    # above the end).
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            # reversed in the source: the error's text quotes the cell's source
            f"print({'[rank 1] RuntimeError: writev [127.0.0.1]:3: Bad address'[::-1]!r}[::-1])\n"
            "for i in range(400):\n"
            "    print(f'[rank 0] what rank 0 went on printing, line {i}')\n"
            "raise RuntimeError('the job exited with status 1. Last output: exitcode  : 1')"
        )
    ]
    path = tmp_path / "limit.ipynb"
    nbformat.write(nb, path)
    check = Check(
        "nb",
        "g",
        "w",
        script="benchmarks.gpu_check.notebook",
        module=True,
        args=[str(path)],
        known_limits=catalogue.GLOO_LIMITS,
    )
    (r,) = run_check(check, tmp_path, Deadline(120))
    assert r.status == SKIPPED and "point to point" in r.reason, (r.status, r.reason)
