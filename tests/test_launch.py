import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from importlib import metadata

import pytest
from conftest import JOBS, REPO, processes_matching

from lab_utils import launch

pytestmark = pytest.mark.launcher


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun", "mpirun"])
def test_two_processes_all_reduce_the_same_result(launcher):
    result = launch.run(JOBS / "allreduce.py", nprocs=2, launcher=launcher, timeout=120, echo=False)
    result.check()
    # Ranks contribute 1 and 2: every launcher must give 3 and a world of 2.
    assert result.metrics == [{"sum": 3.0, "world_size": 2, "launcher": launcher}]
    for rank in (0, 1):
        assert f"rank {rank}/2 launcher={launcher} sum=3" in result.rank_output(rank)


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "horovodrun"])
def test_a_crashing_rank_ends_the_job_with_its_error(launcher):
    timeout = 90
    result = launch.run(
        JOBS / "crash_rank1.py", nprocs=2, launcher=launcher, timeout=timeout, echo=False
    )
    assert not result.ok and not result.timed_out
    assert result.returncode != 0
    assert result.elapsed < timeout
    assert "rank 1 failed on purpose" in result.rank_output(1)
    assert processes_matching(str(JOBS / "crash_rank1.py")) == []
    with pytest.raises(launch.LaunchError, match="exited with status"):
        result.check()


def test_timeout_kills_the_whole_tree():
    result = launch.run(JOBS / "hang.py", nprocs=2, launcher="torchrun", timeout=8, echo=False)
    assert result.timed_out and not result.ok
    assert result.elapsed < 8 + 15
    assert "timed out" in result.output
    assert processes_matching(str(JOBS / "hang.py")) == []
    with pytest.raises(launch.LaunchError, match="timed out"):
        result.check()


