#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets with clang and fuzzes the safetensors reader for N seconds.
#   tests/fuzz/run.sh [SECONDS] [BUILD_DIR]     (defaults: 60, build-fuzz)
# The kept corpus (tests/fuzz/corpus/safetensors) seeds the run; new inputs go to a scratch
# folder so the repository is not modified. Exit status: 0 clean, non-zero on a finding (the
# crashing input is left in BUILD_DIR/fuzz-artifacts/).
set -euo pipefail

secs=${1:-60}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${2:-$root/build-fuzz}

# clang with libFuzzer's runtime: installed with apt-get when missing and this runs as root
# (Debian: clang, and libclang-rt-<version>-dev for -fsanitize=fuzzer).
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "run.sh: installing $*" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 &&
              DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1; }
    else
        return 1
    fi
}
fuzzer_links() {
    local d
    d=$(mktemp -d)
    echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' >"$d/t.c"
    clang -fsanitize=fuzzer,address "$d/t.c" -o "$d/t" >/dev/null 2>&1
    local rc=$?
    rm -rf "$d"
    return $rc
}
command -v clang >/dev/null || apt_install clang ||
    { echo "run.sh: clang not found (apt-get install clang)" >&2; exit 1; }
if ! fuzzer_links; then
    v=$(clang -dumpversion | cut -d. -f1)
    apt_install "libclang-rt-$v-dev" && fuzzer_links ||
        { echo "run.sh: clang cannot link -fsanitize=fuzzer (apt-get install libclang-rt-$v-dev)" >&2; exit 1; }
fi

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DMOE_CUDA=OFF -DMOE_FUZZ=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target fuzz_safetensors -j"$(nproc)"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/moe-fuzz-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$build/fuzz-artifacts"

# -malloc_limit_mb: any single allocation above it is a finding ("no huge allocation").
# MOE_FUZZ_SEED + MOE_FUZZ_RUNS: a reproducible run of that many inputs (what CI uses, so a CI
# result never depends on timing); otherwise a random seed for SECONDS.
budget=(-max_total_time="$secs")
[ -n "${MOE_FUZZ_RUNS:-}" ] && budget=(-runs="$MOE_FUZZ_RUNS" -max_total_time=$((secs * 3)))
[ -n "${MOE_FUZZ_SEED:-}" ] && budget+=(-seed="$MOE_FUZZ_SEED")
"$build/tests/fuzz/fuzz_safetensors" "${budget[@]}" \
  -max_len=65536 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
  -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/" \
  -dict="$root/tests/fuzz/safetensors.dict" \
  "$scratch" "$root/tests/fuzz/corpus/safetensors"
echo "fuzz_safetensors: ${MOE_FUZZ_RUNS:+$MOE_FUZZ_RUNS runs, seed ${MOE_FUZZ_SEED:-random}, }${secs}s budget, no finding"
