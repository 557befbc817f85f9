#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# moe-run --model on generated checkpoints of every family (Mixtral bf16 single file, Qwen2-MoE
# and Qwen3-MoE sharded, DeepSeek-V3 fp8 with block scales, sharded, also with DeepSeek-V3's own
# routing: 256 experts, 8 per token, 8 groups, 4 kept) under mpirun with 1 rank, 2 ranks (EP 2)
# and 2 ranks (TP 2): with --deterministic the written outputs must be equal byte for byte;
# --input feeds an output back in. The FP8 ones also run --fp8-math w8a8.
#   test_moe_run_model.sh MOE_RUN TEST_CHECKPOINT
set -euo pipefail

moe_run=$1
fixtures=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v mpirun >/dev/null || { echo "SKIP: mpirun not found"; exit 77; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-run-model-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$fixtures" --write-fixtures "$tmp"

fail=0
run() { # np out [args...]
    local np=$1 out=$2
    shift 2
    timeout 300 mpirun -np "$np" "$moe_run" --tokens 64 --deterministic --iters 1 --warmup 0 \
        --backend cpu --output "$out" "$@" >"$out.log" 2>&1 || {
        echo "FAIL: mpirun -np $np moe-run $* (exit $?)"; cat "$out.log"; fail=1; return 1; }
    grep -q '^checksum ' "$out.log" || { echo "FAIL: no checksum line: $*"; fail=1; return 1; }
}

for m in mixtral qwen2_moe qwen3_moe deepseek_v3_fp8 deepseek_v3_fp8_e256; do
    args=(--model "$tmp/$m" --layer 1)
    run 1 "$tmp/$m.np1" "${args[@]}" || continue
    run 2 "$tmp/$m.ep2" "${args[@]}" || continue
    run 2 "$tmp/$m.tp2" "${args[@]}" --tp 2 || continue
    for v in ep2 tp2; do
        if cmp -s "$tmp/$m.np1" "$tmp/$m.$v"; then
            echo "ok: $m: 1 rank and 2 ranks ($v) write the same output"
        else
            echo "FAIL: $m: outputs of 1 rank and 2 ranks ($v) differ"; fail=1
        fi
    done
    # The output is a safetensors file with hidden_states [64, H]: it is valid input.
    run 2 "$tmp/$m.in" "${args[@]}" --input "$tmp/$m.np1" && echo "ok: $m: --input"
done

# FP8 W8A8 on the CPU backend: 1 rank, EP 2 and TP 2 agree (to f32 summation order: compared by
# the checksum line) and differ from W8A16.
checksum_of() { sed -n 's/^checksum \([^ ]*\) abs \([^ ]*\)$/\1 \2/p' "$1"; }
for m in deepseek_v3_fp8 deepseek_v3_fp8_e256; do
    args=(--model "$tmp/$m" --layer 1 --fp8-math w8a8)
    run 1 "$tmp/$m.w8a8.np1" "${args[@]}" || continue
    run 2 "$tmp/$m.w8a8.ep2" "${args[@]}" || continue
    run 2 "$tmp/$m.w8a8.tp2" "${args[@]}" --tp 2 || continue
    grep -q 'dtype fp8_e4m3 (W8A8)' "$tmp/$m.w8a8.np1.log" ||
        { echo "FAIL: $m: the header does not say W8A8"; fail=1; }
    read -r c1 a1 < <(checksum_of "$tmp/$m.w8a8.np1.log")
    for v in ep2 tp2; do
        read -r c2 a2 < <(checksum_of "$tmp/$m.w8a8.$v.log")
        if awk -v a="$c1" -v b="$c2" -v s="$a1" -v t="$a2" \
            'BEGIN { d = a - b; e = s - t; exit !(d * d + e * e <= (1e-5 * s) ^ 2) }'; then
            echo "ok: $m: W8A8 with 1 rank and 2 ranks ($v) agree (checksum $c1 / $c2)"
        else
            echo "FAIL: $m: W8A8 checksums of 1 rank ($c1 abs $a1) and $v ($c2 abs $a2) differ"
            fail=1
        fi
    done
    read -r c2 a2 < <(checksum_of "$tmp/$m.np1.log")
    if awk -v a="$c1" -v b="$c2" -v s="$a1" -v t="$a2" \
        'BEGIN { d = a - b; e = s - t; exit !(d * d + e * e > (1e-4 * s) ^ 2) }'; then
        echo "ok: $m: W8A8 differs from W8A16 (checksum $c1 / $c2)"
    else
        echo "FAIL: $m: W8A8 and W8A16 give the same checksum ($c1 abs $a1)"; fail=1
    fi
done

# --dtype with --model converts the checkpoint's weights as they load.
if timeout 120 mpirun -np 2 "$moe_run" --model "$tmp/mixtral" --layer 1 --dtype f32 --tokens 16 \
    --iters 1 --warmup 0 --backend cpu >"$tmp/f32.log" 2>&1 && grep -q 'dtype f32' "$tmp/f32.log"; then
    echo "ok: --dtype f32 with --model"
else
    echo "FAIL: --dtype f32 with --model"; cat "$tmp/f32.log"; fail=1
fi

# --layers N: N layers, and a memory line whose weights are N times one layer's.
if timeout 120 mpirun -np 2 "$moe_run" --model "$tmp/mixtral" --layer 1 --layers 3 --tokens 16 \
    --iters 1 --warmup 0 --backend cpu >"$tmp/layers.log" 2>&1 &&
    grep -q '^# memory per rank (max over ranks): 3 layer(s): weights' "$tmp/layers.log"; then
    echo "ok: --layers 3: $(grep '^# memory' "$tmp/layers.log")"
else
    echo "FAIL: --layers 3"; cat "$tmp/layers.log"; fail=1
fi

# Each of 2 EP ranks reads about half of the checkpoint's bytes (its experts), not all of it.
log=$(MOE_DEBUG=INFO timeout 120 mpirun -x MOE_DEBUG -np 2 "$moe_run" --model "$tmp/mixtral" \
    --layer 1 --tokens 64 --iters 1 --warmup 0 --backend cpu 2>&1 | grep '\[CKPT\]' || true)
n=0
while read -r bytes data; do
    n=$((n + 1))
    if [ $((bytes * 100 / data)) -lt 60 ]; then
        echo "ok: a rank read $bytes of $data bytes"
    else
        echo "FAIL: a rank read $bytes of $data bytes (more than its shard)"; fail=1
    fi
done < <(echo "$log" | sed -n 's/.*read \([0-9]*\) bytes in .*(\([0-9]*\) bytes of tensor data open).*/\1 \2/p')
[ "$n" = 2 ] || { echo "FAIL: expected 2 [CKPT] log lines, got $n"; echo "$log"; fail=1; }

# A dense layer is refused with a message naming the reason, on every rank, without a hang.
if timeout 120 mpirun -np 2 "$moe_run" --model "$tmp/deepseek_v3_fp8" --layer 0 --backend cpu \
    >"$tmp/dense.log" 2>&1; then
    echo "FAIL: a dense layer was accepted"; fail=1
elif grep -q 'first_k_dense_replace' "$tmp/dense.log"; then
    echo "ok: dense layer refused"
else
    echo "FAIL: dense layer message"; cat "$tmp/dense.log"; fail=1
fi
exit $fail
