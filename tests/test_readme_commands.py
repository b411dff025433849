"""Every command a README shows runs as written, from where the README says to stand.

The commands are the lines of the READMEs' shell blocks (```bash, ```sh, ```console or an
unlabelled fence) and the table cells that hold a command and nothing else (Lab 5's
Scripts table). A command stands in its README's folder unless the prose before it says
"from the repository root" ("from this folder" confirms the default). Each runs in a copy
of the repository (what it writes stays out of the checkout) with ``LABS_PROFILE=quick``,
the virtual environment's ``bin`` first on ``PATH`` and a timeout. The command-line
trainer's commands under a launcher are also checked for what its ranks print: rank 0
alone reports, in a world of the processes asked for (tests/test_cli.py launches it
under torchrun only).

What cannot run here is listed in ``NOT_RUN`` with the reason; the files such a command
names must still exist from where it stands. Every other command is run, so a command a
README gains is tested without anyone listing it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab_utils import gloo_exit

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
README_GLOBS = (
    "README.md",
    "labs/*/README.md",
    "labs/*/*/README.md",
    "assessment/README.md",
    "assessment/INSTRUCTORS.md",
    "benchmarks/README.md",
)
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
# A table cell that is one code span starting with one of these is a command to run.
PROGRAMS = {
    "python",
    "python3",
    "torchrun",
    "mpirun",
    "horovodrun",
    "lab-grade",
    "lab-train",
    "make",
    "bash",
    "jupyter",
    "pip",
    "docker",
    "conda",
    "sbatch",
    "srun",
    "pytest",
}
TIMEOUT_S = 240
ERROR_LINE = re.compile(r"Error|error:|can't open file|No such file|not found", re.IGNORECASE)
HAS_MPI = shutil.which("mpirun") is not None
HAS_HOROVOD = (VENV_BIN / "horovodrun").exists()

JUPYTER = "starts JupyterLab, which serves until it is stopped (tests/test_browser.py drives it)"
SUITE = "is the test suite this test belongs to"
NOTEBOOKS = "runs this lab's notebooks under nbval, as `make test` does"
LAB_TESTS = "runs tests that `make test` runs, the cpu-profile science claims among them (minutes)"
MACHINES = "needs several machines (node1, node2, $HEAD)"
SPARK = "needs a Spark installation ($SPARK_HOME) or a Spark master URL on other machines"
SCIENCE = "trains the science claims on the cpu profile (minutes); tests/test_lab1.py and test_lab3.py assert them"
STUDENT_SCRIPT = "grades the student's own script (my_train.py), which a checkout does not hold"
GRADE_STARTER = (
    "grades the serial starter on the real cpu-2proc target (about 2 minutes of both "
    "cores); tests/test_grader.py grades it there too"
)
BATCH = "grades an instructor's folder of submissions; tests/test_sandbox.py grades a class"
GPU_TARGET = "calibrates the 4-GPU target: needs 4 GPUs and several reference runs"
GIT = (
    "works on the student's own clone and the course's remote; tests/test_setup_files.py "
    "pulls with it in a clone it makes"
)
BENCH = (
    "times the labs for minutes by design; tests/test_benchmarks.py runs `--quick` from the "
    "root (the harness's own benchmarks) and checks that each other one reads what its lab "
    "script emits"
)
BENCH_LIST = (
    "tests/test_benchmarks.py runs it (main(['--list']) in its process, and "
    "`python -m benchmarks --quick` from the root): starting Python for it here proves no more"
)
SLURM_CLUSTER = "submits to a Slurm cluster of 2 nodes x 4 GPUs (the sbatch file's default form)"
SLURM_RUN_THERE = (
    "submits to a Slurm cluster; tests/test_slurm.py runs this very command on the "
    "one-node cluster it starts (and checks the README still gives it)"
)
SLURM_CLASS = (
    "grades an instructor's folder of submissions on their Slurm cluster; "
    "tests/test_grader_slurm.py grades a class on the one-node test cluster"
)

# Commands that do not run here: the command (as shlex reads it, comments dropped) -> why.
NOT_RUN = {
    "make lab": JUPYTER,
    "make test": SUITE,
    "git pull --autostash": GIT,
    "git switch -c my-work": GIT,
    "git commit -am Lab 2 exercises": GIT,
    "git pull --autostash --no-edit origin main": GIT,
    # Lab 1 and Lab 3
    "LABS_PROFILE=quick LABS_SOLUTIONS=1 .venv/bin/pytest --nbval-lax --nbval-current-env "
    "labs/lab1_optimisation/": NOTEBOOKS,
    ".venv/bin/pytest tests/test_lab1.py": LAB_TESTS,
    "make science": SCIENCE,
    "LABS_PROFILE=quick LABS_SOLUTIONS=1 .venv/bin/pytest --nbval-lax --nbval-current-env "
    "labs/lab3_large_batch/": NOTEBOOKS,
    ".venv/bin/pytest tests/test_optim.py tests/test_lab3.py": LAB_TESTS,
    # Lab 2: several machines, Spark
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node1:29500 "
    "--rdzv-id job42 scripts/train_ddp.py": MACHINES,
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr node1 --master-port 29500 "
    "scripts/train_ddp.py": MACHINES,
    "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr node1 --master-port 29500 "
    "scripts/train_ddp.py": MACHINES,
    "mpirun -np 8 -H node1:4,node2:4 -x MASTER_ADDR=node1 -x MASTER_PORT=29500 python "
    "scripts/train_ddp.py": MACHINES,
    "horovodrun -np 8 -H node1:4,node2:4 --gloo python scripts/train_horovod.py": MACHINES,
    "mpirun -np 8 -H node1:4,node2:4 -x MASTER_ADDR=node1 -x MASTER_PORT=29500 python "
    "scripts/train_horovod.py": MACHINES,
    "sbatch slurm/train_ddp.sbatch": SLURM_CLUSTER,
    "sbatch slurm/train_ddp_tasks.sbatch": SLURM_CLUSTER,
    "sbatch slurm/train_horovod.sbatch": SLURM_CLUSTER,
    "PROCS_PER_NODE=2 LABS_PROFILE=quick sbatch --wait --nodes=1 --gpus-per-node=0 --cpus-per-task=2 "
    "slurm/train_ddp.sbatch": SLURM_RUN_THERE,
    "LABS_PROFILE=quick sbatch --wait --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 "
    "--cpus-per-task=1 slurm/train_ddp_tasks.sbatch": SLURM_RUN_THERE,
    "LABS_PROFILE=quick sbatch --wait --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 "
    "--cpus-per-task=1 slurm/train_horovod.sbatch": SLURM_RUN_THERE,
    "$SPARK_HOME/sbin/start-master.sh": SPARK,
    "$SPARK_HOME/sbin/start-worker.sh spark://node1:7077": SPARK,
    "GLOO_SOCKET_IFNAME=eth0 python scripts/train_horovod_spark.py --master spark://node1:7077 "
    "--num-proc 8 --store /shared/fashion_mnist": SPARK,
    # Lab 4
    "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 "
    "--rdzv-id lab4 scripts/hybrid.py --tp 2": MACHINES,
    # The assessment
    "lab-grade my_train.py": STUDENT_SCRIPT,
    "lab-grade my_train.py --target cpu-2proc --launcher mpirun --nprocs 2 --json report.json": STUDENT_SCRIPT,
    "python -m assessment my_train.py --target cpu-cifar-standin": STUDENT_SCRIPT,
    "lab-grade assessment/starter.py --target cpu-2proc": GRADE_STARTER,
    "lab-grade my_train.py --target cpu-cifar-standin": STUDENT_SCRIPT,
    "lab-grade batch submissions/ --target cpu-2proc --out grades/": BATCH,
    "lab-grade batch submissions/ --target gpu-4 --slurm --partition gpu --gres gpu:4 --out grades/": SLURM_CLASS,
    "lab-grade batch submissions/ --target cpu-2proc --slurm --partition cpu --out grades/": SLURM_CLASS,
    "lab-grade calibrate --target gpu-4 --runs 3 --starter --write assessment/targets/gpu-4.toml": GPU_TARGET,
    # Lab 6, notebooks 1–3
    "LABS_PROFILE=quick LABS_SOLUTIONS=1 .venv/bin/pytest --nbval-lax --nbval-current-env "
    "labs/lab6_efficiency/01_flops_mfu_roofline.ipynb labs/lab6_efficiency/02_mixed_precision.ipynb "
    "labs/lab6_efficiency/03_recomputation.ipynb": NOTEBOOKS,
    ".venv/bin/pytest tests/test_lab6_cost.py": LAB_TESTS,
    ".venv/bin/python -m benchmarks --only lab6_cost": BENCH,
    # Lab 6, notebooks 4–6
    "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 "
    "--rdzv-id lab6 scripts/ddp_by_hand.py": MACHINES,
    "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 "
    "--rdzv-id lab6p scripts/profile_ddp.py": MACHINES,
    "LABS_PROFILE=quick LABS_SOLUTIONS=1 .venv/bin/pytest --nbval-lax --nbval-current-env "
    "labs/lab6_efficiency/04_profiling.ipynb labs/lab6_efficiency/05_ddp_by_hand.ipynb "
    "labs/lab6_efficiency/06_predicted_bytes.ipynb": NOTEBOOKS,
    ".venv/bin/pytest tests/test_lab6_ddp.py": LAB_TESTS,
    ".venv/bin/python -m benchmarks --only lab6_ddp": BENCH,
    # Benchmarks
    "make bench": BENCH,
    "python -m benchmarks --list": BENCH_LIST,
    "python -m benchmarks --quick": BENCH,
    "python -m benchmarks --only loader --only trainer --json results.json": BENCH,
    "python -m benchmarks --repeats 5": BENCH,
    "python -m benchmarks --readme": BENCH
    + "; it also rewrites benchmarks/README.md, README.md's trainer figures and benchmarks/recorded/",
}
# Words of listed commands that stand for the reader's own files.
PLACEHOLDERS = {"my_train.py"}
# Options whose value is a file the command writes (not one that must exist).
OUTPUT_OPTIONS = {"--checkpoint", "--json", "--out", "--write", "--store"}
INPUT_SUFFIXES = (".py", ".ipynb", ".sh", ".sbatch", ".yml")
TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
PHRASE_ROOT = re.compile(
    r"from the (repository|repository's) root|from the root of the repository", re.IGNORECASE
)


@dataclass(frozen=True)
class Command:
    """One command of a README and the folder (relative to the root) it runs from."""

    readme: str
    line: int
    text: str
    folder: str

    @property
    def key(self) -> str:
        """The command as the shell reads it, comments dropped: its key in ``NOT_RUN``."""
        return " ".join(shlex.split(self.text, comments=True))

    def __str__(self) -> str:
        return f"{self.readme}:{self.line} (from {self.folder or '.'}/): {self.text}"


def readmes(root: Path = ROOT) -> list[Path]:
    """The READMEs whose commands a student runs."""
    return sorted({p for pattern in README_GLOBS for p in root.glob(pattern)})


def stands_in(readme: Path, root: Path, prose: str) -> str:
    """Where the commands after ``prose`` run: the root when it says so, else the README's
    folder; relative to ``root``."""
    if PHRASE_ROOT.search(" ".join(prose.split())):
        return ""
    folder = readme.parent.relative_to(root).as_posix()
    return "" if folder == "." else folder


def block_commands(lines: list[str]) -> list[str]:
    """The commands of a shell block: continuation lines joined, comment lines dropped."""
    commands, pending = [], ""
    for line in lines:
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        pending = pending.removeprefix("$ ")
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending and not pending.startswith("#"):
            commands.append(pending)
        pending = ""
    return commands


def is_command(text: str) -> bool:
    """A program of ``PROGRAMS`` with at least one argument (a bare name is a mention)."""
    words = text.split()
    while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return len(words) > 1 and words[0] in PROGRAMS


def table_commands(line: str) -> list[str]:
    """The cells of a table row that hold one code span and it is a command."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    spans = [re.fullmatch(r"`([^`]+)`", cell.strip()) for cell in cells]
    return [m.group(1).replace("\\|", "|") for m in spans if m and is_command(m.group(1))]


def readme_commands(readme: Path, root: Path = ROOT) -> list[Command]:
    """Every command of ``readme``: its shell blocks' lines and its tables' command cells."""
    name = readme.relative_to(root).as_posix()
    found: list[Command] = []
    prose: list[str] = []  # the text since the last heading or block: where to stand
    fence: str | None = None
    block: list[str] = []
    start = 0
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if fence is None and (opening := re.match(r"^```\s*(\S*)\s*$", line)):
            fence, block, start = opening.group(1), [], number
        elif fence is not None and line.startswith("```"):
            if fence in SHELL_FENCES:
                folder = stands_in(readme, root, "\n".join(prose))
                found += [Command(name, start, c, folder) for c in block_commands(block)]
            fence, prose = None, []
        elif fence is not None:
            block.append(line)
        elif line.startswith("#"):
            prose = []
        else:
            prose.append(line)
            if line.lstrip().startswith("|"):
                folder = stands_in(readme, root, "\n".join(prose))
                found += [Command(name, number, c, folder) for c in table_commands(line)]
    return found


