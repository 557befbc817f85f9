#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up, build and run libmoe on this machine in one command (README's first two commands,
# and what .ci/run calls):
#   ./launch/dev.sh run  [moe-run options]   packages + build + a MoE layer under mpirun
#   ./launch/dev.sh test [ctest options]     packages + build + the test suite
# Environment: MOE_NP (ranks for run, default 2), MOE_CMAKE_ARGS (extra configure flags),
# BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
PKGS="libopenmpi-dev openmpi-bin libhwloc-dev libcmocka-dev pkg-config cmake ninja-build"
# The tests also start a real Slurm (slurm-wlm, munge), fuzz with clang's libFuzzer and make a
# Python virtual environment for the Python package's tests (python3-venv).
TEST_PKGS="slurm-wlm munge clang python3-venv"

deps() {
    local missing=() p sudo=""
    for p in $PKGS ${1:-}; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -ne 0 ] && sudo=sudo
    echo "dev.sh: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

build() {
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MOE_CMAKE_ARGS:-} "$@" \
        >/dev/null
    cmake --build "$BUILD_DIR" -j"$(nproc)"
}

# The Python tests' interpreter: $BUILD_DIR/pyenv with python/requirements-test.txt (torch,
# transformers, pytest from PyPI), made once and remade when the requirements change. Without
# PyPI the Python tests skip (CI sets MOE_REQUIRE_TORCH=1, which makes that a failure).
pyenv() {
    local venv=$BUILD_DIR/pyenv req=python/requirements-test.txt t0=$SECONDS
    if [ -x "$venv/bin/python" ] && cmp -s "$req" "$venv/.requirements"; then
        return 0
    fi
    echo "dev.sh: installing torch, transformers and pytest into $venv" >&2
    mkdir -p "$BUILD_DIR"
    if python3 -m venv "$venv" && "$venv/bin/pip" install -q -r "$req"; then
        cp "$req" "$venv/.requirements"
        echo "dev.sh: Python test requirements installed in $((SECONDS - t0)) s" >&2
    else
        echo "dev.sh: could not install python/requirements-test.txt: the python tests skip" >&2
    fi
}

# Open MPI refuses root unless told; oversubscribe so N ranks run on fewer cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

cmd=${1:-run}
shift || true
case "$cmd" in
run)
    deps && build
    np=${MOE_NP:-2}
    args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--preset tiny --tokens 256)
    exec mpirun --oversubscribe --bind-to none -np "$np" "$BUILD_DIR/launch/moe-run" "${args[@]}"
    ;;
test)
    deps "$TEST_PKGS" && pyenv && build -DMOE_PYTHON="$(cd "$BUILD_DIR" && pwd)/pyenv/bin/python"
    exec ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 "$@"
    ;;
*)
    echo "usage: $0 run|test [args]" >&2
    exit 2
    ;;
esac
