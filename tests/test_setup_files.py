"""The set-up files agree with each other and parse.

scripts/setup.sh owns the list of Debian packages and scripts/build_horovod.sh the
Horovod build flags; the Dockerfile and environment.yml must say the same.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from lab_utils.source import load_script

ROOT = Path(__file__).resolve().parents[1]
SETUP_SH = ROOT / "scripts" / "setup.sh"
BUILD_HOROVOD_SH = ROOT / "scripts" / "build_horovod.sh"
CI_RUN = ROOT / ".ci" / "run"
DOCKERFILE = ROOT / "Dockerfile"
ENVIRONMENT_YML = ROOT / "environment.yml"
MAKEFILE = ROOT / "Makefile"

# What each Debian package of setup.sh is called on conda-forge (None: nothing to
# install there, e.g. Fashion-MNIST, which lab_utils.data downloads instead).
CONDA_NAME_OF_APT_PACKAGE = {
    "openmpi-bin": "openmpi",
    "libopenmpi-dev": "openmpi-mpicxx",
    "dataset-fashion-mnist": None,
    "make": "make",
    "cmake": "cmake",
    "g++": "cxx-compiler",
    "bubblewrap": None,  # a system tool with no conda package (environment.yml says so)
    "openjdk-17-jre-headless": "openjdk",
    "iproute2": None,  # ip and tc for Lab 7's slow link: system tools (environment.yml says so)
}

HOROVOD_FLAG = re.compile(r"\b(HOROVOD_[A-Z_]+)=(\S+)")


def shell_variable(path: Path, name: str) -> str:
    """The value of a one-line `NAME="..."` assignment in a shell script."""
    match = re.search(rf'^{name}="([^"]*)"$', path.read_text(), re.MULTILINE)
    assert match, f'{path.name} has no line {name}="..."'
    return match.group(1)


def shell_array(path: Path, name: str) -> list[str]:
    """The words of a `NAME=( ... )` array assignment in a shell script."""
    match = re.search(rf"^{name}=\((.*?)\)$", path.read_text(), re.MULTILINE | re.DOTALL)
    assert match, f"{path.name} has no array {name}=( ... )"
    return shlex.split(match.group(1), comments=True)


def apt_packages() -> list[str]:
    packages = shell_variable(SETUP_SH, "APT_PACKAGES").split()
    assert packages, "APT_PACKAGES in setup.sh is empty"
    return packages


def horovod_build_flags() -> dict[str, str]:
    flags = dict(
        word.split("=", 1) for word in shell_array(BUILD_HOROVOD_SH, "HOROVOD_BUILD_FLAGS")
    )
    assert flags, "HOROVOD_BUILD_FLAGS in build_horovod.sh is empty"
    return flags


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def environment() -> dict:
    data = yaml.safe_load(ENVIRONMENT_YML.read_text())
    assert isinstance(data, dict) and data.get("dependencies"), (
        "environment.yml has no dependencies"
    )
    return data


def conda_packages(env: dict) -> set[str]:
    """Package names (version specs stripped) of the conda part of environment.yml."""
    names = set()
    for entry in env["dependencies"]:
        if isinstance(entry, str):
            names.add(re.split(r"[=<>!~ ]", entry, maxsplit=1)[0])
    return names


@pytest.mark.parametrize("script", [SETUP_SH, BUILD_HOROVOD_SH, CI_RUN], ids=lambda p: p.name)
def test_shell_script_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, f"bash -n {script.name}: {result.stderr}"


def test_ci_runs_make_test() -> None:
    commands = [
        line.strip()
        for line in CI_RUN.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert commands[0] in ("set -euo pipefail", "set -eu"), ".ci/run must stop on the first error"
    assert re.fullmatch(r"exec make test( </dev/null)?", commands[-1]), (
        f".ci/run must end by running `make test`, not {commands[-1]!r}"
    )


def test_make_test_runs_the_whole_suite_and_keeps_failures() -> None:
    recipe = MAKEFILE.read_text().split("\ntest: setup\n", 1)
    assert len(recipe) == 2, "Makefile has no `test: setup` target"
    body = recipe[1].split("\n\n", 1)[0]
    for part in (
        "LABS_PROFILE=quick",
        "LABS_SOLUTIONS=1",
        "-m pytest",
        "--nbval-lax",
        "--nbval-current-env",
        "--timeout",
        "--dist loadscope --no-loadscope-reorder",
        "tests labs",
    ):
        assert part in body, f"make test does not pass {part!r}"
    assert "exit $$rc" in body, "make test must exit with pytest's code (5 = no tests is a failure)"


def test_dockerfile_base_is_a_pinned_ngc_pytorch_image() -> None:
    froms = [args for keyword, args in dockerfile_instructions() if keyword == "FROM"]
    assert len(froms) == 1, f"expected one FROM, found {froms}"
    image = froms[0].split()[0]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", image), (
        f"FROM {image}: pin an NGC PyTorch release tag such as nvcr.io/nvidia/pytorch:24.10-py3"
    )


def test_dockerfile_serves_jupyterlab_on_8888() -> None:
    instructions = dockerfile_instructions()
    assert ("EXPOSE", "8888") in instructions
    cmds = [args for keyword, args in instructions if keyword == "CMD"]
    assert len(cmds) == 1, "the Dockerfile needs exactly one CMD"
    cmd = yaml.safe_load(cmds[0])  # the exec form is a JSON array
    assert isinstance(cmd, list) and cmd[:2] == ["jupyter", "lab"], f"CMD {cmds[0]}"
    for option in ("--ip=0.0.0.0", "--port=8888", "--allow-root", "--notebook-dir=labs"):
        assert option in cmd, f"CMD lacks {option}"


def test_dockerfile_installs_the_setup_packages() -> None:
    installed: set[str] = set()
    for keyword, args in dockerfile_instructions():
        if keyword == "RUN":
            for command in re.findall(r"apt-get install ([^&;]*)", args):
                installed.update(word for word in command.split() if not word.startswith("-"))
    missing = set(apt_packages()) - installed
    assert not missing, f"the Dockerfile does not apt-get install {sorted(missing)} (see setup.sh)"


def test_dockerfile_builds_horovod_with_nccl_through_the_script() -> None:
    runs = [args for keyword, args in dockerfile_instructions() if keyword == "RUN"]
    builds = [run for run in runs if "scripts/build_horovod.sh" in run]
    assert builds, "the Dockerfile must build Horovod with scripts/build_horovod.sh"
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in builds[0], "the image must build Horovod with NCCL"


def test_dockerfile_keeps_the_pip_constraints_and_torch() -> None:
    envs = [args for keyword, args in dockerfile_instructions() if keyword == "ENV"]
    constraint = [env for env in envs if env.startswith("PIP_CONSTRAINT=")]
    assert constraint and "${PIP_CONSTRAINT}" in constraint[0], (
        "PIP_CONSTRAINT must keep the base image's constraints file (NGC >= 25.03)"
    )
    installs = [
        args
        for keyword, args in dockerfile_instructions()
        if keyword == "RUN" and re.search(r"-e '\.\[lab[],]", args)
    ]
    assert installs, "the Dockerfile must pip install -e '.[lab,...]'"


@pytest.mark.parametrize("path", [DOCKERFILE, ENVIRONMENT_YML], ids=lambda p: p.name)
def test_horovod_flags_match_the_build_script(path: Path) -> None:
    expected = horovod_build_flags()
    mentioned = dict(HOROVOD_FLAG.findall(path.read_text()))
    gpu_operations = mentioned.pop("HOROVOD_GPU_OPERATIONS", "NCCL")
    assert gpu_operations == "NCCL", f"{path.name}: HOROVOD_GPU_OPERATIONS={gpu_operations}"
    wrong = {name: value for name, value in mentioned.items() if expected.get(name) != value}
    assert not wrong, f"{path.name} names Horovod flags that build_horovod.sh does not set: {wrong}"


def test_environment_documents_every_horovod_flag() -> None:
    documented = dict(HOROVOD_FLAG.findall(ENVIRONMENT_YML.read_text()))
    missing = {
        name: value
        for name, value in horovod_build_flags().items()
        if documented.get(name) != value
    }
    assert not missing, f"environment.yml does not document {missing}"
    assert "scripts/build_horovod.sh" in ENVIRONMENT_YML.read_text()


def test_environment_has_the_lab_stack_and_the_package() -> None:
    env = environment()
    names = conda_packages(env)
    wanted = {"python", "pytorch", "jupyterlab", "ipywidgets", "matplotlib", "nbval", "tqdm", "pip"}
    assert wanted <= names, f"environment.yml lacks {sorted(wanted - names)}"
    assert "python=3.11" in env["dependencies"]
    pip_sections = [entry["pip"] for entry in env["dependencies"] if isinstance(entry, dict)]
    assert pip_sections and any(re.fullmatch(r"-e \.\[dev[],].*", e) for e in pip_sections[0]), (
        "environment.yml must pip install -e .[dev,...]"
    )


def test_environment_covers_the_setup_packages() -> None:
    unknown = set(apt_packages()) - CONDA_NAME_OF_APT_PACKAGE.keys()
    assert not unknown, f"say in this test what {sorted(unknown)} are called on conda-forge"
    names = conda_packages(environment())
    missing = {
        apt: conda
        for apt, conda in CONDA_NAME_OF_APT_PACKAGE.items()
        if apt in apt_packages() and conda is not None and conda not in names
    }
    assert not missing, f"environment.yml lacks the conda packages for {missing}"


def extras(text: str, prefix: str) -> set[str]:
    """The extras of every `-e .[a,b]` install in ``text`` after ``prefix``."""
    found = re.findall(re.escape(prefix) + r"\.\[([a-z,]+)\]", text)
    assert found, f"no {prefix}.[...] install found"
    return {x for group in found for x in group.split(",")}


def test_spark_extra_and_java_everywhere() -> None:
    """Horovod on Spark needs the spark extra and Java 17 wherever the labs are set up."""
    assert "spark" in pip_extras(setup_plan("lab"))
    assert "browser" in pip_extras(setup_plan("test"))
    assert "spark" in extras(DOCKERFILE.read_text(), "-e '")
    assert "spark" in extras(ENVIRONMENT_YML.read_text(), "-e ")
    assert "openjdk-17-jre-headless" in apt_packages()
    assert "chromium" in shell_variable(SETUP_SH, "BROWSER_APT_PACKAGES").split()


def setup_plan(target: str) -> dict[str, list[str]]:
    """What setup.sh would install for ``target`` (lab or test): its --plan, parsed."""
    result = subprocess.run(
        ["bash", str(SETUP_SH), "--for", target, "--plan"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    plan = {}
    for line in result.stdout.splitlines():
        kind, _, value = line.partition(": ")
        plan[kind] = value.split()
    return plan


def pip_extras(plan: dict[str, list[str]]) -> set[str]:
    (install,) = [word for word in plan["pip"] if word.startswith(".[")]
    return set(install.removeprefix(".[").removesuffix("]").split(","))


TEST_ONLY_APT = {"chromium", "slurmctld", "slurmd", "slurm-client", "munge"}
TEST_ONLY_EXTRAS = {"dev", "browser"}


def test_setup_for_the_labs_installs_no_test_tools() -> None:
    """`make lab` on a fresh machine: the labs' packages, no browser, Slurm or pytest."""
    plan = setup_plan("lab")
    assert set(apt_packages()) <= set(plan["apt"])
    assert not TEST_ONLY_APT & set(plan["apt"]), plan["apt"]
    assert pip_extras(plan) == {"lab", "spark"}


