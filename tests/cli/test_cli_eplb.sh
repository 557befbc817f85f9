#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# moe-run --redundant-experts/--eplb/--route-skew on the CPU backend, 2 and 4 ranks: the rank
# load imbalance after the rebalance is at most 1.10 and below the one before, and the
# output_hash equals the run without redundant slots or rebalance (deterministic mode).
#   test_cli_eplb.sh MOE_RUN
set -u
moe_run=$1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader,tcp MOE_BACKEND=cpu
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-eplb-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail=0
shape=(--experts 32 --top-k 4 --hidden 64 --intermediate 64 --tokens 2048 --route-skew 1.2
    --deterministic --iters 1)
for np in 2 4; do
    run() { timeout 120 mpirun --oversubscribe --bind-to none -np "$np" "$moe_run" "${shape[@]}" "$@"; }
    if ! run >"$tmp/plain" 2>&1 || ! run --redundant-experts "$np" --eplb >"$tmp/eplb" 2>&1; then
        echo "FAIL: np $np: moe-run failed"
        tail -20 "$tmp/plain" "$tmp/eplb"
        fail=1
        continue
    fi
    h0=$(grep '^output_hash' "$tmp/plain")
    h1=$(grep '^output_hash' "$tmp/eplb")
    line=$(grep '^rank load imbalance (max/mean): before' "$tmp/eplb")
    before=$(echo "$line" | awk '{print $6}')
    after=$(echo "$line" | awk '{print $8}')
    echo "np $np: $line; $h0 / $h1"
    if [ -z "$h0" ] || [ "$h0" != "$h1" ]; then
        echo "FAIL: np $np: output_hash differs with --redundant-experts --eplb"
        fail=1
    fi
    if [ -z "$after" ] || ! awk -v a="$after" -v b="$before" 'BEGIN { exit !(a <= 1.10 && a < b) }'; then
        echo "FAIL: np $np: imbalance after $after (before $before): want <= 1.10 and below before"
        fail=1
    fi
done
exit $fail
