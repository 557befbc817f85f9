#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cmake/ptxas_guard.sh, the library's CUDA compiler launcher: a kernel whose wgmma ptxas
# serializes (here: issued on a divergent path, C7520) fails its compile under --fail, naming the
# function, and leaves no object, and compiles with a warning under --warn; the same wgmma on a
# uniform path compiles; a compile error keeps nvcc's status; no mode is a usage error.
#   test_ptxas_guard.sh NVCC GUARD
set -u
nvcc=$1 guard=$2
# shellcheck source=../common/check.sh
. "$(dirname "$0")/../common/check.sh"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-ptxas-guard-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# one wgmma (m64n8k16, bf16) under COND: a divergent one or a uniform one
kernel() {
    cat <<SRC
#include <cstdint>
__global__ void k_$1(float *out, uint64_t da, uint64_t db, int n)
{
    float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
    if ($2) {
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, "
                     "p, 1, 1, 0, 0;\n}"
                     : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                     : "l"(da), "l"(db), "r"(1));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    out[threadIdx.x] = d0 + d1 + d2 + d3;
}
SRC
}
compile() { # NAME [MODE]: $tmp/NAME.cu through the guard (--fail) into $tmp/NAME.o; $tmp/NAME.log
    bash "$guard" "${2:---fail}" "$nvcc" -gencode=arch=compute_90a,code=sm_90a -c "$tmp/$1.cu" \
        -o "$tmp/$1.o" >"$tmp/$1.log" 2>&1
}
kernel divergent "threadIdx.x < n" >"$tmp/divergent.cu"
kernel uniform "n > 0" >"$tmp/uniform.cu"
printf '__global__ void k_bad(float *o) { o[0] = undefined_name; }\n' >"$tmp/bad.cu"

compile divergent
rc=$?
check "divergent wgmma: the compile fails (rc $rc)" [ $rc -ne 0 ]
check "divergent wgmma: ptxas's line kept" grep -q "instructions are serialized.*k_divergent" \
    "$tmp/divergent.log"
check "divergent wgmma: the guard says why" grep -q "^ptxas_guard: ptxas serialized" \
    "$tmp/divergent.log"
check "divergent wgmma: no object left" [ ! -e "$tmp/divergent.o" ]
cp "$tmp/divergent.cu" "$tmp/warned.cu"
sed -i 's/k_divergent/k_warned/' "$tmp/warned.cu"
compile warned --warn
rc=$?
check "divergent wgmma, --warn: compiles (rc $rc)" [ $rc -eq 0 ]
check "divergent wgmma, --warn: the object" [ -s "$tmp/warned.o" ]
check "divergent wgmma, --warn: the warning" grep -q "^ptxas_guard: warning: ptxas serialized" \
    "$tmp/warned.log"
compile uniform
rc=$?
check "uniform wgmma: compiles (rc $rc)" [ $rc -eq 0 ]
check "uniform wgmma: the object" [ -s "$tmp/uniform.o" ]
check "uniform wgmma: no serialization reported" \
    bash -c "! grep -q 'serialized' '$tmp/uniform.log'"
compile bad
rc=$?
check "a compile error: nvcc's failure kept (rc $rc)" [ $rc -ne 0 ]
check "a compile error: nvcc's message" grep -q "undefined_name" "$tmp/bad.log"
check "a compile error: not blamed on ptxas" bash -c "! grep -q 'ptxas_guard' '$tmp/bad.log'"
bash "$guard" "$nvcc" --version >"$tmp/usage.log" 2>&1
rc=$?
check "no mode: a usage error (rc $rc)" [ $rc -eq 2 ]
check "no mode: says so" grep -q "usage: ptxas_guard.sh --fail|--warn" "$tmp/usage.log"
[ $fail -eq 0 ] || cat "$tmp"/*.log
[ $fail -eq 0 ]