def all_commands() -> list[Command]:
    return [c for readme in readmes() for c in readme_commands(readme)]


COMMANDS = all_commands()
TO_RUN = [c for c in COMMANDS if c.key not in NOT_RUN]
LISTED = [c for c in COMMANDS if c.key in NOT_RUN]


# --------------------------------------------------------------------------- running
@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the working tree (its .venv linked): commands write their files there."""
    copy = tmp_path_factory.mktemp("checkout") / "repo"
    skip = {
        ".venv",
        ".git",
        ".gpu_bundle",  # the GPU machine's wheels and data (CONTRIBUTING.md): 39 MB no command reads
        "__pycache__",
        ".pytest_cache",
        ".ruff_cache",
        ".ipynb_checkpoints",
        "runs",
        "build",
        "dist",
        "results",
    }
    shutil.copytree(
        ROOT,
        copy,
        ignore=lambda _d, names: [n for n in names if n in skip or n.endswith(".egg-info")],
    )
    (copy / ".venv").symlink_to(ROOT / ".venv")
    return copy


def command_env() -> dict[str, str]:
    """What `make test` gives its tests, with the quick profile and the venv's python first."""
    env = dict(
        os.environ,
        LABS_PROFILE="quick",
        VIRTUAL_ENV=str(ROOT / ".venv"),
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    for name, value in {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }.items():
        env.setdefault(name, value)
    return env


def run_command(text: str, cwd: Path, timeout_s: float = TIMEOUT_S) -> tuple[int | None, str]:
    """Run ``text`` with bash in ``cwd`` under the reaper (nothing outlives it): its exit
    status (None when it ran past ``timeout_s``) and its output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab_utils.reaper", "--", "bash", "-c", text],
        cwd=cwd,
        env=command_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the reaper ends the whole tree
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        return None, output


def what_went_wrong(output: str, errors: int = 8, tail: int = 15) -> str:
    """The lines that name an error (a launcher's summary buries the rank's own), then the
    output's tail."""
    lines = output.splitlines()
    named = [line for line in lines[:-tail] if ERROR_LINE.search(line)][:errors]
    return "\n".join([*named, *(["..."] if named else []), *lines[-tail:]])


# The command-line trainer under a launcher (README.md): tests/test_cli.py launches it under
# torchrun only, and these runs check the rest. The count of processes a command asks for.
CLI_LAUNCHERS = ("torchrun", "mpirun", "horovodrun")
NPROCS = re.compile(r"(?:--nproc-per-node|-np)[ =](\d+)")


def cli_launch(command: Command) -> tuple[str, int] | None:
    """The launcher and process count of a command that starts the command-line trainer
    (``lab_utils.cli``) under one, else None."""
    words = command.key.split()
    if "lab_utils.cli" not in words or words[0] not in CLI_LAUNCHERS:
        return None
    found = NPROCS.search(command.key)
    return words[0], int(found.group(1)) if found else 1


def check_cli_output(launcher: str, nprocs: int, output: str) -> None:
    """What each rank of the trainer printed: rank 0 alone reports, once, and saw the
    launcher's world (not ``nprocs`` separate one-process runs)."""
    assert f"{launcher} world_size={nprocs}" in output, (
        f"rank 0 did not report a {launcher} job of {nprocs} processes:\n{output[-1500:]}"
    )
    reports = output.count("test accuracy")
    assert reports == 1, f"{reports} reports of the test accuracy (only rank 0 reports)"
    # a rank of `python -m lab_utils.cli` ends through the armed sys.exit (lab_utils/gloo_exit.py)
    assert gloo_exit.UNKNOWN_STATUS not in output, output[-1500:]


def needs(command: Command) -> list[pytest.MarkDecorator]:
    """Skips for the tools a command needs that this machine lacks."""
    words = command.text.split()
    marks = []
    if "mpirun" in words:
        marks.append(pytest.mark.skipif(not HAS_MPI, reason="OpenMPI's mpirun is not installed"))
    if "horovodrun" in words or "horovod" in command.text.lower():
        marks.append(pytest.mark.skipif(not HAS_HOROVOD, reason="Horovod is not installed"))
    return marks


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.parametrize(
    "command", [pytest.param(c, id=f"{c.readme}:{c.line}:{c.key}", marks=needs(c)) for c in TO_RUN]
)
def test_readme_command_runs(command: Command, checkout: Path) -> None:
    status, output = run_command(command.text, checkout / command.folder)
    tail = what_went_wrong(output)
    assert status is not None, f"{command}\nstill running after {TIMEOUT_S} s:\n{tail}"
    assert status == 0, f"{command}\nexit status {status}:\n{tail}"
    if (cli := cli_launch(command)) is not None:
        check_cli_output(*cli, output)


# --------------------------------------------------------------------------- not run
def missing_paths(command: Command, root: Path = ROOT) -> list[str]:
    """The files, modules and make targets ``command`` names that do not exist from where it
    stands (the reader's own files and what it writes aside)."""
    cwd = root / command.folder
    words = shlex.split(command.text, comments=True)
    while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    missing = []
    if words and words[0] == "make":
        makefile = cwd / "Makefile"
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        text = makefile.read_text() if makefile.exists() else ""
        missing += [
            f"make target {t!r} (no Makefile here)" if not text else f"make target {t!r}"
            for t in targets
            if not re.search(rf"^{re.escape(t)}:", text, re.MULTILINE)
        ]
    for before, word in zip(["", *words], words):
        if word in PLACEHOLDERS or "$" in word or ":" in word:
            continue
        if before in OUTPUT_OPTIONS:  # written, so only its folder in the repository must exist
            folder = Path(word).parent
            if folder.parts and folder.parts[0] in TOP_LEVEL and not (cwd / folder).is_dir():
                missing.append(f"{folder}/ (for {word})")
            continue
        if before == "-m":
            if not module_found(word, cwd):
                missing.append(f"module {word}")
            continue
        is_path = (
            word.endswith(INPUT_SUFFIXES)
            or word.startswith(".venv/")
            or ("/" in word and word.split("/")[0] in TOP_LEVEL)
        )
        if is_path and not word.startswith("/") and not (cwd / word).exists():
            missing.append(word)
    return missing


def module_found(module: str, cwd: Path) -> bool:
    """Whether ``python -m module`` finds it from ``cwd`` (it puts ``cwd`` on its path)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return (
        subprocess.run(
            [str(VENV_BIN / "python"), "-c", probe], cwd=cwd, env=command_env(), capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.parametrize(
    "command", [pytest.param(c, id=f"{c.readme}:{c.line}:{c.key}") for c in LISTED]
)
def test_listed_command_names_what_exists(command: Command) -> None:
    """A command that cannot run here is still checked for the files it names."""
    missing = missing_paths(command)
    assert not missing, (
        f"{command}\nnot run here ({NOT_RUN[command.key]}), and from "
        f"{command.folder or '.'}/ it names what does not exist: {missing}"
    )


def test_every_listed_command_is_in_a_readme() -> None:
    stale = set(NOT_RUN) - {c.key for c in COMMANDS}
    assert not stale, f"NOT_RUN lists commands no README has any more: {sorted(stale)}"


# --------------------------------------------------------------------------- the reader
def test_the_readmes_hold_commands_to_run() -> None:
    assert {c.readme for c in TO_RUN} >= {
        "README.md",
        "labs/lab2_data_parallel/README.md",
        "labs/lab4_model_parallel/README.md",
    }


def test_the_readme_starts_the_cli_under_each_launcher() -> None:
    """tests/test_cli.py leaves mpirun and horovodrun to these commands' runs."""
    assert {cli[0] for c in TO_RUN if (cli := cli_launch(c))} == set(CLI_LAUNCHERS)


def test_the_cli_output_check_fails_for_every_rank_reporting() -> None:
    one = "quick | mpirun world_size=2 | fashion-mnist\ntest accuracy 80.00% (loss 0.5)\n"
    check_cli_output("mpirun", 2, one)
    with pytest.raises(AssertionError, match="2 reports"):
        check_cli_output("mpirun", 2, one + "test accuracy 80.00% (loss 0.5)\n")
    with pytest.raises(AssertionError, match="did not report"):
        check_cli_output("mpirun", 2, one.replace("mpirun world_size=2", "single world_size=1"))
    with pytest.raises(AssertionError, match="gloo_exit"):  # a rank the hook could not end
        check_cli_output("mpirun", 2, one + gloo_exit.UNKNOWN_STATUS + "\n")
    readme = Command("README.md", 1, "mpirun -np 2 python -m lab_utils.cli --epochs 1", "")
    assert cli_launch(readme) == ("mpirun", 2)
    assert cli_launch(Command("README.md", 1, "lab-train --epochs 4", "")) is None


def test_blocks_tables_and_where_to_stand_are_read(tmp_path: Path) -> None:
    lab = tmp_path / "labs" / "lab9"
    lab.mkdir(parents=True)
    (lab / "README.md").write_text(
        "# Lab 9\n\nFrom the repository root:\n\n```bash\n"
        "python -m lab9 --a 1 \\\n    --b 2   # two options\n# a comment\n```\n\n"
        "## Scripts\n\n| script | launch |\n| --- | --- |\n"
        "| `a.py` | `torchrun --nproc-per-node 2 a.py --mode sync\\|async` |\n"
        "| `b.py` | runs under `horovodrun --gloo` |\n\n"
        "```text\nlab9/  not a command\n```\n\n```console\n$ make lab9\n```\n"
    )
    found = readme_commands(lab / "README.md", tmp_path)
    assert [(c.text, c.folder) for c in found] == [
        ("python -m lab9 --a 1 --b 2   # two options", ""),
        ("torchrun --nproc-per-node 2 a.py --mode sync|async", "labs/lab9"),
        ("make lab9", "labs/lab9"),
    ]
    assert found[0].key == "python -m lab9 --a 1 --b 2"


def test_a_script_named_from_the_wrong_folder_fails(checkout: Path) -> None:
    """The mistake this test exists for: a table naming `hogwild.py` where it lives in
    `scripts/`, read from the lab's folder."""
    lab = checkout / "labs" / "lab5_systems"
    status, output = run_command("python hogwild.py --grid", lab, timeout_s=60)
    assert status != 0 and "can't open file" in output


def test_a_listed_command_naming_a_missing_file_fails() -> None:
    wrong = Command(
        "labs/lab1_optimisation/README.md",
        1,
        ".venv/bin/pytest tests/test_lab1.py",
        "labs/lab1_optimisation",
    )
    assert missing_paths(wrong) == [".venv/bin/pytest", "tests/test_lab1.py"]
    assert missing_paths(Command("benchmarks/README.md", 1, "make bench", "benchmarks"))
    assert missing_paths(Command("README.md", 1, "make bench", "")) == []
    written = "lab-grade calibrate --write assessment/targets/gpu-4.toml"
    assert missing_paths(Command("assessment/INSTRUCTORS.md", 1, written, "assessment"))
    assert missing_paths(Command("assessment/INSTRUCTORS.md", 1, written, "")) == []
