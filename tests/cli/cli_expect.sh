# shellcheck shell=bash
# SPDX-License-Identifier: Apache-2.0
# Sourced by the tools' bad-input and agreement tests: MPI as root on this host, mpirun bounded
# by `timeout`, a temporary folder $tmp (removed on exit), pass/fail counters and
#   expect NAME WANT_STATUS SUBSTRING COMMAND...   (WANT_STATUS "nz": any status 1..123; exit
#                                                    124 (timed out) or >= 128 (a signal) fails)
#   count_in_output SUBSTRING N                     (the last case printed it on N lines)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader,tcp
# shellcheck disable=SC2034 # used by the sourcing script
mpirun=(timeout 60 mpirun --oversubscribe --bind-to none)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-cli-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

expect() {
    local name=$1 want=$2 sub=$3 rc
    shift 3
    "$@" >"$tmp/out" 2>&1
    rc=$?
    if { [ "$want" = nz ] && { [ $rc -eq 0 ] || [ $rc -ge 124 ]; }; } ||
        { [ "$want" != nz ] && [ $rc -ne "$want" ]; }; then
        echo "FAIL: $name: exit $rc, expected $want: $*"
        tail -20 "$tmp/out"
        fail=$((fail + 1))
    elif ! grep -qF -- "$sub" "$tmp/out"; then
        echo "FAIL: $name: exit $rc but no \"$sub\" in the output of: $*"
        tail -20 "$tmp/out"
        fail=$((fail + 1))
    else
        echo "ok: $name (exit $rc)"
        pass=$((pass + 1))
    fi
}

count_in_output() {
    local n
    n=$(grep -cF -- "$1" "$tmp/out")
    if [ "$n" -ne "$2" ]; then
        echo "FAIL: \"$1\" printed $n times, expected $2"
        fail=$((fail + 1))
    fi
}
