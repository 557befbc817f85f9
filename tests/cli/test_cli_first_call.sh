#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# moe-bench --first-call on the CPU backend with one rank and two: the report's shape (20 new
# counts, one ratio per rank on each row, the summary line, the JSON), never its timings.
#   test_cli_first_call.sh MOE_BENCH
set -u
moe_bench=$1
# shellcheck source=bench_cli_common.sh
. "$(dirname "$0")/bench_cli_common.sh"

for np in 1 2; do
    out=$tmp/out$np json=$tmp/fc$np.json
    timeout 120 mpirun --oversubscribe --bind-to none -x MOE_BACKEND -np $np "$moe_bench" \
        --first-call --experts 4 --top-k 2 --hidden 32 --intermediate 32 --capacity 512 \
        --json "$json" >"$out" 2>&1
    rc=$?
    check "np $np: exit 0 (got $rc)" [ $rc -eq 0 ]
    # a row: the count, a ratio per rank, the max, the max rank's first and steady times
    row="^ +[0-9]+( +[0-9]+\.[0-9]+){$((np + 3))}( +OVER 1\.1)?$"
    counts=$(grep -E "$row" "$out" | awk '{print $1}')
    check "np $np: 20 rows" [ "$(echo "$counts" | grep -c .)" -eq 20 ]
    check "np $np: 20 distinct odd counts in 1..511" \
        [ "$(echo "$counts" | sort -un | awk '$1 % 2 && $1 <= 511' | wc -l)" -eq 20 ]
    check "np $np: create times of $np rank(s)" \
        grep -qE "^# moe_layer_create \(ms\), per rank:( [0-9]+\.[0-9]+){$np}$" "$out"
    check "np $np: first forward after create, $np ratio(s)" \
        grep -qE "^# first forward after create \(64 tokens\), ratio per rank:( [0-9.]+){$np} " \
        "$out"
    summary="^# first call / steady: max [0-9.]+ \([0-9]+ tokens, rank [0-9]+\) over 20 new "
    summary+="counts x $np rank\(s\), target <= 1\.1: (ok|OVER); first forward after create / "
    summary+="steady: max [0-9.]+, target <= 2\.0: (ok|OVER)$"
    check "np $np: the summary line" grep -qE "$summary" "$out"
    check "np $np: rank 0 alone prints" [ "$(grep -c '^# --first-call: backend cpu' "$out")" -eq 1 ]
    check "np $np: JSON of $np rank(s)" grep -q "\"ranks\": $np," "$json"
    check "np $np: JSON of 21 steps" [ "$(grep -o '"m": ' "$json" | wc -l)" -eq 21 ]
    [ $fail -eq 0 ] || cat "$out"
done
[ $fail -eq 0 ]
