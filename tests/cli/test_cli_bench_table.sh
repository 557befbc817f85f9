#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# moe-bench's table on the CPU backend, one rank and two: the header's rotation line (forced by
# --rotate, else 1 copy: no GPU L2), a row and a phases line per token count, the JSON's rotate
# and points, each with the layer's explain text, and the MOE_* environment it ran with; fp8
# with static activation scales and its refusals, fp8 with fast accumulation; never the timings.
#   test_cli_bench_table.sh MOE_BENCH
set -u
moe_bench=$1
# shellcheck source=bench_cli_common.sh
. "$(dirname "$0")/bench_cli_common.sh"

# a row: tokens, experts, mode, iters, then time, min, TFLOP/s, GB/s, limit, limit_exp, score
row='^ +(1|8|64) +[0-9]+ +eager +[0-9]+( +[0-9]+(\.[0-9]+)?){7}$'
# NP ROTATE(- for none) HEADER: one run, every rank prints its table
for run in "1 2 rotated over 2 copies (L2 0.0 MB): --rotate 2" \
    "1 - rotated over 1 copy (L2 0.0 MB): no GPU L2 (backend cpu)" \
    "2 3 rotated over 3 copies (L2 0.0 MB): --rotate 3"; do
    read -r np rot header <<<"$run"
    name="np $np rotate $rot"
    out=$tmp/out json=$tmp/t.json
    opt=()
    [ "$rot" = - ] || opt=(--rotate "$rot")
    MOE_BENCH_TEST='a"b' MOE_BENCH_COMMIT=c0ffee timeout 120 mpirun --oversubscribe --bind-to none \
        -x MOE_BACKEND -x MOE_BENCH_TEST -x MOE_BENCH_COMMIT -np "$np" "$moe_bench" \
        --experts 4 --top-k 2 --hidden 32 --intermediate 32 --tokens 1,8,64 --seconds 0.01 \
        "${opt[@]}" --json "$json" >"$out" 2>&1
    rc=$?
    check "$name: exit 0 (got $rc)" [ $rc -eq 0 ]
    check "$name: header \"$header\" per rank" [ "$(grep -cxF "# weights $header" "$out")" -eq "$np" ]
    check "$name: 3 rows per rank" [ "$(grep -cE "$row" "$out")" -eq $((3 * np)) ]
    check "$name: 3 phases lines per rank" \
        [ "$(grep -cE '^ +phases \(one profiled step, us\): route ' "$out")" -eq $((3 * np)) ]
    check "$name: JSON rotate" grep -q "\"backend\": \"cpu\", .*\"rotate\": ${rot/-/1}," "$json"
    check "$name: JSON of 3 points" [ "$(grep -o '"m": ' "$json" | wc -l)" -eq 3 ]
    check "$name: each point says what ran" \
        [ "$(grep -o '"explain": "cpu backend: reference kernels' "$json" | wc -l)" -eq 3 ]
    # (the environment may hold other MOE_* variables, digits in their names and escaped quotes
    # in their values: a CI run's MOE_REQUIRE_TORCH)
    check "$name: JSON has the MOE_* environment" \
        grep -qE '"env": \{("MOE_[A-Z0-9_]+": "([^"\\]|\\.)*", )*"MOE_BACKEND": "cpu", ("MOE_[A-Z0-9_]+": "([^"\\]|\\.)*", )*"MOE_BENCH_TEST": "a\\"b"' "$json"
    check "$name: JSON's env leaves the commit's variable to \"commit\"" \
        grep -q '"commit": "c0ffee", .*"env": {' "$json"
    ! grep -q '"MOE_BENCH_COMMIT"' "$json" || check "$name: no MOE_BENCH_COMMIT in env" false
    ! command -v python3 >/dev/null ||
        check "$name: JSON parses" python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$json"
    [ $fail -eq 0 ] || cat "$out"
done
# fp8 with static activation scales (--act-scales static): said in the title and the JSON; refused
# where the layer cannot take them (bf16, block scales), naming the option
out=$tmp/out json=$tmp/s.json
timeout 120 mpirun --oversubscribe --bind-to none -x MOE_BACKEND -np 1 "$moe_bench" \
    --experts 4 --top-k 2 --hidden 32 --intermediate 32 --tokens 1,8,64 --seconds 0.01 \
    --dtype fp8 --act-scales static --json "$json" >"$out" 2>&1
rc=$?
check "static: exit 0 (got $rc)" [ $rc -eq 0 ]
check "static: 3 rows" [ "$(grep -cE "$row" "$out")" -eq 3 ]
check "static: the title says so" grep -q "W8A8 per-tensor weights (static activation scales)" "$out"
check "static: JSON act_scales" grep -q '"scales": "per_tensor", "accum": "promoted", "act_scales": "static"' "$json"
# fp8 with --accum fast (W8A8_FAST): said in the title and the JSON; block scales promote anyway
for run in "channel fast fast accumulation" "block promoted W8A8_FAST: promoted"; do
    read -r scales accum title <<<"$run"
    timeout 120 mpirun --oversubscribe --bind-to none -x MOE_BACKEND -np 1 "$moe_bench" \
        --experts 4 --top-k 2 --hidden 32 --intermediate 32 --tokens 1,8 --seconds 0.01 \
        --dtype fp8 --scales "$scales" --accum fast --json "$json" >"$out" 2>&1
    rc=$?
    check "fast $scales: exit 0 (got $rc)" [ $rc -eq 0 ]
    check "fast $scales: the title says so" grep -q "W8A8 .* weights ($title)" "$out"
    check "fast $scales: JSON accum $accum" grep -q "\"accum\": \"$accum\"" "$json"
done
for bad in "" "--dtype fp8 --scales block"; do
    # shellcheck disable=SC2086 # $bad: options
    timeout 60 mpirun --oversubscribe --bind-to none -x MOE_BACKEND -np 1 "$moe_bench" \
        --experts 4 --top-k 2 --hidden 32 --intermediate 32 --tokens 1 $bad \
        --act-scales static >"$out" 2>&1
    rc=$?
    check "static with \"$bad\": refused (rc $rc)" [ $rc -ne 0 ]
    check "static with \"$bad\": the reason" grep -q -- "--act-scales static: static activation scales need --dtype fp8 --scales tensor" "$out"
done
[ $fail -eq 0 ] || cat "$out"
[ $fail -eq 0 ]
