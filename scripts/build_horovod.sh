#!/usr/bin/env bash
# Build Horovod 0.28.1 with PyTorch, Gloo and MPI (and NCCL where a CUDA build is
# possible), install it into $PYTHON's environment, and check the build.
#
#   PYTHON=.venv/bin/python bash scripts/build_horovod.sh
#
# Horovod 0.28.1 is the last release and predates torch 2.x, so its source is
# patched before the build (C++ standard, see patch_cxx_standard). The wheel is
# cached under $LABS_CACHE/wheels (default ~/.cache/lab_utils/wheels), keyed on
# the torch, Python and CUDA versions, so the 4-8 minute build runs once per
# combination.
#
# Environment:
#   PYTHON                   interpreter to build for (default: python, else python3)
#   HOROVOD_GPU_OPERATIONS   NCCL or MPI; default NCCL when torch is a CUDA build
#                            and the CUDA toolkit (nvcc) is found, else unset (CPU)
#   HOROVOD_NCCL_HOME        where NCCL lives, when not in the system paths
#   HOROVOD_BUILD_JOBS       parallel compile jobs (default: number of cores)
#   HOROVOD_REBUILD=1        ignore the cached wheel and build again
set -euo pipefail

HOROVOD_VERSION=0.28.1

# The build flags. Dockerfile and environment.yml repeat them (checked by
# tests/test_setup_files.py): change them together.
HOROVOD_BUILD_FLAGS=(
    HOROVOD_WITH_PYTORCH=1
    HOROVOD_WITHOUT_TENSORFLOW=1
    HOROVOD_WITHOUT_MXNET=1
    HOROVOD_WITH_GLOO=1
    HOROVOD_WITH_MPI=1
)

# What the build needs in the target environment; pip builds with
# --no-build-isolation because an isolated build env would lack torch.
BUILD_REQUIREMENTS=(setuptools wheel packaging cloudpickle psutil pyyaml cffi)

say() { echo "build_horovod: $*"; }
die() { echo "build_horovod: ERROR: $*" >&2; exit 1; }

find_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        echo "$PYTHON"
    elif command -v python >/dev/null 2>&1; then
        echo python
    else
        echo python3
    fi
}

PYTHON=$(find_python)
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python interpreter '$PYTHON'"
for tool in cmake g++ make mpicxx mpirun; do
    command -v "$tool" >/dev/null 2>&1 \
        || die "'$tool' not found: install cmake, g++, make and OpenMPI (Debian: apt-get install -y cmake g++ make openmpi-bin libopenmpi-dev)"
done

# torch version, Python tag, CUDA version (or "cpu") and whether the CUDA toolkit is here.
read -r TORCH_VERSION PY_TAG TORCH_CUDA < <("$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("build_horovod: ERROR: torch is not importable; install PyTorch first")
cuda = torch.version.cuda
print(torch.__version__, f"cp{sys.version_info.major}{sys.version_info.minor}",
      "cu" + cuda.replace(".", "") if cuda else "cpu")
EOF
)
[[ -n "${TORCH_CUDA:-}" ]] || die "could not read the torch version from $PYTHON"

find_nvcc() {
    local candidate
    for candidate in "$(command -v nvcc 2>/dev/null || true)" \
        "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        [[ -n "$candidate" && -x "$candidate" ]] && { echo "$candidate"; return 0; }
    done
    return 1
}

if [[ -z "${HOROVOD_GPU_OPERATIONS:-}" && "$TORCH_CUDA" != cpu ]]; then
    if find_nvcc >/dev/null; then
        HOROVOD_GPU_OPERATIONS=NCCL
    else
        say "WARNING: torch is a CUDA build ($TORCH_CUDA) but no CUDA toolkit (nvcc) was found:"
        say "         building CPU operations only; CUDA tensors will not go through NCCL."
        say "         Install the CUDA toolkit (and NCCL, or set HOROVOD_NCCL_HOME) and rebuild with HOROVOD_REBUILD=1."
    fi
fi
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
[[ -z "$GPU_OPS" || "$GPU_OPS" == NCCL || "$GPU_OPS" == MPI ]] \
    || die "HOROVOD_GPU_OPERATIONS must be NCCL, MPI or empty, not '$GPU_OPS'"

# torch 2.x headers need C++17, torch >= 2.14's need C++20.
cxx_standard_for_torch() {
    "$PYTHON" - "$1" <<'EOF'
import sys
major, minor = (int(part) for part in sys.argv[1].split("+")[0].split(".")[:2])
print(20 if (major, minor) >= (2, 14) else 17 if major >= 2 else 14)
EOF
}
CXX_STANDARD=$(cxx_standard_for_torch "$TORCH_VERSION")

