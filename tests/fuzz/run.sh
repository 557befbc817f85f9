#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets with clang and fuzzes each parser in turn for a share of N
# seconds: the safetensors reader (about half), config.json, the index and name maps, the
# weight-value check, and the tune file reader.
#   tests/fuzz/run.sh [SECONDS] [BUILD_DIR]     (defaults: 60, build-fuzz)
# The kept corpora (tests/fuzz/corpus/<target>) seed the runs; new inputs go to scratch folders
# so the repository is not modified. Exit status: 0 clean, non-zero on a finding (the crashing
# or slow input is left in BUILD_DIR/fuzz-artifacts/).
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
targets=(safetensors config index scales tune)
# Per target, percent of SECONDS and of MOE_FUZZ_RUNS. Runs follow each target's speed (per
# input the value check is about 5x slower than the safetensors parser): with CI's
# MOE_FUZZ_RUNS=3000000 the first four take about 30 + 15 + 17 + 15 s on one core.
tshare=(45 15 15 15 10)
rshare=(45 15 15 5 20)
cmake --build "$build" --target "${targets[@]/#/fuzz_}" -j"$(nproc)"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/moe-fuzz-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$build/fuzz-artifacts"

# -malloc_limit_mb: any single allocation above it is a finding ("no huge allocation").
# -timeout: one input running longer is a finding. Every parser is O(n log n) in its input
# (at most 64 KiB here, milliseconds under ASan), so 3 s catches a quadratic path on crafted
# input (colliding keys, many shards) well before it could pass; -report_slow_units names
# inputs over 1 s.
# MOE_FUZZ_SEED + MOE_FUZZ_RUNS: a reproducible run of that many inputs in all (what CI uses,
# so a CI result never depends on timing); otherwise a random seed for SECONDS.
for i in "${!targets[@]}"; do
    t=${targets[$i]}
    secs_t=$(( (secs * ${tshare[$i]} + 50) / 100 ))
    [ "$secs_t" -ge 1 ] || secs_t=1
    budget=(-max_total_time="$secs_t")
    if [ -n "${MOE_FUZZ_RUNS:-}" ]; then
        runs_t=$(( MOE_FUZZ_RUNS * ${rshare[$i]} / 100 ))
        budget=(-runs="$runs_t" -max_total_time=$((secs_t * 3)))
    fi
    [ -n "${MOE_FUZZ_SEED:-}" ] && budget+=(-seed="$MOE_FUZZ_SEED")
    dict=$root/tests/fuzz/checkpoint.dict
    [ "$t" = safetensors ] && dict=$root/tests/fuzz/safetensors.dict
    [ "$t" = tune ] && dict=$root/tests/fuzz/tune.dict
    dictarg=(-dict="$dict")
    [ "$t" = scales ] && dictarg=()
    mkdir -p "$scratch/$t"
    "$build/tests/fuzz/fuzz_$t" "${budget[@]}" \
      -max_len=65536 -timeout=3 -report_slow_units=1 -rss_limit_mb=2048 -malloc_limit_mb=256 \
      -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$t-" "${dictarg[@]}" \
      "$scratch/$t" "$root/tests/fuzz/corpus/$t"
    echo "fuzz_$t: ${MOE_FUZZ_RUNS:+$runs_t runs, seed ${MOE_FUZZ_SEED:-random}, }${secs_t}s budget, no finding"
done
