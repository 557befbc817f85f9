#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Kernels launched with programmatic dependent launch touch no global memory before they wait
# for the previous kernel: in the sm_90a SASS of each FILE (libmoe.so), every function that
# holds `ACQBULK` (griddepcontrol.wait) has no global load, store, atomic, bulk or TMA copy
# before its first `ACQBULK` in the text. Such an access is what a compiler makes of a read it
# may hoist (an __ldg is an invariant load to it): the sm_90a GEMM once read the step's block
# count there and raced with the kernel that writes it (docs/KERNELS.md, "Integration notes",
# early weights). A pass is not a proof about every path (a branch may jump past the wait; the
# early-weights producer does so on purpose), but such a hoist lands before it in the text.
#   test_pdl_order.sh [--cuda-bin DIR] FILE...
# Fails on: an access before the wait, a FILE without sm_90a SASS or with no function that waits
# (the matcher no longer reads cuobjdump's layout), a matcher that misses its fake inputs.
# Exit 77 (skip) only when cuobjdump or nvdisasm (which cuobjdump -sass runs) is not found.
set -u
cuda_bin=""
if [ "${1:-}" = "--cuda-bin" ]; then
    cuda_bin=$2
    shift 2
fi
[ $# -gt 0 ] || {
    echo "usage: $0 [--cuda-bin DIR] FILE..." >&2
    exit 2
}
# shellcheck source=../common/check.sh
. "$(dirname "$0")/../common/check.sh"
# shellcheck source=../common/find_cuobjdump.sh
. "$(dirname "$0")/../common/find_cuobjdump.sh"

# `cuobjdump -sass` -> "FUNCTION OPCODE@ADDRESS" for each function that waits and has a global
# memory access before its first wait, then "waiting N" (functions holding ACQBULK).
early_access() {
    awk '
    /Function : /{fn = $NF; acq = 0; next}
    /^[ \t]*\/\*[0-9a-f]+\*\/[ \t]/{
        op = $2
        if (op ~ /^@/) op = $3
        if (op ~ /^ACQBULK/) {
            if (!(fn in waits)) {waits[fn] = 1; n++}
            acq = 1
            next
        }
        if (acq || fn in first) next
        split(op, p, ".")
        if (p[1] ~ /^(LDG|LD|LDGSTS|STG|ST|RED|REDG|ATOM|ATOMG|UBLKCP|UTMALDG|UTMASTG|UTMAREDG)$/)
            first[fn] = op "@" substr($1, 3, length($1) - 4)
    }
    END {
        for (f in first) if (f in waits) print f, first[f]
        print "waiting", n + 0
    }'
}

# ---- the matcher on fake inputs -----------------------------------------------------------
fake_sass='
	code for sm_90a
		Function : hoisted
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;      /* 0x00000a00ff017b82 */
        /*0060*/                   LDG.E.CONSTANT R0, desc[UR20][R2.64] ;      /* 0x0 */
        /*0300*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;      /* 0x0 */
        /*0310*/               @P1 BRA `(.L_x_2) ;      /* 0x0 */
        /*0320*/                   ACQBULK ;      /* 0x0 */
		Function : ordered
        /*0000*/                   LDC R1, c[0x0][0x28] ;      /* 0x0 */
        /*0010*/                   LDL R2, [R1] ;      /* 0x0 */
        /*0020*/                   STS [R3], R2 ;      /* 0x0 */
        /*0030*/                   ACQBULK ;      /* 0x0 */
        /*0040*/                   LDG.E R0, desc[UR4][R2.64] ;      /* 0x0 */
		Function : stored
        /*0000*/              @!P0 STG.E desc[UR4][R2.64], R5 ;      /* 0x0 */
        /*0010*/                   ACQBULK ;      /* 0x0 */
		Function : no_pdl
        /*0000*/                   LDG.E R0, desc[UR4][R2.64] ;      /* 0x0 */'
out=$(early_access <<<"$fake_sass")
check "self-test: a load hoisted above the wait is found (hoisted LDG.E.CONSTANT@0060)" \
    grep -qx 'hoisted LDG.E.CONSTANT@0060' <<<"$out"
check "self-test: a predicated store before the wait is found (stored STG.E@0000)" \
    grep -qx 'stored STG.E@0000' <<<"$out"
check "self-test: local, shared and constant accesses and loads past the wait pass" \
    test -z "$(grep '^ordered ' <<<"$out")"
check "self-test: a kernel that never waits is not judged" test -z "$(grep '^no_pdl ' <<<"$out")"
check "self-test: the waiting functions are counted (3)" grep -qx 'waiting 3' <<<"$out"

cuobjdump=$(find_cuobjdump "$cuda_bin")
if [ -z "$cuobjdump" ]; then
    if [ $fail -ne 0 ]; then
        echo "test_pdl_order: FAILED (self-tests); cuobjdump not found"
        exit 1
    fi
    echo "SKIP: cuobjdump not found (PATH, --cuda-bin '$cuda_bin', MOE_CUOBJDUMP, pip's" \
        "nvidia-cuda-cuobjdump): the device code was not checked"
    exit 77
fi
echo "cuobjdump: $cuobjdump"
# cuobjdump -sass runs nvdisasm: PATH, beside cuobjdump (pip's nvidia-cuda-nvdisasm installs it
# in the same folder as nvidia-cuda-cuobjdump), or --cuda-bin DIR
if ! command -v nvdisasm >/dev/null; then
    for d in "$(dirname "$cuobjdump")" "$cuda_bin"; do
        [ -n "$d" ] && [ -x "$d/nvdisasm" ] && PATH=$d:$PATH && break
    done
fi
if ! command -v nvdisasm >/dev/null; then
    if [ $fail -ne 0 ]; then
        echo "test_pdl_order: FAILED (self-tests); nvdisasm not found"
        exit 1
    fi
    echo "SKIP: nvdisasm not found (PATH, beside $cuobjdump, --cuda-bin '$cuda_bin'; pip's" \
        "nvidia-cuda-nvdisasm): cuobjdump -sass needs it, the device code was not checked"
    exit 77
fi
echo "nvdisasm: $(command -v nvdisasm)"
tmp=$(mktemp "${TMPDIR:-/tmp}/moe-pdl-order-XXXXXX")
trap 'rm -f "$tmp"' EXIT

for f in "$@"; do
    name=$(basename "$f")
    out=$("$cuobjdump" -sass -arch sm_90a "$f" 2>"$tmp" | early_access)
    err=$(head -c 200 "$tmp" | tr '\n' ' ')
    check "$name: cuobjdump -sass -arch sm_90a reads it${err:+ ($err)}" test -z "$err"
    n=$(sed -n 's/^waiting //p' <<<"$out")
    check "$name: $n sm_90a functions wait (griddepcontrol.wait), more than none" test "${n:-0}" -gt 0
    bad=$(grep -v '^waiting ' <<<"$out" | sort | head -8)
    nbad=$(grep -vc '^waiting ' <<<"$out")
    check "$name: no global access before the wait${bad:+ ($nbad functions, e.g.: $(tr '\n' ';' <<<"$bad"))}" \
        test -z "$bad"
done

if [ $fail -ne 0 ]; then
    echo "test_pdl_order: FAILED"
    exit 1
fi
echo "test_pdl_order: all checks passed"
