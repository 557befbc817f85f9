#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One call on the GPU machine (device tool, carry .device, kind nvidia-h200-x2): build, the GPU
# tests (one GPU and mpirun -np 2), the expert-parallel dispatch benchmark and a weak-scaling
# check; logs under $OUT. Usage: bash bench/device_run.sh [quick]
set -uo pipefail
source .device/env.sh
export LIBRARY_PATH=/opt/dep/usr/lib/x86_64-linux-gnu:${LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
ngpu=$(nvidia-smi -L | wc -l)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_TEST_GPU_NP="$ngpu" \
    >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
start=$(date +%s)
cmake --build build-gpu -j"$(nproc)" >"$OUT/build.log" 2>&1 ||
    { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "build: $(($(date +%s) - start)) s"
timeout 300 ctest --test-dir build-gpu -L gpu -R "${GPU_TESTS:-.}" --output-on-failure --timeout 240 \
    >"$OUT/ctest_gpu.log" 2>&1
grep -E "Test +#|tests passed|rel err|FAIL|ERROR" "$OUT/ctest_gpu.log" | head -60
[ "${1:-}" = quick ] && exit 0
if [ "$ngpu" -ge 2 ]; then
    timeout 150 mpirun -np "$ngpu" build-gpu/launch/moe-bench --dispatch-only 2>&1 |
        tee "$OUT/dispatch.log"
    for T in 64 512; do
        for np in 1 "$ngpu"; do
            echo "== weak scaling: qwen3-30b-a3b, $np GPU(s), $((T * np)) tokens"
            timeout 90 mpirun -np "$np" build-gpu/launch/moe-run --preset qwen3-30b-a3b \
                --tokens $((T * np)) --iters 30 --warmup 3 2>&1 | grep -E "phase|tokens/s|checksum"
        done
    done 2>&1 | tee "$OUT/weak.log"
fi
