#!/usr/bin/env bash
# Sets up what the labs (and, for the tests, their tools) need, and skips what is
# already done, so a second run takes seconds:
#   1. system packages (OpenMPI, Fashion-MNIST, compilers) via apt when root;
#   2. the virtual environment .venv;
#   3. PyTorch (an importable torch is kept as it is);
#   4. this package with its extras (pip install -e '.[...]');
#   5. Horovod with PyTorch, MPI and Gloo (scripts/build_horovod.sh).
# and ships the course's JupyterLab settings (scripts/jupyterlab-overrides.json), and in
# a git checkout has git see notebooks without their outputs (scripts/clean_notebook.py).
#
# Usage: setup.sh [--for lab|test] [--plan]
#   --for lab    what the labs need (`make lab`): no browser, no Slurm daemons, no pytest
#   --for test   that and the tests' tools (`make test`, `make setup`; the default)
#   --plan       print the packages this would install, change nothing
#
# Environment:
#   LABS_SKIP_HOROVOD=1     do not build Horovod (the Horovod parts of the labs are skipped)
#   LABS_REQUIRE_HOROVOD=1  fail instead of skipping Horovod when a prerequisite is
#                           missing (the default when CI=true)
#   TORCH_SPEC              what pip installs when torch is missing (default torch==2.13.0)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Debian packages the labs need; Dockerfile and environment.yml name the same
# (checked by tests/test_setup_files.py).
APT_PACKAGES="openmpi-bin libopenmpi-dev dataset-fashion-mnist make cmake g++ bubblewrap openjdk-17-jre-headless iproute2"
# Debian's browser, for the tests that drive JupyterLab (tests/test_browser.py); not in
# the Dockerfile (Ubuntu's chromium is a snap) nor in environment.yml. Tests only.
BROWSER_APT_PACKAGES="chromium"
# Slurm and munge, for the one-node cluster the tests start (lab_utils/slurm_cluster.py,
# tests/test_slurm.py): not in environment.yml (conda has no Slurm daemons). Tests only.
SLURM_APT_PACKAGES="slurmctld slurmd slurm-client munge"
# pip extras: spark for Horovod on Spark (Lab 2); dev adds pytest, nbval and ruff, and
# browser Playwright for tests/test_browser.py (it drives Debian's chromium, downloads none).
LAB_EXTRAS="lab,spark"
TEST_EXTRAS="lab,dev,spark,browser"
# Only when the python3 found cannot make a venv or lacks the headers Horovod compiles against.
PYTHON_APT_PACKAGES="python3 python3-venv python3-dev"

VENV=.venv
PY=$VENV/bin/python
# Git's clean filter for *.ipynb (.gitattributes); git runs it from the checkout's top.
NOTEBOOK_FILTER=".venv/bin/python scripts/clean_notebook.py"
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
STAMP=$VENV/.lab-utils-install.sha256
ENVIRONMENT_CHANGED=0
# CI must test Horovod: there a missing prerequisite is an error, not a skip.
if [[ ${CI:-} == true ]]; then
    REQUIRE_HOROVOD=${LABS_REQUIRE_HOROVOD:-1}
else
    REQUIRE_HOROVOD=${LABS_REQUIRE_HOROVOD:-0}
fi

FOR=test
PLAN=0
while (($#)); do
    case $1 in
        --for) FOR=${2:-}; shift 2 || true ;;
        --for=*) FOR=${1#--for=}; shift ;;
        --plan) PLAN=1; shift ;;
        *) echo "usage: setup.sh [--for lab|test] [--plan]" >&2; exit 2 ;;
    esac
done
case $FOR in
    lab) WANTED_APT="$APT_PACKAGES" EXTRAS=$LAB_EXTRAS ;;
    test) WANTED_APT="$APT_PACKAGES $BROWSER_APT_PACKAGES $SLURM_APT_PACKAGES" EXTRAS=$TEST_EXTRAS ;;
    *) echo "setup.sh: --for takes lab or test, not '$FOR'" >&2; exit 2 ;;
esac

say() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }
is_root() { [[ $(id -u) -eq 0 ]]; }

missing_apt_packages() {
    local pkg python_packages missing=()
    for pkg in $WANTED_APT; do
        [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == "install ok installed" ]] \
            || missing+=("$pkg")
    done
    # The venv's interpreter once it exists (for the headers), else the one that makes it.
    local python=python3
    [[ -x $PY ]] && python=$PY
    if ! "$python" - <<'EOF' >/dev/null 2>&1
import ensurepip, os, sysconfig, venv
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
EOF
    then
        read -ra python_packages <<<"$PYTHON_APT_PACKAGES"
        missing+=("${python_packages[@]}")
    fi
    echo "${missing[*]}"
}

step_system_packages() {
    local missing tool
    if ! command -v dpkg-query >/dev/null 2>&1; then
        for tool in mpirun mpicxx cmake g++ make; do
            command -v "$tool" >/dev/null 2>&1 || missing+=" $tool"
        done
        say "[1/5] system packages: not a Debian system, not installing any${missing:+; missing:$missing}"
        return
    fi
    missing=$(missing_apt_packages)
    if [[ -z "$missing" ]]; then
        say "[1/5] system packages: already installed"
        return
    fi
    if is_root && command -v apt-get >/dev/null 2>&1; then
        say "[1/5] system packages: installing $missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        # shellcheck disable=SC2086  # a list of package names
        apt-get install -y -qq --no-install-recommends $missing >/dev/null
    else
        say "[1/5] system packages: MISSING: $missing"
        say "      install them with:  sudo apt-get install -y $missing"
        say "      continuing: the labs run without MPI; Horovod needs it"
    fi
}

