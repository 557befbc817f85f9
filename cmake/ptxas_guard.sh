#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA compiler launcher of the library's objects (CMakeLists.txt, MOE_PTXAS_GUARD): runs the
# compile command "$@" and fails it where ptxas reports that it serialized wgmma instructions
# ("(C75xx) Potential Performance Loss: wgmma.mma_async instructions are serialized ...", an
# info line that neither nvcc nor ptxas's -Werror treats as an error). Such a kernel is correct
# and can be several times slower: every wgmma waited for before the next is issued. Nothing on
# a machine without a GPU would notice it otherwise (docs/KERNELS.md, "Correctness test").
#   ptxas_guard.sh COMMAND...   (COMMAND: another launcher, such as ccache, or nvcc itself)
set -u
err=$(mktemp "${TMPDIR:-/tmp}/moe-ptxas-XXXXXX")
trap 'rm -f "$err"' EXIT
"$@" 2>"$err"
rc=$?
cat "$err" >&2
if [ $rc -eq 0 ] && grep -q 'wgmma.mma_async instructions are serialized' "$err"; then
    # the object is written: take it away, so that no later build links it as good
    prev=""
    for a in "$@"; do
        [ "$prev" = "-o" ] && rm -f -- "$a"
        prev=$a
    done
    echo "ptxas_guard: ptxas serialized wgmma instructions (the lines above name the functions" \
        "and the cause); a kernel must keep its wgmmas asynchronous (docs/KERNELS.md," \
        "\"Correctness test\"; -DMOE_PTXAS_GUARD=OFF builds it anyway)" >&2
    rc=1
fi
exit $rc
