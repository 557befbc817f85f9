#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA compiler launcher of the library's objects (CMakeLists.txt, MOE_PTXAS_GUARD): runs the
# compile command and looks at what ptxas says. Where it serialized wgmma instructions ("(C75xx)
# Potential Performance Loss: wgmma.mma_async instructions are serialized ...", an info line that
# neither nvcc nor ptxas's -Werror treats as an error) the kernel is correct but every wgmma is
# waited for before the next is issued, which nothing on a machine without a GPU would notice:
# --fail fails the compile (and removes the object), --warn adds a warning line.
#   ptxas_guard.sh --fail|--warn COMMAND...   (COMMAND: another launcher, such as ccache, or nvcc)
set -u
mode=${1:-}
case $mode in
--fail | --warn) shift ;;
*)
    echo "ptxas_guard: usage: ptxas_guard.sh --fail|--warn COMMAND... (got '$mode')" >&2
    exit 2
    ;;
esac
err=$(mktemp "${TMPDIR:-/tmp}/moe-ptxas-XXXXXX")
trap 'rm -f "$err"' EXIT
"$@" 2>"$err"
rc=$?
cat "$err" >&2
if [ $rc -eq 0 ] && grep -q 'wgmma.mma_async instructions are serialized' "$err"; then
    what="ptxas serialized wgmma instructions (the lines above name the functions and the cause);"
    what+=" a kernel must keep its wgmmas asynchronous (docs/KERNELS.md, \"sm_90a kernel\")"
    if [ "$mode" = --warn ]; then
        echo "ptxas_guard: warning: $what" >&2
    else
        # the object is written: take it away, so that no later build links it as good
        prev=""
        for a in "$@"; do
            [ "$prev" = "-o" ] && rm -f -- "$a"
            prev=$a
        done
        echo "ptxas_guard: $what; -DMOE_PTXAS_GUARD=WARN builds it anyway" >&2
        rc=1
    fi
fi
exit $rc
