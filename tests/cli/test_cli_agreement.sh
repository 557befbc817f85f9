#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Ranks started with different environments or files (MPMD launches), and files that are not
# regular: every case must end promptly with the expected exit status and a message naming the
# variable or path and the values (docs/RELIABILITY.md).
#   test_cli_agreement.sh MOE_RUN TEST_CHECKPOINT [MOE_BENCH MOE_TUNE]   (the last two: CUDA
#   builds; TEST_CHECKPOINT writes the checkpoint fixtures)
set -u
moe_run=$1
fixtures=$2
moe_bench=${3:-}
moe_tune=${4:-}
# shellcheck source=cli_expect.sh
. "$(dirname "$0")/cli_expect.sh"

run=(--tokens 16 --iters 1 --warmup 0)
# mpmd VAR=VALUE [VAR=VALUE]: rank 0 with the first environment, rank 1 with the second ("-":
# none), both running moe-run "${run[@]}"
mpmd() {
    local a=$1 b=$2
    shift 2
    "${mpirun[@]}" -np 1 env ${a/#-/} "$moe_run" "${run[@]}" "$@" : \
        -np 1 env ${b/#-/} "$moe_run" "${run[@]}" "$@"
}

# ---- knobs that change what ranks exchange: agreed at layer create, one family a case -------
# dispatch threshold (the CPU all-gather/all-to-all choice): used to overflow a buffer
expect knob-ag-max-tokens 1 "MOE_STATUS_MISMATCH (MOE_AG_MAX_TOKENS differs among ranks: 0 on rank 0, 32 (unset: the default) on rank 1" \
    mpmd MOE_AG_MAX_TOKENS=0 -
count_in_output "MOE_AG_MAX_TOKENS differs among ranks" 2
# determinism
expect knob-deterministic 1 "MOE_DETERMINISTIC differs among ranks: 0 (unset: the default) on rank 0, 1 on rank 1" \
    mpmd - MOE_DETERMINISTIC=1
count_in_output "MOE_DETERMINISTIC differs among ranks" 2
# lanes and layouts of the CUDA all-to-all (agreed on every backend)
expect knob-microbatch 1 "MOE_EP_MICROBATCH differs among ranks: 1 on rank 0, 0 (unset: the default) on rank 1" \
    mpmd MOE_EP_MICROBATCH=1 -
count_in_output "MOE_EP_MICROBATCH differs among ranks" 2
expect knob-chunk-tokens 1 "MOE_EP_CHUNK_TOKENS differs among ranks: 64 on rank 0, 128 on rank 1" \
    mpmd MOE_EP_CHUNK_TOKENS=64 MOE_EP_CHUNK_TOKENS=128
# transports and variants (strings)
expect knob-transport 1 "MOE_FORCE_TRANSPORT differs among ranks: p2p on rank 0, (unset) on rank 1" \
    mpmd MOE_FORCE_TRANSPORT=p2p -
count_in_output "MOE_FORCE_TRANSPORT differs among ranks" 2
expect knob-variant 1 "MOE_FORCE_VARIANT differs among ranks: (unset) on rank 0, simt_ref on rank 1" \
    mpmd - MOE_FORCE_VARIANT=simt_ref
# the tune file, by content: copies at other paths agree, other contents do not
printf '{"a": 1}\n' >"$tmp/tune-a.json"
printf '{"a": 1}\n' >"$tmp/tune-copy.json"
printf '{"a": 2}\n' >"$tmp/tune-b.json"
expect knob-tune-file 1 "MOE_TUNE_FILE differs among ranks: $tmp/tune-a.json (9 bytes, content hash" \
    mpmd MOE_TUNE_FILE="$tmp/tune-a.json" MOE_TUNE_FILE="$tmp/tune-b.json"
count_in_output "MOE_TUNE_FILE differs among ranks" 2
expect knob-tune-file-copy 0 "moe-run" \
    mpmd MOE_TUNE_FILE="$tmp/tune-a.json" MOE_TUNE_FILE="$tmp/tune-copy.json"
# alike on every rank: runs
expect knob-alike 0 "moe-run" mpmd MOE_AG_MAX_TOKENS=0 MOE_AG_MAX_TOKENS=0

# ---- environment parse errors join the start-up agreement (no wait for the timeout) ---------
expect env-timeout-one-rank 1 "MOE_TIMEOUT_MS=abc: not an integer" mpmd - MOE_TIMEOUT_MS=abc
grep -qF "MOE_STATUS_PEER_FAILURE (rank 1 failed with MOE_STATUS_INVALID_ARGUMENT)" "$tmp/out" ||
    { echo "FAIL: rank 0 did not report rank 1's failure"; fail=$((fail + 1)); }
expect env-knob-bad-one-rank 1 "MOE_EP_LL=2: out of range (expected 0..1)" mpmd MOE_EP_LL=2 -
grep -qF "MOE_STATUS_PEER_FAILURE (rank 0 failed with MOE_STATUS_INVALID_ARGUMENT)" "$tmp/out" ||
    { echo "FAIL: rank 1 did not report rank 0's failure"; fail=$((fail + 1)); }
expect env-bind-bad-one-rank 1 "MOE_BIND=yes: not an integer" mpmd - MOE_BIND=yes

# ---- path arguments that every rank must read alike: compared by content ---------------------
mkdir -p "$tmp/fx" && "$fixtures" --write-fixtures "$tmp/fx" >/dev/null 2>&1 || { echo "FAIL: fixtures"; fail=$((fail + 1)); }
m="$tmp/fx/mixtral"
cp -r "$m" "$tmp/mixtral-copy"
cp -r "$m" "$tmp/mixtral-other"
# one byte of the weights differs (the config and the headers are alike)
f=$(ls "$tmp/mixtral-other"/*.safetensors | head -1)
size=$(stat -c %s "$f")
printf '\x7f' | dd of="$f" bs=1 seek=$((size - 3)) conv=notrunc status=none
mrun=(--backend cpu --layer 1 --tokens 16 --iters 1 --warmup 0)
expect model-copy 0 "checksum" "${mpirun[@]}" -np 1 "$moe_run" "${mrun[@]}" --model "$m" \
    : -np 1 "$moe_run" "${mrun[@]}" --model "$tmp/mixtral-copy"
expect model-other 2 "--model's content (file names, sizes, JSON, safetensors headers, sampled weights) differs between rank 0 and rank 1" \
    "${mpirun[@]}" -np 1 "$moe_run" "${mrun[@]}" --model "$m" \
    : -np 1 "$moe_run" "${mrun[@]}" --model "$tmp/mixtral-other"
count_in_output "--model's content" 2
for s in 1 2; do
    timeout 120 "$moe_run" --backend cpu --tokens 8 --iters 1 --warmup 0 --seed $s \
        --output "$tmp/in$s.safetensors" >"$tmp/mk.log" 2>&1 || { echo "FAIL: input $s"; cat "$tmp/mk.log"; fail=$((fail + 1)); }
done
cp "$tmp/in1.safetensors" "$tmp/in1-copy.safetensors"
expect input-copy 0 "checksum" "${mpirun[@]}" -np 1 "$moe_run" --backend cpu --input "$tmp/in1.safetensors" \
    : -np 1 "$moe_run" --backend cpu --input "$tmp/in1-copy.safetensors"
expect input-other 2 "--input's content differs between rank 0 and rank 1" \
    "${mpirun[@]}" -np 1 "$moe_run" --backend cpu --input "$tmp/in1.safetensors" \
    : -np 1 "$moe_run" --backend cpu --input "$tmp/in2.safetensors"
count_in_output "--input's content differs" 2

# ---- a FIFO where the tools or the library open a file: refused at once, never waited on ------
mkfifo "$tmp/fifo"
run1() { timeout 60 "$moe_run" "$@"; }
expect fifo-json 2 "--json $tmp/fifo: is a FIFO (named pipe), not a regular file" \
    run1 --backend cpu --tokens 8 --iters 1 --warmup 0 --json "$tmp/fifo"
expect fifo-input 2 "$tmp/fifo: is a FIFO (named pipe), not a regular file" \
    run1 --backend cpu --input "$tmp/fifo"
expect fifo-model 2 "is a FIFO (named pipe), not a regular file" run1 --model "$tmp/fifo" --layer 1
mkdir "$tmp/fifo-model" && cp -r "$m"/* "$tmp/fifo-model/" && rm "$tmp/fifo-model/config.json" &&
    mkfifo "$tmp/fifo-model/config.json"
expect fifo-model-config 2 "config.json: is a FIFO (named pipe), not a regular file" \
    run1 --model "$tmp/fifo-model" --layer 1
expect fifo-output nz "FIFO" run1 --backend cpu --tokens 8 --iters 1 --warmup 0 --output "$tmp/fifo"
# the tune file: read at layer create (its content is agreed) and by the CUDA oracle
expect fifo-tune-file 0 "checksum" env MOE_TUNE_FILE="$tmp/fifo" \
    timeout 60 "$moe_run" --backend cpu --tokens 8 --iters 1 --warmup 0
if [ -n "$moe_bench" ]; then
    expect fifo-bench-json 2 "--json $tmp/fifo: is a FIFO (named pipe), not a regular file" \
        timeout 60 "$moe_bench" --json "$tmp/fifo"
fi
if [ -n "$moe_tune" ]; then # reaches --out only where a GPU is visible
    timeout 60 "$moe_tune" --out "$tmp/fifo" >"$tmp/out" 2>&1
    rc=$?
    if [ $rc -ge 124 ] || [ $rc -eq 0 ]; then
        echo "FAIL: fifo-tune-out: exit $rc"; tail -5 "$tmp/out"; fail=$((fail + 1))
    else
        echo "ok: fifo-tune-out (exit $rc)"; pass=$((pass + 1))
    fi
fi

echo "test_cli_agreement: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
