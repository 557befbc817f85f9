#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The fused decode kernel on one GPU (device tool, carry .device): build the few targets it
# needs, then the MODEs in turn; logs under $OUT. Usage: bash bench/decode_run.sh [MODE...]
#   decode  test_gpu_decode
#   tests   test_gpu_layer, test_gpu_fp8 (one rank)
#   profile Nsight Compute on the forced kernel in a bf16 step of moe-run (bf16 x;
#           PROFILE_PRESET, default qwen3-30b-a3b; PROFILE_TOKENS, default "1 8"): speed of
#           light, memory workload, warp states, occupancy, into $OUT/ncu_decode.txt
#   bench   moe-bench at M = 1, 8, 64 (--explain) for the three presets, bf16 and fp8
#           per-tensor: VARIANTS of grouped (MOE_FUSED_DECODE=0), fused (forced), fused-k1
#           (forced, GEMM 1 split along k: MOE_DECODE_K1_SPLIT=0), builtin (the built-in
#           crossover)
# BUILD_DIR (default /tmp/b35) keeps the build between calls on a warm machine.
set -uo pipefail
# shellcheck source=/dev/null # written by shared/device/prepare.sh, not in the repository
source "${DEVICE_ENV:-.device/env.sh}"
export LIBRARY_PATH=/opt/dep/usr/lib/x86_64-linux-gnu:${LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
B=${BUILD_DIR:-/tmp/b35}
mkdir -p "$OUT"
nvidia-smi -L
start=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 ||
    { tail -30 "$OUT/cmake.log"; exit 1; }
ninja -C "$B" moe-bench moe-run test_gpu_decode test_gpu_layer test_gpu_fp8 >"$OUT/build.log" 2>&1 ||
    { grep -E "error|Error" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(($(date +%s) - start)) s"
export MOE_REQUIRE_GPU=1
quiet() { grep -vE "dlopen|pmix|Perhaps"; }
[ $# -gt 0 ] || set -- decode tests bench
for mode in "$@"; do
case $mode in
decode)
    timeout 240 "$B/tests/gpu/test_gpu_decode" >"$OUT/decode.log" 2>&1
    echo "test_gpu_decode rc=$?"
    grep -E "FAIL|PASSED|FAILED|Error|error" "$OUT/decode.log" | head -20
    ;;
tests)
    timeout 200 "$B/tests/gpu/test_gpu_layer" >"$OUT/layer.log" 2>&1
    echo "test_gpu_layer rc=$?"
    grep -E "FAIL|PASSED|FAILED" "$OUT/layer.log" | head -10
    timeout 200 mpirun -np 1 "$B/tests/mpi/test_gpu_fp8" >"$OUT/fp8.log" 2>&1
    echo "test_gpu_fp8 np1 rc=$?"
    grep -E "PASSED|FAILED" "$OUT/fp8.log" | head -10
    ;;
profile)
    command -v ncu >/dev/null || { echo "profile: no ncu on this machine"; continue; }
    for T in ${PROFILE_TOKENS:-1 8}; do
        echo "== ${PROFILE_PRESET:-qwen3-30b-a3b} bf16 $T tokens" |
            tee -a "$OUT/ncu_decode.txt"
        MOE_FORCE_VARIANT=sm90_fused_decode timeout 240 ncu --clock-control none \
            -k regex:decode_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
            "$B/launch/moe-run" --backend cuda --preset "${PROFILE_PRESET:-qwen3-30b-a3b}" \
            --dtype bf16 --x-dtype bf16 --tokens "$T" --iters 2 --warmup 1 \
            >>"$OUT/ncu_decode.txt" 2>&1
        echo "ncu rc=$?"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall" \
            "$OUT/ncu_decode.txt" | tail -12
    done
    ;;
bench)
    mkdir -p /tmp/json
    for p in ${PRESETS:-qwen3-30b-a3b mixtral-8x7b deepseek-v3-ep8}; do
        for dt in ${DTYPES:-bf16 fp8}; do
            f=()
            [ "$dt" = fp8 ] && f=(--dtype fp8 --scales tensor)
            for v in ${VARIANTS:-grouped fused}; do
                case $v in
                builtin) env="MOE_FUSED_DECODE=1" ;; # the built-in crossover
                fused) env="MOE_FORCE_VARIANT=sm90_fused_decode" ;;
                fused-k1) # GEMM 1 split along k by the shape's rule
                    env="MOE_FORCE_VARIANT=sm90_fused_decode MOE_DECODE_K1_SPLIT=0" ;;
                grouped) env="MOE_FUSED_DECODE=0" ;; # the oracle's grouped variants, as before
                esac
                echo "== $p $dt $v"
                # shellcheck disable=SC2086 # $env: VAR=value words
                env $env timeout "${BENCH_TIMEOUT:-150}" "$B/launch/moe-bench" --preset "$p" "${f[@]}" \
                    --tokens "${TOKENS:-1,8,64}" --seconds "${SECONDS_PER_POINT:-0.3}" \
                    --json "/tmp/json/$p.$dt.$v.json" --explain 2>&1 | quiet |
                    grep -vE "^#  *(limit|time)" | tee -a "$OUT/bench.log" | head -24
            done
        done
    done
    tar czf "$OUT/json.tgz" -C /tmp json
    ;;
esac
done
