#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# moe-launch when one of 4 ranks is stopped (SIGSTOP) or killed (SIGKILL) mid-run: every one of
# the 3 survivors must print its libmoe status (TIMEOUT or MPI_ERROR), the job must end, and its
# exit status must be non-zero (docs/RELIABILITY.md, "Every survivor reports").
#   test_launch_faults.sh MOE_LAUNCH MOE_RUN
set -u
launch=$1
moe_run=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader,tcp
export MOE_TIMEOUT_MS=3000
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-launch-test-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail=0

# one SIGNAL: start 4 ranks, signal the last moe-run 6 s in, check the survivors and the end
one() {
    local sig=$1 marker=$((40000 + RANDOM)) pids victim rc n start
    start=$SECONDS
    timeout 120 "$launch" --np 4 --bind none --exe "$moe_run" -- --backend cpu --iters 1000000 \
        --warmup 0 --tokens 8 --seed "$marker" >"$tmp/out" 2>&1 &
    local tpid=$!
    sleep 6
    # the moe-run processes of this launch (their command lines carry the marker seed)
    pids=$(pgrep -f -- "--seed $marker" | while read -r p; do
        [ "$(cat /proc/"$p"/comm 2>/dev/null)" = moe-run ] && echo "$p"; done)
    victim=$(echo "$pids" | tail -1)
    if [ -z "$victim" ] || [ "$(echo "$pids" | wc -l)" -ne 4 ]; then
        echo "FAIL: $sig: 4 ranks not found (got: $pids)"; wait "$tpid"; cat "$tmp/out"
        fail=$((fail + 1)); return
    fi
    kill -"$sig" "$victim"
    wait "$tpid"
    rc=$?
    n=$(grep -cE '^moe-run: rank [0-9]+: .*MOE_STATUS_(TIMEOUT|MPI_ERROR)' "$tmp/out")
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$n" -lt 3 ]; then
        echo "FAIL: $sig: exit $rc after $((SECONDS - start)) s, $n of 3 survivors reported"
        grep -v '^#' "$tmp/out" | tail -25
        fail=$((fail + 1))
    else
        echo "ok: $sig: exit $rc after $((SECONDS - start)) s, $n of 3 survivors reported"
    fi
    kill -KILL "$victim" 2>/dev/null # never left behind
}

one STOP
one KILL
[ "$fail" -eq 0 ]