step_venv() {
    if [[ -x $PY ]] && "$PY" -c 'import sys' 2>/dev/null; then
        say "[2/5] virtual environment $VENV: already there ($("$PY" -V))"
        return
    fi
    command -v python3 >/dev/null 2>&1 || die "python3 not found: install Python >= 3.10"
    say "[2/5] virtual environment $VENV: creating it with $(python3 -V)"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed (see above; Debian needs python3-venv)"
}

# One interpreter start (importing torch takes seconds) answers both questions:
# which torch is importable, and whether Horovod is installed, built with MPI
# and Gloo, and loads against that torch. Sets TORCH_VERSION and HOROVOD_STATE.
probe_environment() {
    TORCH_VERSION=none HOROVOD_STATE=missing
    read -r TORCH_VERSION HOROVOD_STATE < <("$PY" - "$HOROVOD_VERSION" <<'EOF' 2>/dev/null || echo "none missing"
import sys
try:
    import torch
except Exception:
    print("none missing")
    sys.exit()
try:
    import horovod
    import horovod.torch as hvd  # fails when built against another torch
    ok = horovod.__version__ == sys.argv[1] and hvd.mpi_built() and hvd.gloo_built()
except Exception:
    ok = False
print(torch.__version__, "ok" if ok else "missing")
EOF
) || true
}

step_torch() {
    probe_environment
    if [[ $TORCH_VERSION != none ]]; then
        say "[3/5] PyTorch: already installed ($TORCH_VERSION)"
        return
    fi
    say "[3/5] PyTorch: installing $TORCH_SPEC"
    "$PY" -m pip install --quiet "$TORCH_SPEC"
    ENVIRONMENT_CHANGED=1
}

pyproject_hash() { sha256sum pyproject.toml | cut -d' ' -f1; }

# The stamp holds pyproject.toml's hash and the extras installed with it: an install for
# the tests also serves the labs, one for the labs lacks the tests' extras.
package_installed() {
    local hash extras extra
    [[ -f $STAMP && -x $VENV/bin/lab-grade ]] || return 1
    read -r hash extras <"$STAMP"
    extras=${extras:-$TEST_EXTRAS}  # a stamp holding only the hash: the full install
    [[ $hash == "$(pyproject_hash)" ]] || return 1
    for extra in ${EXTRAS//,/ }; do
        [[ ,$extras, == *,$extra,* ]] || return 1
    done
}

step_package() {
    if package_installed; then
        say "[4/5] lab_utils [$EXTRAS]: already installed (pyproject.toml unchanged)"
        return
    fi
    # spark: pyspark + pyarrow (~660 MB) for Horovod on Spark.
    say "[4/5] lab_utils: pip install -e '.[$EXTRAS]'"
    "$PY" -m pip install --quiet -e ".[$EXTRAS]"
    echo "$(pyproject_hash) $EXTRAS" >"$STAMP"
    ENVIRONMENT_CHANGED=1
}

step_horovod() {
    if [[ ${LABS_SKIP_HOROVOD:-0} == 1 ]]; then
        say "[5/5] Horovod: skipped (LABS_SKIP_HOROVOD=1)"
        return
    fi
    if [[ $ENVIRONMENT_CHANGED == 1 ]]; then
        probe_environment
    fi
    if [[ $HOROVOD_STATE == ok ]]; then
        say "[5/5] Horovod $HOROVOD_VERSION (PyTorch, MPI, Gloo): already installed"
        return
    fi
    local tool missing=()
    for tool in cmake g++ make mpicxx mpirun; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    if ((${#missing[@]})); then
        local message="cannot build Horovod: ${missing[*]} not found (see step 1)"
        [[ $REQUIRE_HOROVOD == 1 ]] && die "$message"
        say "[5/5] Horovod: SKIPPED, $message; the Horovod parts of the labs will not run"
        return
    fi
    say "[5/5] Horovod $HOROVOD_VERSION: installing (scripts/build_horovod.sh)"
    PYTHON=$PY bash scripts/build_horovod.sh
}

# The course's JupyterLab settings (no news pop-up, no update check): JupyterLab reads
# overrides.json from the environment's share/jupyter/lab/settings.
step_lab_settings() {
    local target=$VENV/share/jupyter/lab/settings/overrides.json
    if cmp -s scripts/jupyterlab-overrides.json "$target"; then
        return
    fi
    mkdir -p "$(dirname "$target")"
    cp scripts/jupyterlab-overrides.json "$target"
    say "JupyterLab course settings: installed $target"
}

# Running a notebook writes outputs into it; with this filter git compares and commits
# notebooks as they are stored, so a notebook that was only run is unchanged to git and
# `git pull` updates it instead of stopping on a conflict. Local to this clone.
step_notebook_filter() {
    local top
    top=$(git rev-parse --show-toplevel 2>/dev/null) || return 0  # no git (the container)
    [[ $top -ef . ]] || return 0  # a copy inside some other repository: not ours to configure
    if [[ $(git config --local --get filter.labs-notebook.clean) == "$NOTEBOOK_FILTER" ]]; then
        return
    fi
    git config --local filter.labs-notebook.clean "$NOTEBOOK_FILTER"
    say "git: notebooks compared and committed without outputs (filter.labs-notebook, .gitattributes)"
}

# What --plan prints: one line per kind of install, parsed by tests/test_setup_files.py.
print_plan() {
    echo "for: $FOR"
    echo "apt: $WANTED_APT"
    echo "pip: -e .[$EXTRAS]"
}

if ((PLAN)); then
    print_plan
    exit 0
fi

start=$SECONDS
say "setting up for ${FOR}s"
step_system_packages
step_venv
step_torch
step_package
step_horovod
step_lab_settings
step_notebook_filter
say "done in $((SECONDS - start)) s"
