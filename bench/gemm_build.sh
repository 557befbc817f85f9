#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Builds the grouped-GEMM test and benchmark alone (no libmoe, no MPI): nvcc + cc into $1
# (default build-gemm-standalone); the CMake build makes the same benchmark as bench/gemm_bench.
# Usage: bench/gemm_build.sh [outdir]
set -e
cd "$(dirname "$0")/.."
out=${1:-build-gemm-standalone}
mkdir -p "$out"
NVCC=${NVCC:-nvcc}
CC=${CC:-cc}
inc="-I include -I . -I tests/common"
cuinc=$(dirname "$(command -v "$NVCC")")/../include
nvflags="-O3 -std=c++17 --expt-relaxed-constexpr -lineinfo $inc -Xptxas -v"
sm90=""
pids=""
for f in kernels/cuda/expert_gemm*_sm90.cu; do
    o="$out/$(basename "$f" .cu).o"
    $NVCC $nvflags -gencode=arch=compute_90a,code=sm_90a -c "$f" -o "$o" \
        2> "$out/ptxas_$(basename "$f" .cu).txt" &
    pids="$pids $!"
    sm90="$sm90 $o"
done
$NVCC $nvflags -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
    -c kernels/cuda/expert_gemm_sm80.cu -o "$out/expert_gemm_sm80.o" 2> "$out/ptxas_sm80.txt" &
p2=$!
$NVCC $nvflags -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
    -c kernels/cuda/expert_gemm_simple.cu -o "$out/expert_gemm_simple.o" 2> "$out/ptxas_simple.txt" &
p3=$!
$NVCC $nvflags -gencode=arch=compute_80,code=sm_80 -c kernels/cuda/gpu.cu -o "$out/gpu.o" \
    2> "$out/ptxas_gpu.txt" || { cat "$out/ptxas_gpu.txt"; exit 1; }
cflags="-std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Wno-unused-parameter -DMOE_HAVE_CUDA=1 $inc -I $cuinc"
for f in kernels/expert_gemm.c kernels/expert_gemm_table.c runtime/oracle.c base/json.c \
    base/diag.c base/env.c runtime/formats/file.c tests/gpu/test_gpu_expert_gemm.c \
    bench/gemm_bench.c; do
    $CC $cflags -c "$f" -o "$out/$(basename "$f" .c).o"
done
for p in $pids; do
    wait "$p" || { cat "$out"/ptxas_expert_gemm*_sm90.txt; exit 1; }
done
wait $p2 || { cat "$out/ptxas_sm80.txt"; exit 1; }
wait $p3 || { cat "$out/ptxas_simple.txt"; exit 1; }
common="$sm90 $out/expert_gemm_sm80.o $out/expert_gemm.o $out/expert_gemm_table.o"
common="$common $out/expert_gemm_simple.o $out/gpu.o $out/oracle.o $out/json.o $out/diag.o $out/env.o"
common="$common $out/file.o"
$NVCC -o "$out/test_gpu_expert_gemm" "$out/test_gpu_expert_gemm.o" $common -lm
$NVCC -o "$out/gemm_bench" "$out/gemm_bench.o" $common -lm
echo "built $out/test_gpu_expert_gemm $out/gemm_bench"