def test_setup_for_the_tests_installs_everything() -> None:
    plan = setup_plan("test")
    assert set(setup_plan("lab")["apt"]) | TEST_ONLY_APT <= set(plan["apt"])
    assert pip_extras(plan) >= {"spark"} | TEST_ONLY_EXTRAS  # dev includes lab


def test_setup_rejects_an_unknown_target() -> None:
    result = subprocess.run(
        ["bash", str(SETUP_SH), "--for", "labs", "--plan"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "lab or test" in result.stderr


def make_prerequisites(target: str) -> list[str]:
    match = re.search(rf"^{target}:([^\n=]*)$", MAKEFILE.read_text(), re.MULTILINE)
    assert match, f"Makefile has no rule for {target}"
    return match.group(1).split()


def make_recipe(target: str) -> str:
    parts = MAKEFILE.read_text().split(f"\n{target}:", 1)
    assert len(parts) == 2, f"Makefile has no target {target}"
    return parts[1].split("\n\n", 1)[0]


def test_make_lab_sets_up_for_the_labs_and_make_test_for_the_tests() -> None:
    assert "setup.sh --for lab" in make_recipe("setup-lab")
    assert "setup.sh --for test" in make_recipe("setup")
    for target in ("lab", "grade", "bench", "science"):
        assert "setup-lab" in make_prerequisites(target), f"make {target}"
    assert make_prerequisites("test") == ["setup"]


def test_jupyterlab_settings_are_shipped() -> None:
    """setup.sh and the Dockerfile both install the course's overrides.json."""
    import json

    settings = json.loads((ROOT / "scripts" / "jupyterlab-overrides.json").read_text())
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    for path in (SETUP_SH, DOCKERFILE):
        text = path.read_text()
        assert "scripts/jupyterlab-overrides.json" in text, f"{path.name} does not ship it"
        assert "share/jupyter/lab/settings" in text


# --------------------------------------------------------------------------- clean notebooks
CLEAN_NOTEBOOK = ROOT / "scripts" / "clean_notebook.py"
GITATTRIBUTES = ROOT / ".gitattributes"
A_NOTEBOOK = ROOT / "labs" / "lab1_optimisation" / "02_sgd_minibatches.ipynb"
README = ROOT / "README.md"
UPDATE = "git pull --autostash"  # the README's command to take the course's updates


def filter_output(text: str, cwd: Path = ROOT) -> str:
    """What the clean filter setup.sh registers makes of ``text``, run as git runs it."""
    command = shell_variable(SETUP_SH, "NOTEBOOK_FILTER")
    return subprocess.run(
        command, shell=True, cwd=cwd, input=text, capture_output=True, text=True, check=True
    ).stdout


def as_jupyterlab_saves_it_after_a_run(text: str) -> str:
    """``text`` with what running it in JupyterLab adds: outputs, counts, kernel info."""
    import nbformat

    nb = nbformat.reads(text, as_version=4)
    nb.metadata.kernelspec.display_name = "Python 3 (ipykernel)"
    nb.metadata.language_info = {
        "name": "python",
        "version": "3.11.2",
        "mimetype": "text/x-python",
        "pygments_lexer": "ipython3",
        "file_extension": ".py",
    }
    nb.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for count, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = count + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {count}\n")]
        cell.metadata.execution = {"iopub.status.idle": "2026-11-23T10:00:00Z"}
        cell.metadata.scrolled = True
    return nbformat.writes(nb) + "\n"


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    who = ["-c", "user.name=Student", "-c", "user.email=student@example.org"]
    return subprocess.run(["git", *who, *args], cwd=cwd, capture_output=True, text=True)


def test_clean_filter_gives_the_stored_form_of_a_run_notebook() -> None:
    stored = filter_output(A_NOTEBOOK.read_text())
    run = as_jupyterlab_saves_it_after_a_run(stored)
    assert run != stored
    assert filter_output(run) == stored
    assert '"outputs": []' in stored and '"execution_count": null' in stored
    assert "3.11.2" not in stored and "iopub" not in stored and "widget-state" not in stored


def test_clean_filter_writes_what_nbformat_and_jupyterlab_write() -> None:
    import nbformat

    module = load_script(CLEAN_NOTEBOOK)
    notebooks = sorted((ROOT / "labs").glob("*/*.ipynb"))
    assert notebooks
    for path in notebooks:
        for text in (path.read_text(), as_jupyterlab_saves_it_after_a_run(path.read_text())):
            stored = module.stored_form(text)
            assert stored == nbformat.writes(nbformat.reads(stored, as_version=4)) + "\n", path


@pytest.mark.parametrize(
    "path", sorted((ROOT / "labs").glob("*/*.ipynb")), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_notebooks_are_stored_as_the_filter_writes_them(path: Path) -> None:
    """Else a notebook a student only opened and ran differs from the stored one to git.
    A notebook committed through the filter is; `git add --renormalize labs` fixes others."""
    text = path.read_text()
    assert filter_output(text) == text, (
        f"{path.name} is not stored as the clean filter writes it: `make setup`, then "
        f"`git add --renormalize {path.relative_to(ROOT)}`"
    )


@pytest.mark.parametrize(
    "text",
    [
        '<<<<<<< HEAD\n{"cells": []}\n=======\n{"cells": [1]}\n>>>>>>> main\n',
        '{"not": "a notebook"}\n',
    ],
)
def test_clean_filter_passes_what_is_not_a_notebook_through(text: str) -> None:
    assert filter_output(text) == text


def test_setup_registers_the_notebook_filter() -> None:
    """After `make setup` (which `make test` and .ci/run run first) this clone has it."""
    assert "*.ipynb filter=labs-notebook" in GITATTRIBUTES.read_text().splitlines()
    top = git(ROOT, "rev-parse", "--show-toplevel")
    if top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not a git checkout of its own (setup configures git only there)")
    configured = git(ROOT, "config", "--get", "filter.labs-notebook.clean").stdout.strip()
    assert configured == shell_variable(SETUP_SH, "NOTEBOOK_FILTER"), (
        "run `make setup`: it registers the notebooks' clean filter in .git/config"
    )


def test_a_run_notebook_does_not_stop_git_pull(tmp_path: Path) -> None:
    """A student runs a notebook (JupyterLab saves outputs into it), the course changes it,
    and the README's update command brings the change; a cell the student edited stays."""
    assert UPDATE in README.read_text().splitlines(), "the README tells students how to update"
    upstream, student = tmp_path / "course", tmp_path / "student"
    (upstream / "scripts").mkdir(parents=True)
    shutil.copy(GITATTRIBUTES, upstream / ".gitattributes")
    shutil.copy(CLEAN_NOTEBOOK, upstream / "scripts" / CLEAN_NOTEBOOK.name)
    (upstream / "lab.ipynb").write_text(filter_output(A_NOTEBOOK.read_text()))
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "."],
        ["commit", "-qm", "course"],
        ["clone", "-q", str(upstream), str(student)],
    ):
        assert git(upstream, *args).returncode == 0
    (student / ".venv").symlink_to(ROOT / ".venv")
    git(
        student, "config", "filter.labs-notebook.clean", shell_variable(SETUP_SH, "NOTEBOOK_FILTER")
    )
    notebook = student / "lab.ipynb"

    def course_changes(old: str, new: str) -> str:
        text = (upstream / "lab.ipynb").read_text().replace(old, new, 1)
        (upstream / "lab.ipynb").write_text(text)
        assert git(upstream, "commit", "-qam", "course update").returncode == 0
        return text

    notebook.write_text(as_jupyterlab_saves_it_after_a_run(notebook.read_text()))
    assert git(student, "diff", "--quiet").returncode == 0, "a run alone is a change to git"
    course = course_changes("mini-batch", "minibatch")
    pulled = git(student, *UPDATE.split()[1:])
    assert pulled.returncode == 0, pulled.stderr
    assert notebook.read_text() == course  # the update, without the old run's outputs

    mine = notebook.read_text().replace("import ", "import  ", 1)
    notebook.write_text(as_jupyterlab_saves_it_after_a_run(mine))
    assert "1 insertion(+), 1 deletion(-)" in git(student, "diff", "--stat").stdout
    course_changes("mini-batch", "minibatch")
    pulled = git(student, *UPDATE.split()[1:])
    assert pulled.returncode == 0, pulled.stderr
    assert filter_output(notebook.read_text()) == mine.replace("mini-batch", "minibatch", 1)