CACHE_ROOT=${LABS_CACHE:-$HOME/.cache/lab_utils}
ARCH=$(uname -m)
GPU_KEY=${GPU_OPS:+-${GPU_OPS,,}}
BUILD_KEY="horovod-${HOROVOD_VERSION}-torch${TORCH_VERSION}-${PY_TAG}-${TORCH_CUDA}${GPU_KEY}-${ARCH}"
WHEEL_DIR="$CACHE_ROOT/wheels/$BUILD_KEY"
LOG_DIR="$CACHE_ROOT/logs"

cached_wheel() { compgen -G "$WHEEL_DIR/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true; }

pip_quiet() { "$PYTHON" -m pip install --quiet "$@"; }

# Horovod's CMake compiles everything as C++14. torch >= 2 needs C++17 (>= 2.14:
# C++20) for the torch extension, and the bundled Gloo must then be C++17 too:
# compiled as C++14 it defines Store::kDefaultTimeout a second time and the link
# fails. Each edit must match once, so an upstream change cannot make it a no-op.
replace_once() {
    local file="$1" old="$2" new="$3"
    [[ $(grep -cF "$old" "$file") == 1 ]] || die "'$old' is not in $file exactly once: review the patch"
    sed -i "s/${old}/${new}/" "$file"  # BRE: parentheses are literal
}

patch_cxx_standard() {
    replace_once "$1/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    replace_once "$1/horovod/torch/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' \
        "set(CMAKE_CXX_STANDARD ${CXX_STANDARD})"
}

build_wheel() {
    local work log jobs
    work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
    # shellcheck disable=SC2064  # expand $work now
    trap "rm -rf '$work'" EXIT
    mkdir -p "$LOG_DIR"
    log="$LOG_DIR/$BUILD_KEY.log"
    # nproc --all: plain nproc honours OMP_NUM_THREADS, which `make test` sets to 1
    jobs=${HOROVOD_BUILD_JOBS:-$(nproc --all 2>/dev/null || echo 2)}

    say "downloading the Horovod $HOROVOD_VERSION source distribution"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --no-build-isolation \
        -d "$work" "horovod==$HOROVOD_VERSION"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    local src="$work/horovod-$HOROVOD_VERSION"
    patch_cxx_standard "$src"

    say "building for torch $TORCH_VERSION ($TORCH_CUDA), C++$CXX_STANDARD, GPU operations: ${GPU_OPS:-none}, $jobs jobs"
    say "this takes 4-8 minutes on 2 cores; full log: $log"
    local start=$SECONDS
    if ! env "${HOROVOD_BUILD_FLAGS[@]}" \
        ${GPU_OPS:+HOROVOD_GPU_OPERATIONS=$GPU_OPS} \
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        MAKEFLAGS="-j$jobs" \
        "$PYTHON" -m pip wheel --verbose --no-build-isolation --no-deps \
            -w "$work/dist" "$src" >"$log" 2>&1; then
        grep -E 'error|Error|multiple definition|undefined reference' "$log" | tail -n 25 >&2 || true
        die "the Horovod build failed (full log: $log)"
    fi
    mkdir -p "$WHEEL_DIR"
    cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
    say "built in $((SECONDS - start)) s, cached in $WHEEL_DIR"
}

# horovodrun --check-build must show every part this build promised.
verify_build() {
    local horovodrun report part missing=()
    horovodrun="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/horovodrun"
    [[ -x "$horovodrun" ]] || die "horovodrun is missing next to $PYTHON"
    report=$("$horovodrun" --check-build) || die "'horovodrun --check-build' failed"
    local expected=(PyTorch MPI Gloo)
    [[ -n "$GPU_OPS" ]] && expected+=("$GPU_OPS")
    for part in "${expected[@]}"; do
        grep -Eq "\[X\] ${part}[[:space:]]*$" <<<"$report" || missing+=("$part")
    done
    if ((${#missing[@]})); then
        echo "$report" >&2
        die "Horovod was built without: ${missing[*]} (a build without MPI gives every process rank 0 under mpirun)"
    fi
    say "verified with horovodrun --check-build: ${expected[*]}"
}

say "installing the build requirements (${BUILD_REQUIREMENTS[*]})"
pip_quiet "${BUILD_REQUIREMENTS[@]}"

wheel=$(cached_wheel)
if [[ -n "$wheel" && "${HOROVOD_REBUILD:-0}" != 1 ]]; then
    say "using the cached wheel $wheel"
else
    build_wheel
    wheel=$(cached_wheel)
    [[ -n "$wheel" ]] || die "no wheel in $WHEEL_DIR after the build"
fi
pip_quiet --force-reinstall --no-deps "$wheel"
verify_build