def test_interrupt_leaves_no_process_behind():
    marker = "hang.py"
    # Python leaves SIGINT ignored when it starts with it ignored (a job started in the
    # background of a script, as CI runners may): a kernel handles it, so do that here.
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from lab_utils import launch
        try:
            launch.run({str(JOBS / marker)!r}, nprocs=2, launcher="mpirun", timeout=120,
                       echo=False)
        except KeyboardInterrupt:
            print("interrupted cleanly", flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        workers = [
            p
            for p in processes_matching(str(JOBS / marker))
            if "mpirun" not in " ".join(p.cmdline())
            and "lab_utils.reaper" not in p.cmdline()
            and "-c" not in p.cmdline()
        ]
        if len(workers) >= 2:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the job's workers never started")
    proc.send_signal(signal.SIGINT)  # what Jupyter's stop button does
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert "interrupted cleanly" in out
    assert processes_matching(str(JOBS / marker)) == []


def test_unknown_launcher_and_missing_binary_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown launcher"):
        launch.command("srun", 2, "x.py")
    with pytest.raises(ValueError, match="single process"):
        launch.command("python", 2, "x.py")
    monkeypatch.setattr(launch, "sys", type("S", (), {"executable": "/nonexistent/python"}))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(launch.LaunchError, match="mpirun is not installed"):
        launch.command("mpirun", 2, "x.py")


def test_command_forms():
    torchrun = launch.command("torchrun", 2, "train.py", ["--epochs", "1"])
    assert torchrun[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert torchrun[-3:] == ["train.py", "--epochs", "1"]
    module = launch.command("python", 1, "lab_utils.cli", ["--help"], module=True)
    assert module[1:] == ["-m", "lab_utils.cli", "--help"]
    mpi = launch.command("mpirun", 4, "train.py", env={"MASTER_PORT": "1234"})
    assert "--oversubscribe" in mpi and mpi[mpi.index("-x") :][:2] == ["-x", "MASTER_PORT"]


@pytest.mark.parametrize("step", [1, 5, 64])
def test_rank_demux_reassembles_split_writes(step):
    stream = (
        "[1,0]<stdout>:hello [1,0]<stdout>:world[1,0]<stdout>:\n"
        "[1,1]<stdout>:half [1,1]<stderr>:an error\n"
        "[1,1]<stdout>:line\n"
        "launcher message\n"
        "[default0]:torchrun line\n"
        "[1]<stdout>:horovod line\n"
    )
    demux = launch.RankDemux()
    got = []
    for i in range(0, len(stream), step):
        got += list(demux.feed(stream[i : i + step]))
    got += list(demux.flush())
    assert got == [
        (0, "hello world"),
        (1, "an error"),
        (1, "half line"),
        (None, "launcher message"),
        (0, "torchrun line"),
        (1, "horovod line"),
    ]


def test_stream_keeps_the_last_lines_cut_and_shows_every_one():
    seen: list[tuple[int | None, str]] = []
    result = launch.stream(
        [sys.executable, "-c", "for i in range(500): print(f'{i:03d}', 'x' * 50)"],
        env=launch.job_env("python", None, 1, 30),
        timeout=30,
        on_line=lambda rank, text: seen.append((rank, text)),
        keep_lines=10,
        max_line=3,
    )
    assert result.ok and result.line_count == 500
    assert seen == [(None, f"{i:03d}") for i in range(500)]
    assert result.lines == seen[-10:]


# A job that reports how its launcher was started: the process under the supervisor
# (lab_utils.reaper) is the launcher (torchrun, mpirun) or, with "python", the job itself.
_WHERE = """
import psutil
from lab_utils import metrics

launcher = psutil.Process()
while "lab_utils.reaper" not in launcher.parent().cmdline():
    launcher = launcher.parent()
metrics.emit({"event": "started", "argv": launcher.cmdline(), "cwd": launcher.cwd(),
              "env": launcher.environ()})
"""


def _same_program(printed: str, started: str) -> bool:
    """``printed`` runs ``started``: the same word, or the file a shell (with the course's
    environment activated) finds for that name."""
    if printed == started:
        return True
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which(printed, path=search) if "/" not in printed else None
    return found is not None and os.path.samefile(found, started)


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "python"])
def test_run_prints_the_command_it_starts(launcher, tmp_path, capsys):
    job = tmp_path / "where.py"
    job.write_text(_WHERE)
    nprocs = 1 if launcher == "python" else 2
    args = ["--note", "it's two words", "--count", "3"]
    env = {"LABS_PROFILE": "quick", "LABS_NOTE": "a b$c"}
    cwd = tmp_path if launcher == "python" else None
    result = launch.run(
        job, args, nprocs=nprocs, launcher=launcher, env=env, cwd=cwd, timeout=120, echo=False
    ).check()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    assert len(printed) == 1, printed
    words = shlex.split(printed[0][2:])
    started = result.event("started")

    if cwd is not None:  # "cd DIR && ..." says where it ran
        assert words[:1] == ["cd"] and words[2] == "&&", words
        assert os.path.samefile(words[1], started["cwd"])
        words = words[3:]
    shown = {}
    while re.match(r"[A-Za-z_]\w*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        shown[name] = value
    assert {**env, "OMP_NUM_THREADS": "1"}.items() <= shown.items()
    assert shown == {name: started["env"][name] for name in shown}

    if words[0] == "torchrun":  # torch's console script for `python -m torch.distributed.run`
        (entry,) = metadata.entry_points(group="console_scripts", name="torchrun")
        assert entry.value == "torch.distributed.run:main"
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    argv = started["argv"]
    assert len(words) == len(argv), (words, argv)
    assert all(_same_program(p, s) for p, s in zip(words, argv)), (words, argv)
    assert argv[-len(args) :] == args


def _result(*records: dict) -> launch.LaunchResult:
    return launch.LaunchResult(["python", "job.py"], 0, 1.0, metrics=list(records))


def test_event_and_events_pick_records_by_name_and_fields():
    result = _result(
        {"event": "epoch", "epoch": 1, "acc": 0.5},
        {"note": "a record without a name"},
        {"event": "epoch", "epoch": 2, "acc": 0.7},
        {"event": "summary", "acc": 0.7},
    )
    assert result.event("summary") == {"event": "summary", "acc": 0.7}
    assert [m["epoch"] for m in result.events("epoch")] == [1, 2]
    assert result.event("epoch", epoch=2)["acc"] == 0.7
    assert result.events("epoch", missing_field=None) == []
    assert result.events("eval") == []


def test_event_names_what_was_emitted_when_it_is_missing_or_ambiguous():
    result = _result({"event": "epoch", "epoch": 1}, {"event": "epoch", "epoch": 2}, {"x": 1})
    with pytest.raises(launch.EventError, match=r"job\.py: no record matches event\('summary'\)"):
        result.event("summary")
    with pytest.raises(launch.EventError, match=r"Events it emitted: epoch ×2, \(no event name\)"):
        result.event("summary")
    with pytest.raises(launch.EventError, match=r"2 records match event\('epoch'\).*\.events"):
        result.event("epoch")  # the first of several is not "the" epoch
    with pytest.raises(launch.EventError, match=r"event\('epoch', epoch=3\)"):
        result.event("epoch", epoch=3)
    failed = launch.LaunchResult(["python", "job.py"], 1, 1.0)
    with pytest.raises(launch.EventError, match=r"did not succeed.*Events it emitted: none"):
        failed.event("summary")


def test_a_launch_error_shows_the_first_error_above_a_long_tail():
    lines = [(0, "Traceback (most recent call last):"), (0, "RuntimeError: the cause")]
    lines += [(None, f"summary line {i}") for i in range(60)]
    result = launch.LaunchResult(["torchrun", "s.py"], 1, 1.0, lines=lines)
    with pytest.raises(launch.LaunchError) as e:
        result.check()
    text = str(e.value)
    assert "First error:" in text and "[rank 0] RuntimeError: the cause" in text
    assert text.index("the cause") < text.index("summary line 59")
    short = launch.LaunchResult(["s.py"], 1, 1.0, lines=lines[:2])
    with pytest.raises(launch.LaunchError) as e:
        short.check()
    assert "First error:" not in str(e.value)  # already in the last lines


def test_a_launch_error_shows_each_ranks_last_lines_when_no_line_is_an_error():
    # train_ddp.py's sys.exit("local rank 1: NCCL needs one GPU per rank; ...") names no
    # exception: only rank 1's own last line says why (seen on an H200, two ranks, 1 GPU)
    lines = [(0, f"rank 0 step {i}") for i in range(5)]
    lines += [(1, "local rank 1: NCCL needs one GPU per rank; this has fewer")]
    lines += [(None, f"torchrun summary line {i}") for i in range(60)]
    result = launch.LaunchResult(["torchrun", "train_ddp.py"], 1, 1.0, lines=lines)
    with pytest.raises(launch.LaunchError) as e:
        result.check()
    text = str(e.value)
    assert "Each rank's last lines:" in text
    assert "[rank 1] local rank 1: NCCL needs one GPU per rank" in text
    assert "[rank 0] rank 0 step 4" in text and "rank 0 step 1" not in text
    assert text.index("NCCL needs") < text.index("torchrun summary line 59")
    with pytest.raises(launch.LaunchError) as e:  # already in the last lines: not twice
        launch.LaunchResult(["s.py"], 1, 1.0, lines=lines[:6]).check()
    assert "Each rank's last lines:" not in str(e.value)
