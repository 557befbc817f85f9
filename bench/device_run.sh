#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One call on the GPU machine (device tool, carry .device): build, then the MODEs in turn (each
# alone fits a call's 10 minutes); logs under $OUT. Usage: bash bench/device_run.sh [MODE...]
# (BUILD_TARGETS: build those targets only, e.g. "moe-bench test_gpu_expert_gemm")
# (PREBUILT=1: no build; the binaries bench/device_pack.sh packed here into .device/prebuilt.txz)
#   build            the build alone
#   tests (default)  the GPU tests (one GPU, and mpirun -np <GPUs>; with one GPU the ranks
#                    share it: MOE_TEST_SHARED_GPU=1, NCCL between them over loopback sockets,
#                    and test_gpu_ep runs with 4 ranks on it as well); fitted into what is left
#                    of $CALL_LIMIT s from this script's start (default 585: the device tool's
#                    600 s call), so a test that hangs ends in its own log
#   quick            the same
#   ptests           (PREBUILT=1) the GPU test binaries packed by bench/device_pack.sh, without
#                    CTest: test_gpu_decode alone (its items wait on each other), then the other
#                    packed tests/gpu binaries side by side; logs in $OUT/ptests/
#   ep               a stopped peer under allgather, p2p and p2p-hdr; the dispatch bench at a
#                    serving capacity, every transport, told, not and asked (one GPU: the
#                    ranks share it, NCCL over loopback sockets; smoke runs, told only, and
#                    no lsa-ll/PDL/rounds)
#   ep-cap           (2+ GPUs) issue 10's capacity table (8 tokens per rank, capacity 8 ..
#                    8192, each transport), weak scaling, first call
#   ep-layer         DeepSeek-V3's whole layer at 8 and 4096 tokens per rank, all GPUs vs one;
#                    at 1 and 8 tokens lsa, its low-latency layout, and that with the fused
#                    decode kernel on the laid-out rows (bf16; fp8 per-tensor: lsa and the
#                    fused kernel, which W8A8 with the layout needs)
#   ep-wide          (4+ GPUs) DeepSeek-V3's layer as EP N x TP 1 against EP N/2 x TP 2 at 128
#                    and 4096 tokens per rank, then the memory plan of a whole model: 61 layers
#                    of DeepSeek-V3 in fp8 (W8A8), 8 tokens per rank (the dispatch at 1 .. 128
#                    tokens per rank, DeepSeek-V3 routing, is the ep mode's table)
#   decode           the fused decode kernel: test_gpu_decode, then moe-bench at M = 1, 4, 8,
#                    16, 64 for the three presets, bf16 and fp8, grouped path against the
#                    kernel forced (bench/decode_run.sh; JSON in $OUT/json.tgz)
#   bf16             moe-bench bf16 tables with phases (three presets, M = 1 .. 8192), JSON in
#                    $OUT/bf16json.tgz, and the torch peers beside them (BF16_PEERS=0: none)
#   fp8              moe-bench fp8 tables (three presets, per-tensor and block) + torch peers
#                    ($FP8_PRESETS set: those presets, no peers; $FP8_ACCUM=fast: W8A8_FAST);
#                    JSON in $OUT/fp8json.tgz
#   ab               an A/B of this tree against .device/ab-base (bench/ab_base.sh REV writes it
#                    here; carry .device): the base's moe-bench is built beside, then per preset
#                    ($AB_PRESETS) and option set ($AB_ARGS, sets split by ';', default fp8
#                    tensor;fp8 block) both sides in turn at $AB_TOKENS, --seconds $AB_SECONDS;
#                    bench/ab_compare.py prints new / base per point and geometric means
#   fp8-fast         moe-bench fp8 per-tensor at a serving capacity, M = 512 .. 8192
#                    ($FAST_TOKENS), --accum promoted then fast (W8A8_FAST: the oracle's fast
#                    table), with --explain
#   vs               a forced variant against the built-in choice, in turn ($VS_REPS times,
#                    default 2): $VS_CASES, cases split by ';', each
#                    "preset|moe-bench options|variant|tokens"; bench/ab_compare.py prints
#                    forced / built-in per point (new = forced); JSON in $OUT/vs.tgz
#   gemm             bench/gemm_bench (the expert GEMMs alone, rotating weight sets, the
#                    permute's counts given): each of $GEMM_MODEL (names split by spaces, each
#                    a substring of gemm_bench's model names; default mixtral), rows per expert
#                    $GEMM_MIN..$GEMM_MAX (default 128..2048), each of $GEMM_VARIANTS (names split
#                    by spaces; default the fp8 per-row n128 tiles and their n192 forms) in turn,
#                    $GEMM_REPS times (default 2); table in $OUT/gemm.txt
#   knob             environment knobs' values against each other, in turn ($KNOB_REPS
#                    times, default 2): KNOB=NAME, KNOB_BASE / KNOB_NEW its two values (default
#                    0 / 1), or KNOBS="NAME=BASE:NEW ..." for several: per case and rep one run
#                    with every knob at BASE, one with each knob alone at NEW, and one with all
#                    at NEW; $KNOB_CASES split by ';', each "preset|moe-bench options|tokens"
#                    (default: Qwen3 fp8 and bf16, Mixtral fp8 at 1,8,64); bench/ab_compare.py
#                    prints new / base per point, per knob (and all); JSON in $OUT/knob.tgz
#   gemm-prof        Nsight Compute on the expert GEMMs of one step (DRAM / SM throughput, SM
#                    clock, shared-memory and tensor-pipe use, the top warp stalls): fp8
#                    per-tensor, fp8 block and bf16 at the DeepSeek-V3 shard M = 64 and Mixtral
#                    M = 8, fp8 at Mixtral M = 8192 ($PROF_CASES:
#                    preset:M:bf16|tensor|block[:decode|:VARIANT], decode: the fused decode
#                    kernel, VARIANT: that GEMM variant forced)
#   trace            the fused decode kernel's timeline (bench/decode_trace): $TRACE_CASES split by
#                    ';', each "model tokens dtype split1" (default Qwen3 bf16 and fp8 at 1 and 8
#                    tokens, the DeepSeek-V3 shard fp8 and Mixtral bf16 at 1), 20 launches each
#   stream           what HBM reads reach (bench/stream_bench): the fused decode kernel's weight
#                    pattern by shape against the best case (contiguous loads, bulk copies)
#   stalls           Nsight Compute's source counters on one launch per case ($STALL_CASES, as
#                    PROF_CASES; default the fused decode kernel at one token: Qwen3 fp8, Mixtral
#                    fp8 and bf16), summed per SASS instruction, opcode and loop by
#                    bench/ncu_stalls.py; reports and CSV in $OUT/stalls.tgz
#   tune             moe-tune bf16 + fp8 for the three presets or $TUNE_PRESETS, $TUNE_DTYPES
#                    (EP = all GPUs when 2+; each run up to $TUNE_SECONDS, default 150 s:
#                    split over calls; Mixtral bf16 needs more), into
#                    $TUNE_OUT (default $OUT/tune.json; bench/tune-h200.json to refresh it,
#                    then copy it under $OUT)
#   first            moe-bench --first-call under mpirun -np <GPUs, at least 2>
#   kernels          GPU time per kernel of one layer step (ncu; KERNEL_PRESET, KERNEL_TOKENS,
#                    KERNEL_X = bf16 or f32 tokens)
#   rotate           moe-bench with and without L2 rotation (issue 13's bench check)
#   python           the PyTorch binding (issue 36): python/tests' GPU half and the layer tests
#                    with MOE_REQUIRE_GPU=1, bench/python_overhead.py beside moe-bench's graph
#                    column (qwen3-30b-a3b, M = 1 and 8, --rotate 1) and examples/generate.py
#                    in bf16; transformers and pytest from .whl/ (carry it: python3 -m pip
#                    download transformers==5.24.0 pytest==9.2.0 --python-version 3.12
#                    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform
#                    manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl; ~45 MB)
#   mps              (one GPU) two ranks share it under MPS (daemon started and stopped here):
#                    the lsa dispatch table, capacity 8192 told, not and asked (--ask),
#                    rounds and one round,
#                    and moe-run's EP layer in rounds ($MPS_LAYER_TOKENS per rank, default
#                    "512 4096"; empty: none; MPS_DISPATCH=0: no dispatch table), and with
#                    micro-batch lanes off and on
#                    ($MPS_MB_TOKENS, default 4096), and the low-latency layout's rows
#                    through the grouped GEMMs and the fused decode kernel at 8 tokens a
#                    rank; not two-GPU numbers (bench/RESULTS.md)
#   faults           a stopped peer at several points of a step (tests/mpi/test_gpu_faults.c),
#                    2 and 4 ranks sharing the GPU (one GPU) or a GPU each, default transport
#                    (lsa) and lsa with micro-batch lanes; then moe-run as issue 37 ran it (qwen3,
#                    512 tokens, MOE_TIMEOUT_MS=5000) under moe-launch, one rank SIGSTOPped at 8 s
#                    and at 8.3 s: every survivor must print MOE_STATUS_TIMEOUT within 7 s of the
#                    stop and the job must end non-zero
#   soak             moe-soak on the CUDA backend, 2 ranks (sharing the GPU on a one-GPU
#                    machine), $SOAK_SECONDS (default 420: a call's 10 minutes hold the build),
#                    a check against the CPU reference every $SOAK_EVERY steps (default 16)
#   sanitize         compute-sanitizer memcheck (leaks too) and racecheck over the multi-rank
#                    GPU tests, 2 ranks sharing the GPU (one GPU) or a GPU each; $SAN_TOOLS and
#                    $SAN_TESTS pick (a call's 10 minutes hold about one tool), $SAN_TIMEOUT
#                    bounds each run (default 280 s), SAN_PARALLEL=1 starts every run at once,
#                    $SAN_PRINT_LIMIT the reports printed a rank (default 20), $SAN_ENV the
#                    tests' environment (default MOE_TEST_MAX_TOKENS=64: every shape and
#                    variant, fewer rows; MOE_TEST_FILTER=test_x* picks cmocka cases); the
#                    logs in $OUT/sanitize.tgz
set -uo pipefail
# shellcheck source=/dev/null # written by the GPU machine's setup, not in the repository
source .device/env.sh
export LIBRARY_PATH=/opt/dep/usr/lib/x86_64-linux-gnu:${LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the commit moe-bench --json records: the carried tree's, as bench/device_commit.sh wrote it
# here before the call (this machine's copy of .git may be another checkout's), if the tracked
# files are still the ones it summed
if [ -s .device/commit ]; then
    MOE_BENCH_COMMIT=$(cat .device/commit)
    if [ ! -s .device/commit.files ] || [ ! -s .device/commit.sum ] ||
        [ "$(bash bench/tree_sum.sh .device/commit.files)" != "$(cat .device/commit.sum)" ]; then
        echo "device_run: the tree is not the one .device/commit ($MOE_BENCH_COMMIT) was written" \
            "for (run bench/device_commit.sh before the call): --json records 'unknown'"
        MOE_BENCH_COMMIT="unknown (not $MOE_BENCH_COMMIT)"
    fi
    export MOE_BENCH_COMMIT
fi
modes=${*:-tests}
# the call's limit (the device tool's 600 s less a margin): the tests mode fits its steps into
# what is left of it, so a hanging test costs its own log, not the call's output
call_start=$(date +%s)
left() { echo $((${CALL_LIMIT:-585} - ($(date +%s) - call_start))); }
# fit CAP MARGIN: a step's time limit, CAP seconds or what is left less MARGIN, the smaller
fit() {
    local t=$(($(left) - $2))
    echo $((t < $1 ? t : $1))
}
nvidia-smi -L
ngpu=$(nvidia-smi -L | wc -l)
np=$((ngpu >= 2 ? ngpu : 2))
if [ "${PREBUILT:-0}" = 1 ]; then
    # binaries built on the development machine (bench/device_pack.sh), no build here
    [ -s .device/prebuilt.txz ] || { echo "PREBUILT=1: no .device/prebuilt.txz"; exit 1; }
    mkdir -p build-gpu && tar xJf .device/prebuilt.txz -C build-gpu
    echo "prebuilt: $(tar tJf .device/prebuilt.txz | grep -v '/$' | tr '\n' ' ')"
else
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_TEST_GPU_NP="$np" \
        >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    start=$(date +%s)
    # shellcheck disable=SC2086 # $BUILD_TARGETS: target names
    cmake --build build-gpu -j"$(nproc)" --target ${BUILD_TARGETS:-all} >"$OUT/build.log" 2>&1 ||
        { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
    echo "build: $(($(date +%s) - start)) s"
fi
export MOE_REQUIRE_GPU=1 MOE_TIMEOUT_MS=20000
[ "$ngpu" -ge 2 ] || export MOE_TEST_SHARED_GPU=1
W="" # one GPU: NCCL between ranks that share it (bench/shared_gpu_rank.sh)
[ "$ngpu" -ge 2 ] || W="bash bench/shared_gpu_rank.sh"
B=build-gpu/launch
presets="mixtral-8x7b qwen3-30b-a3b deepseek-v3-ep8"
quiet() { grep -vE "dlopen|pmix|Perhaps"; }
# One A/B case of vs and knob: moe-bench with VAR=BASE then VAR=NEW, REPS times in turn, JSON
# and log as DIR/{base,new}.PRESET.I.R.*.
# Usage: ab_case MODE DIR I REPS SECONDS VAR BASE NEW PRESET "OPTIONS" TOKENS [EXTRA...]
ab_case() {
    local mode=$1 dir=$2 i=$3 reps=$4 secs=$5 var=$6 base=$7 new=$8 p=$9 opts=${10} toks=${11}
    shift 11
    local r side val
    for r in $(seq "$reps"); do
        for side in base new; do
            val=$base
            [ $side = new ] && val=$new
            # shellcheck disable=SC2086 # $opts: options
            env "$var=$val" timeout 120 $B/moe-bench --preset "$p" $opts --tokens "$toks" \
                --seconds "$secs" "$@" --json "$dir/$side.$p.$i.$r.json" \
                >"$dir/$side.$p.$i.$r.txt" 2>&1 ||
                echo "$mode: $side, $p, $opts, $var=$val: failed ($(tail -1 "$dir/$side.$p.$i.$r.txt"))"
        done
    done
}
# One moe-bench run of the knob mode with the given environment (NAME=VALUE ...), JSON and log
# as DIR/TAG.PRESET.SUFFIX.*. Usage: knob_run DIR TAG PRESET "OPTIONS" TOKENS SUFFIX [ENV...]
knob_run() {
    local dir=$1 tag=$2 p=$3 opts=$4 toks=$5 sfx=$6
    shift 6
    # shellcheck disable=SC2086 # $opts: options
    env "$@" timeout 120 $B/moe-bench --preset "$p" $opts --tokens "$toks" \
        --seconds "${KNOB_SECONDS:-0.1}" --explain --json "$dir/$tag.$p.$sfx.json" \
        >"$dir/$tag.$p.$sfx.txt" 2>&1 ||
        echo "knob: $tag, $p, $opts, $*: failed ($(tail -1 "$dir/$tag.$p.$sfx.txt"))"
}
# new / base per point of an ab_case directory, kept as $OUT/NAME.txt and NAME.tgz
ab_finish() {
    python3 bench/ab_compare.py "$1" | tee "$OUT/$2.txt"
    tar -czf "$OUT/$2.tgz" -C "$1" .
}
for mode in $modes; do
case $mode in
build) ;; # the build above only
ptests)
    mkdir -p "$OUT/ptests"
    for t in build-gpu/tests/gpu/test_gpu_decode build-gpu/tests/gpu/test_gpu_*; do
        [ -x "$t" ] || continue
        n=$(basename "$t")
        if [ "$n" = test_gpu_decode ]; then
            [ -e "$OUT/ptests/$n.log" ] && continue
            timeout 300 "$t" >"$OUT/ptests/$n.log" 2>&1
            echo "$n: rc $?"
        else
            [ -e "$OUT/ptests/$n.log" ] ||
                (timeout 300 "$t" >"$OUT/ptests/$n.log" 2>&1; echo "$n: rc $?") &
        fi
    done
    wait
    grep -HE "PASSED|FAILED|checks, " "$OUT"/ptests/*.log | head -40
    ;;
tests | quick)
    # ctest gets what the call has left but a minute; the two extra runs only what is left then
    t=$(fit 420 60)
    if [ "$t" -lt 60 ]; then
        echo "tests: $(left) s left of the call: not started"
        continue
    fi
    timeout "$t" ctest --test-dir build-gpu -L gpu -R "${GPU_TESTS:-.}" -j3 --output-on-failure \
        --timeout "$t" >"$OUT/ctest_gpu.log" 2>&1 || echo "tests: ctest ended with $? (limit $t s)"
    grep -E "Test +#|tests passed|FAIL|ERROR" "$OUT/ctest_gpu.log" | head -60
    # one GPU: four ranks sharing it too (EP4, TP4, every transport: more than one peer)
    if [ "$ngpu" -lt 2 ] && [ "$(left)" -gt 40 ]; then
        echo "== test_gpu_ep, 4 ranks on the one GPU"
        t=$(fit 240 10)
        timeout "$t" mpirun -np 4 --oversubscribe build-gpu/tests/mpi/test_gpu_ep 2>&1 | quiet |
            tee "$OUT/ep4.log" | grep -E "PASSED|FAILED" | sort | uniq -c
    fi
    # a stopped peer with micro-batch lanes (lsa): the survivors' two streams end bounded
    if [ "$(left)" -gt 40 ]; then
        echo "== test_gpu_faults, MOE_EP_MICROBATCH=1"
        t=$(fit 90 10)
        MOE_EP_MICROBATCH=1 timeout "$t" mpirun -np "$np" -x MOE_EP_MICROBATCH \
            build-gpu/tests/mpi/test_gpu_faults 2>&1 | quiet | tail -4
    else
        echo "tests: $(left) s left of the call: the 4-rank ep and the lanes' fault runs skipped"
    fi
    ;;
ep)
    # a stopped peer under each transport (ctest's run covers the default, lsa); p2p-hdr: p2p
    # with the sizes in-band (MOE_EP_P2P_HEADER=1). One GPU: the two ranks share it, and NCCL
    # joins them as two hosts over loopback sockets (bench/shared_gpu_rank.sh)
    for t in allgather p2p p2p-hdr; do
        echo "== test_gpu_faults, transport $t"
        hdr=$([ $t = p2p-hdr ] && echo 1 || echo 0)
        MOE_EP_TRANSPORT=${t%-hdr} MOE_EP_P2P_HEADER=$hdr timeout 90 mpirun -np "$np" \
            -x MOE_EP_TRANSPORT -x MOE_EP_P2P_HEADER \
            build-gpu/tests/mpi/test_gpu_faults 2>&1 | quiet | tail -4
    done
    # p2p-hdr: p2p's sizes in-band (whole told regions, no host read) against p2p's host read
    small="" # one GPU: a short smoke run
    [ "$ngpu" -ge 2 ] || small="--max-tokens 128"
    for t in allgather lsa p2p p2p-hdr; do
        echo "== dispatch, capacity 8192, told, transport $t$([ "$ngpu" -ge 2 ] ||
            echo ", one shared GPU: NCCL over loopback sockets, a smoke run, not NVLink")"
        # shellcheck disable=SC2086 # $W: a command prefix or nothing; $small: options
        timeout 120 mpirun -np "$np" $W $B/moe-bench --dispatch-only --capacity 8192 --told \
            --transport $t $small 2>&1 |
            quiet | tee -a "$OUT/dispatch.log" | tail -12
    done
    [ "$ngpu" -ge 2 ] || continue # the rest times lsa, which the mps mode covers on one GPU
    # lsa-ll: lsa's low-latency layout (MOE_EP_LL=1, up to 128 tokens per rank), its dispatch
    # in one kernel (every CTA waits for the counts) and in two (the default)
    for n in 1 2; do
        echo "== dispatch, capacity 8192, told, lsa-ll, MOE_EP_LL_KERNELS=$n"
        MOE_EP_LL_KERNELS=$n timeout 120 mpirun -np "$ngpu" -x MOE_EP_LL_KERNELS $B/moe-bench \
            --dispatch-only --capacity 8192 --told --max-tokens 128 --transport lsa-ll 2>&1 |
            quiet | tee -a "$OUT/dispatch.log" | grep -E "^ +[0-9]"
    done
    # the EP step's own kernels with programmatic dependent launch (MOE_EP_PDL=1) and without,
    # twice each, lsa and lsa-ll at up to 128 tokens per rank
    for p in 0 1 0 1; do
        echo "== dispatch, capacity 8192, told, MOE_EP_PDL=$p"
        MOE_EP_PDL=$p timeout 120 mpirun -np "$ngpu" -x MOE_EP_PDL $B/moe-bench --dispatch-only \
            --capacity 8192 --told --max-tokens 128 --transport lsa 2>&1 | quiet |
            tee -a "$OUT/dispatch.log" | grep -E "^ +[0-9]"
        MOE_EP_PDL=$p timeout 120 mpirun -np "$ngpu" -x MOE_EP_PDL $B/moe-bench \
            --dispatch-only --capacity 8192 --told --max-tokens 128 --transport lsa-ll 2>&1 |
            quiet | tee -a "$OUT/dispatch.log" | grep -E "^ +[0-9]"
    done
    # what the rounds cost when max_tokens_across_ranks is not told (capacity 8192: rounds of
    # 8192 / GPUs by default, against one round)
    for R in 0 8192; do
        echo "== dispatch, capacity 8192, not told, --round-tokens $R"
        timeout 120 mpirun -np "$ngpu" $B/moe-bench --dispatch-only --capacity 8192 \
            --max-tokens 512 --round-tokens $R 2>&1 | quiet | tee -a "$OUT/dispatch.log" |
            grep -E "^ +[0-9]"
    done
    # not told but asked: moe_runtime_max_tokens before each step (its all-reduce in wall)
    echo "== dispatch, capacity 8192, --ask"
    timeout 120 mpirun -np "$ngpu" $B/moe-bench --dispatch-only --capacity 8192 --ask \
        --max-tokens 512 --transport lsa 2>&1 | quiet | tee -a "$OUT/dispatch.log" |
        grep -E "^ +[0-9]"
    ;;
ep-cap)
    [ "$ngpu" -ge 2 ] || { echo "ep-cap: needs 2+ GPUs (this machine has $ngpu)"; exit 1; }
    # issue 10's table: 8 tokens per rank at a growing capacity, every transport
    for t in allgather lsa p2p; do
        for c in 8 64 512 4096 8192; do
            echo "== E64 k8 H7168 I2048, 8 tokens/rank, capacity $c, transport $t"
            MOE_EP_TRANSPORT=$t timeout 60 mpirun -np "$ngpu" -x MOE_EP_TRANSPORT $B/moe-bench \
                --experts 64 --top-k 8 --hidden 7168 --intermediate 2048 --tokens 8 \
                --capacity $c --seconds 0.1 2>&1 | quiet | grep -E "^ +8 " | head -1
        done
    done
    for T in 64 512; do
        for n in 1 "$ngpu"; do
            echo "== weak scaling: qwen3-30b-a3b, $n GPU(s), $((T * n)) tokens"
            timeout 90 mpirun -np "$n" $B/moe-run --preset qwen3-30b-a3b \
                --tokens $((T * n)) --iters 30 --warmup 3 2>&1 | grep -E "phase|tokens/s|checksum"
        done
    done 2>&1 | tee "$OUT/weak.log"
    timeout 120 mpirun -np "$ngpu" $B/moe-bench --first-call --preset deepseek-v3-ep8 2>&1 |
        quiet | tail -26
    ;;
ep-layer)
    # issue 10: the whole layer, DeepSeek-V3 routing (E256 top-8, groups), bf16 tokens, at 8 and
    # 4096 tokens per rank on all GPUs against one GPU (the same tokens per rank)
    # the shared MLP beside the exchange (MOE_EP_SHARED_OVERLAP=1) against after it
    for ov in 0 1; do
        for T in 8 512; do
            echo "== deepseek-v3, $ngpu GPUs, $T tokens per rank, MOE_EP_SHARED_OVERLAP=$ov"
            MOE_EP_SHARED_OVERLAP=$ov timeout 120 mpirun -np "$ngpu" -x MOE_EP_SHARED_OVERLAP \
                $B/moe-run --backend cuda --preset deepseek-v3 --x-dtype bf16 \
                --tokens $((T * ngpu)) --iters 30 --warmup 3 2>&1 | quiet | grep -E "phase|tokens/s"
        done
    done 2>&1 | tee "$OUT/ep_overlap.log"
    # two micro-batch lanes (MOE_EP_MICROBATCH=1: one round's exchange beside the other's GEMMs)
    for mb in 0 1; do
        echo "== deepseek-v3, $ngpu GPUs, 4096 tokens per rank, MOE_EP_MICROBATCH=$mb"
        MOE_EP_MICROBATCH=$mb timeout 120 mpirun -np "$ngpu" -x MOE_EP_MICROBATCH $B/moe-run \
            --backend cuda --preset deepseek-v3 --x-dtype bf16 --tokens $((4096 * ngpu)) \
            --iters 30 --warmup 3 2>&1 | quiet | grep -E "rounds|phase|tokens/s"
    done 2>&1 | tee "$OUT/ep_microbatch.log"
    # (at 4096 the EP runs take rounds of 4096 / GPUs tokens by default; R = 4096: one round)
    for T in 8 4096; do
        for n in 1 "$ngpu"; do
            for R in 0 $([ "$n" -gt 1 ] && [ "$T" -gt 256 ] && echo "$T"); do
                echo "== deepseek-v3, $n GPU(s), $T tokens per rank, --round-tokens $R"
                timeout 120 mpirun -np "$n" $B/moe-run --backend cuda --preset deepseek-v3 \
                    --x-dtype bf16 --tokens $((T * n)) --round-tokens "$R" --iters 30 \
                    --warmup 3 2>&1 | quiet | grep -E "rounds|phase|tokens/s|step|checksum|memory"
            done
        done
    done 2>&1 | tee "$OUT/ep_layer.log"
    # issue 35 inside an EP step: the low-latency layout at 1 and 8 tokens per rank, its rows
    # through the grouped GEMMs and through the fused decode kernel (forced), lsa for reference
    for T in 1 8; do
        for v in lsa ll ll-fused; do
            echo "== deepseek-v3, $ngpu GPUs, $T tokens per rank, $v"
            ll=0
            [ $v = lsa ] || ll=1
            fenv=MOE_FUSED_DECODE=1 # (the default) or the kernel forced, and passed on
            xf=""
            [ $v = ll-fused ] && fenv=MOE_FORCE_VARIANT=sm90_fused_decode xf="-x MOE_FORCE_VARIANT"
            # shellcheck disable=SC2086 # $xf: an option or none
            env "$fenv" MOE_EP_TRANSPORT=lsa MOE_EP_LL=$ll timeout 120 mpirun -np "$ngpu" $xf \
                -x MOE_EP_TRANSPORT -x MOE_EP_LL $B/moe-run --backend cuda --preset deepseek-v3 \
                --x-dtype bf16 --tokens $((T * ngpu)) --iters 50 --warmup 5 2>&1 | quiet |
                grep -E "phase|tokens/s|step|rror"
        done
    done 2>&1 | tee "$OUT/ep_ll_fused.log"
    # W8A8 per-tensor: the low-latency layout takes fp8 only through the fused kernel
    for v in lsa ll-fused; do
        echo "== deepseek-v3 fp8 per-tensor, $ngpu GPUs, 1 and 8 tokens per rank, $v"
        ll=0 fenv=MOE_FUSED_DECODE=1 xf=""
        [ $v = lsa ] || ll=1 fenv=MOE_FORCE_VARIANT=sm90_fused_decode xf="-x MOE_FORCE_VARIANT"
        # shellcheck disable=SC2086 # $xf: an option or none
        env "$fenv" MOE_EP_TRANSPORT=lsa MOE_EP_LL=$ll timeout 120 mpirun -np "$ngpu" $xf \
            -x MOE_EP_TRANSPORT -x MOE_EP_LL $B/moe-bench --preset deepseek-v3 --dtype fp8 \
            --scales tensor --tokens 1,8 --capacity 8 --explain 2>&1 | quiet |
            grep -E "^ +[0-9]|fused|rror" | head -8
    done 2>&1 | tee -a "$OUT/ep_ll_fused.log"
    ;;
ep-wide)
    [ "$ngpu" -ge 4 ] || { echo "ep-wide: needs 4+ GPUs (this machine has $ngpu)"; exit 1; }
    for T in 128 4096; do
        for tp in 1 2; do
            echo "== deepseek-v3, $ngpu GPUs, EP $((ngpu / tp)) x TP $tp, $T tokens per rank"
            timeout 150 mpirun -np "$ngpu" $B/moe-run --backend cuda --preset deepseek-v3 \
                --x-dtype bf16 --ep $((ngpu / tp)) --tp $tp --tokens $((T * ngpu)) --iters 30 \
                --warmup 3 2>&1 | quiet | grep -E "ep [0-9]|rounds|phase|tokens/s|step|memory"
        done
    done 2>&1 | tee "$OUT/ep_tp.log"
    # every layer gets the same generated weights (one generation per layer on the host)
    echo "== deepseek-v3, 61 layers, fp8 W8A8, $ngpu GPUs, 8 tokens per rank"
    timeout 400 mpirun -np "$ngpu" $B/moe-run --backend cuda --preset deepseek-v3 --dtype fp8 \
        --fp8-math w8a8 --x-dtype bf16 --layers 61 --tokens $((8 * ngpu)) --iters 5 --warmup 1 \
        2>&1 | quiet | tee "$OUT/layers61.log" | grep -E "ep [0-9]|memory|phase|step|rank 0"
    ;;
mps)
    [ "$ngpu" -eq 1 ] || { echo "mps: for a one-GPU machine (this one has $ngpu)"; exit 1; }
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
    mkdir -p /tmp/mps /tmp/mpslog
    nvidia-cuda-mps-control -d
    X="-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x MOE_TIMEOUT_MS"
    for told in --told "" --ask; do
        [ "${MPS_DISPATCH:-1}" = 1 ] || break
        for R in 0 8192; do
            echo "== dispatch, 2 ranks on one GPU (MPS), capacity 8192 ${told:-not told}, --round-tokens $R"
            # shellcheck disable=SC2086 # $X: options; $told: one option or none
            timeout 120 mpirun -np 2 $X $B/moe-bench --dispatch-only --capacity 8192 $told \
                --max-tokens 512 --round-tokens $R 2>&1 | quiet | grep -E "^ +[0-9]" | head -12
        done
    done 2>&1 | tee "$OUT/mps_dispatch.log"
    # the low-latency dispatch in one kernel (every CTA waits for the counts) against two
    if [ "${MPS_DISPATCH:-1}" = 1 ]; then
        for n in 1 2; do
            echo "== dispatch, MPS, capacity 8192 told, lsa-ll, MOE_EP_LL_KERNELS=$n"
            # shellcheck disable=SC2086 # $X: options
            MOE_EP_LL_KERNELS=$n timeout 120 mpirun -np 2 $X -x MOE_EP_LL_KERNELS $B/moe-bench \
                --dispatch-only --capacity 8192 --told --max-tokens 128 2>&1 | quiet |
                grep -E "lsa-ll"
        done 2>&1 | tee -a "$OUT/mps_dispatch.log"
    fi
    for T in ${MPS_LAYER_TOKENS-512 4096}; do
        for R in 0 "$T"; do
            echo "== moe-run E64 k8 H7168 I2048 grouped, 2 ranks (MPS), $T tokens/rank, --round-tokens $R"
            # shellcheck disable=SC2086 # $X: options
            timeout 100 mpirun -np 2 $X $B/moe-run --backend cuda --experts 64 --top-k 8 \
                --hidden 7168 --intermediate 2048 --n-group 8 --topk-group 4 --scoring sigmoid \
                --x-dtype bf16 --tokens $((2 * T)) --round-tokens "$R" --iters 10 --warmup 2 2>&1 |
                quiet | grep -E "rounds|phase|tokens/s|memory|rror"
            pkill -9 -f moe-run # a hung pair would leave the GPU busy for the next
        done
    done 2>&1 | tee "$OUT/mps_layer.log"
    # the low-latency layout's rows through the grouped GEMMs, then through the fused decode
    # kernel (forced; 8 tokens a rank: at most 16 rows an expert): it must end unstalled beside
    # the peer's spinning kernels on the shared SMs (its warps claim their items); timings are
    # not two-GPU numbers
    for fv in grouped sm90_fused_decode; do
        echo "== moe-run E64 layer as above, 2 ranks (MPS), 8 tokens/rank, MOE_EP_LL=1, $fv"
        fenv=MOE_FUSED_DECODE=1 # (the default) or the kernel forced, and passed on
        xf=""
        [ $fv = grouped ] || fenv=MOE_FORCE_VARIANT=$fv xf="-x MOE_FORCE_VARIANT"
        # shellcheck disable=SC2086 # $X, $xf: options
        env "$fenv" MOE_EP_TRANSPORT=lsa MOE_EP_LL=1 timeout 100 mpirun -np 2 $X $xf -x MOE_EP_TRANSPORT \
            -x MOE_EP_LL $B/moe-run --backend cuda --experts 64 --top-k 8 --hidden 7168 \
            --intermediate 2048 --n-group 8 --topk-group 4 --scoring sigmoid --x-dtype bf16 \
            --tokens 16 --iters 50 --warmup 5 2>&1 | quiet | grep -E "phase|tokens/s|rror"
        pkill -9 -f moe-run
    done 2>&1 | tee "$OUT/mps_ll_fused.log"
    # micro-batch lanes (MOE_EP_MICROBATCH) off and on, twice each (MPS timings swing), and one
    # lane with the finish after a one-CTA wait (MOE_EP_FINISH_WAIT=1, as the lanes do)
    for T in ${MPS_MB_TOKENS-4096}; do
        for mb in 0 1 0 1 w; do
            fw=0
            [ "$mb" = w ] && mb=0 && fw=1
            echo "== moe-run E64 layer as above, 2 ranks (MPS), $T tokens/rank, MOE_EP_MICROBATCH=$mb MOE_EP_FINISH_WAIT=$fw"
            # shellcheck disable=SC2086 # $X: options
            MOE_EP_MICROBATCH=$mb MOE_EP_FINISH_WAIT=$fw timeout 100 mpirun -np 2 $X \
                -x MOE_EP_MICROBATCH -x MOE_EP_FINISH_WAIT $B/moe-run \
                --backend cuda --experts 64 --top-k 8 --hidden 7168 --intermediate 2048 \
                --n-group 8 --topk-group 4 --scoring sigmoid --x-dtype bf16 --tokens $((2 * T)) \
                --iters 10 --warmup 2 2>&1 | quiet | grep -E "rounds|phase|tokens/s|rror"
            pkill -9 -f moe-run
        done
    done 2>&1 | tee "$OUT/mps_microbatch.log"
    echo quit | nvidia-cuda-mps-control
    ;;
decode)
    BUILD_DIR=build-gpu TOKENS=${TOKENS:-1,4,8,16,64} SECONDS_PER_POINT=0.2 BENCH_TIMEOUT=60 \
        bash bench/decode_run.sh decode bench 2>&1 | grep -E "^== |graph|rc=|PASSED|FAIL"
    ;;
bf16)
    # the JSONs as one archive: the device tool brings back only so many files a call
    j=/tmp/bf16json
    rm -rf $j # a warm machine keeps the last call's files: only this run's go in the archive
    mkdir -p $j
    for p in $presets; do
        timeout 120 $B/moe-bench --preset "$p" --tokens 1,8,64,512,2048,8192 --seconds 0.2 \
            --json "$j/$p.bf16.json" 2>&1 | quiet | grep -vE "^#  *(limit|time)" | head -20
    done
    tar -czf "$OUT/bf16json.tgz" -C $j .
    # the torch peers beside them (per-expert loop, torch._grouped_mm), as the fp8 mode does
    [ "${BF16_PEERS:-1}" != 0 ] &&
        timeout 200 python3 bench/torch_peers.py --moe-json $j/*.bf16.json \
            --markdown "$OUT/peers_bf16.md" 2>&1 | grep -v "^#   ("
    ;;
fp8)
    j=/tmp/fp8json
    rm -rf $j # as bf16's: no other call's presets in the archive or the peers' inputs
    mkdir -p $j
    for p in ${FP8_PRESETS:-$presets}; do
        for s in ${FP8_SCALES:-tensor block}; do
            timeout 90 $B/moe-bench --preset "$p" --dtype fp8 --scales "$s" \
                --accum "${FP8_ACCUM:-promoted}" --tokens 1,8,64,512,2048,8192 \
                --seconds "${FP8_SECONDS:-0.2}" --json "$j/$p.$s.json" 2>&1 | quiet |
                grep -vE "^#  *(limit|time)" | head -20
        done
    done
    tar -czf "$OUT/fp8json.tgz" -C $j .
    [ -n "${FP8_PRESETS:-}" ] ||
        timeout 200 python3 bench/torch_peers.py --dtype fp8 --moe-json $j/*.tensor.json \
            --markdown "$OUT/peers_fp8.md" 2>&1 | grep -v "^#   ("
    ;;
ab)
    base=.device/ab-base
    [ -f "$base/CMakeLists.txt" ] ||
        { echo "ab: no $base (run bench/ab_base.sh REV here first, and carry .device)"; continue; }
    echo "== A/B: this tree against $(cat "$base/.ab-rev" 2>/dev/null || echo "the base")"
    if ! { cmake -S "$base" -B /tmp/ab-base-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        >"$OUT/ab-cmake.log" 2>&1 &&
        cmake --build /tmp/ab-base-build -j"$(nproc)" --target moe-bench >"$OUT/ab-build.log" 2>&1; }; then
        echo "ab: the base does not build"
        tail -20 "$OUT/ab-build.log"
        continue
    fi
    j=/tmp/abjson
    rm -rf $j
    mkdir -p $j
    IFS=';' read -ra sets <<<"${AB_ARGS:---dtype fp8 --scales tensor;--dtype fp8 --scales block}"
    for p in ${AB_PRESETS:-$presets}; do
        for i in "${!sets[@]}"; do
            for side in new base; do
                bin=$B/moe-bench commit=${MOE_BENCH_COMMIT:-}
                [ $side = base ] && bin=/tmp/ab-base-build/launch/moe-bench &&
                    commit=$(cat "$base/.ab-rev" 2>/dev/null || echo "unknown (the A/B base)")
                # shellcheck disable=SC2086 # the set's options
                MOE_BENCH_COMMIT=$commit timeout 120 "$bin" --preset "$p" ${sets[$i]} --tokens "${AB_TOKENS:-1,8,64,512,2048,8192}" \
                    --seconds "${AB_SECONDS:-0.1}" --json "$j/$side.$p.$i.json" >"$j/$side.$p.$i.txt" 2>&1 ||
                    echo "ab: $side, $p, ${sets[$i]}: failed (tail of $j/$side.$p.$i.txt: $(tail -1 "$j/$side.$p.$i.txt"))"
            done
        done
    done
    python3 bench/ab_compare.py $j | tee "$OUT/ab.txt"
    tar -czf "$OUT/ab.tgz" -C $j .
    ;;
fp8-fast)
    for p in ${FP8_PRESETS:-$presets}; do
        for a in promoted fast; do
            echo "== $p fp8 tensor, --accum $a"
            timeout 90 $B/moe-bench --preset "$p" --dtype fp8 --scales tensor --accum "$a" \
                --capacity 8192 --tokens "${FAST_TOKENS:-512,1024,2048,8192}" --seconds 0.2 \
                --explain 2>&1 | quiet | grep -vE "^#  *(limit|time)" | head -16
        done
    done
    ;;
vs)
    j=/tmp/vsjson
    rm -rf $j
    mkdir -p $j
    IFS=';' read -ra cases <<<"${VS_CASES:-qwen3-30b-a3b|--dtype fp8 --scales tensor|sm90_fp8_swapab_n16_pp|1,8,64}"
    for i in "${!cases[@]}"; do
        IFS='|' read -r p opts v toks <<<"${cases[$i]}"
        ab_case vs $j "$i" "${VS_REPS:-2}" "${VS_SECONDS:-0.1}" MOE_FORCE_VARIANT "" "$v" "$p" \
            "$opts" "$toks"
        echo "== case $i: $p $opts: $v (new) against the built-in choice (base)"
    done
    ab_finish $j vs
    ;;
gemm)
    for r in $(seq "${GEMM_REPS:-2}"); do
        # shellcheck disable=SC2086 # GEMM_MODEL, GEMM_VARIANTS: names split on spaces
        for m in ${GEMM_MODEL:-mixtral}; do
            for v in ${GEMM_VARIANTS:-sm90_fp8_m128n128_p4 sm90_fp8_m128n192_p4 sm90_fp8_m192n128_p4 sm90_fp8_m64n128_pp_p4 sm90_fp8_m64n192_pp_p4}; do
                build-gpu/bench/gemm_bench "$m" "${GEMM_MAX:-2048}" "${GEMM_MIN:-128}" "$v" 2>&1 |
                    grep "^| [a-z]" | grep -v "^| model" | sed "s/\$/ rep $r |/"
            done
        done
    done | tee "$OUT/gemm.txt"
    ;;
knob)
    # shellcheck disable=SC2206 # KNOBS: NAME=BASE:NEW specs split on spaces
    specs=(${KNOBS:-})
    [ ${#specs[@]} -gt 0 ] || [ -z "${KNOB:-}" ] || specs=("$KNOB=${KNOB_BASE:-0}:${KNOB_NEW:-1}")
    [ ${#specs[@]} -gt 0 ] ||
        { echo "knob: set KNOB=NAME (KNOB_BASE / KNOB_NEW) or KNOBS='NAME=BASE:NEW ...'"; continue; }
    j=/tmp/knobjson
    rm -rf $j
    mkdir -p $j
    base_env=() new_env=()
    for sp in "${specs[@]}"; do
        v=${sp#*=}
        base_env+=("${sp%%=*}=${v%%:*}")
        new_env+=("${sp%%=*}=${v#*:}")
    done
    IFS=';' read -ra cases <<<"${KNOB_CASES:-qwen3-30b-a3b|--dtype fp8 --scales tensor|1,8,64;qwen3-30b-a3b||1,8,64;mixtral-8x7b|--dtype fp8 --scales tensor|1,8,64}"
    for r in $(seq "${KNOB_REPS:-2}"); do
        for i in "${!cases[@]}"; do
            IFS='|' read -r p opts toks <<<"${cases[$i]}"
            knob_run $j base "$p" "$opts" "$toks" "$i.$r" "${base_env[@]}"
            for k in "${!specs[@]}"; do
                one=("${base_env[@]}")
                one[k]=${new_env[k]}
                knob_run $j "k$k" "$p" "$opts" "$toks" "$i.$r" "${one[@]}"
            done
            [ ${#specs[@]} -lt 2 ] || knob_run $j all "$p" "$opts" "$toks" "$i.$r" "${new_env[@]}"
        done
    done
    tags=$(for k in "${!specs[@]}"; do echo "k$k"; done)
    [ ${#specs[@]} -lt 2 ] || tags="$tags all"
    for tag in $tags; do
        d=$j/$tag.ab
        mkdir -p "$d"
        for f in "$j"/base.*.json; do cp "$f" "$d/"; done
        for f in "$j/$tag".*.json; do
            b=${f##*/}
            cp "$f" "$d/new.${b#"$tag".}"
        done
        if [ "$tag" = all ]; then echo "== ${new_env[*]} (new) against ${base_env[*]} (base)"; else
            echo "== ${new_env[${tag#k}]} (new) against ${base_env[*]} (base)"; fi
        python3 bench/ab_compare.py "$d"
    done | tee "$OUT/knob.txt"
    tar -czf "$OUT/knob.tgz" -C $j .
    ;;
gemm-prof)
    command -v ncu >/dev/null || { echo "gemm-prof: no ncu on this machine"; continue; }
    # preset:tokens:dtype-and-scales[:decode] (decode: the fused decode kernel, forced)
    for c in ${PROF_CASES:-deepseek-v3-ep8:64:tensor deepseek-v3-ep8:64:block \
        deepseek-v3-ep8:64:bf16 mixtral-8x7b:8:tensor mixtral-8x7b:8:bf16 \
        mixtral-8x7b:8192:tensor}; do
        IFS=: read -r p t d f <<<"$c"
        dt="--dtype fp8 --scales $d"
        [ "$d" = bf16 ] && dt="--dtype bf16"
        k=moe_gemm_sm90 force=${f:-}
        [ "${f:-}" = decode ] && k=decode_kernel force=sm90_fused_decode
        echo "== $p M = $t $d: the step's ${force:-expert GEMMs}"
        # shellcheck disable=SC2086 # $dt: options
        MOE_FORCE_VARIANT=$force timeout 120 ncu --section SpeedOfLight --section WarpStateStats \
            --section Occupancy --section MemoryWorkloadAnalysis \
            --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
            -k "regex:$k" --launch-skip 4 --launch-count 2 $B/moe-bench --preset "$p" $dt \
            --tokens "$t" --graph-max 0 --rotate 1 --seconds 0.01 \
            >"$OUT/prof-$p-$t-$d${f:+-$f}.txt" 2>&1
        grep -E "moe_gemm_sm90_kernel|decode_kernel|^ +(Duration|SM Frequency|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|L2 Hit|Mem Busy|Max Bandwidth|Issue Slots Busy|Shared)|Stall|stall|[Tt]ensor" \
            "$OUT/prof-$p-$t-$d${f:+-$f}.txt" | sed -E 's/void moe_gemm_sm90_kernel/K/; s/ +/ /g' |
            cut -c1-150 | head -40
    done
    (cd "$OUT" && tar -czf prof.tgz prof-*.txt) && rm -f "$OUT"/prof-*.txt
    ;;
trace)
    # the fused decode kernel's timeline: phases per item kind, 20 launches, caches flushed
    T=build-gpu/bench/decode_trace
    [ -x $T ] || { echo "trace: no $T (BUILD_TARGETS or device_pack.sh: decode_trace)"; continue; }
    IFS=';' read -ra tcases <<<"${TRACE_CASES:-qwen3 1 bf16 1;qwen3 1 fp8 1;qwen3 8 bf16 1;qwen3 8 fp8 1;dsv3_ep8 1 fp8 1;mixtral 1 bf16 1}"
    for c in "${tcases[@]}"; do
        echo "== $c"
        # shellcheck disable=SC2086 # $c: the program's arguments
        timeout 60 $T $c 20 | tail -n +2 | tee -a "$OUT/trace.txt"
    done
    ;;
stream)
    # HBM read rates: the decode kernel's weight pattern against contiguous loads and bulk copies
    S=build-gpu/bench/stream_bench
    [ -x $S ] || { echo "stream: no $S (BUILD_TARGETS or device_pack.sh: stream_bench)"; continue; }
    timeout 120 $S 9 | tee "$OUT/stream.txt"
    ;;
stalls)
    # where the warps wait, per SASS instruction, opcode and loop (bench/ncu_stalls.py): ncu's
    # source counters on one launch of the kernel of each case, as gemm-prof's PROF_CASES
    # (default: the fused decode kernel at one token, Qwen3 and Mixtral, fp8 and bf16)
    command -v ncu >/dev/null || { echo "stalls: no ncu on this machine"; continue; }
    for c in ${STALL_CASES:-qwen3-30b-a3b:1:tensor:decode mixtral-8x7b:1:tensor:decode \
        mixtral-8x7b:1:bf16:decode}; do
        IFS=: read -r p t d f <<<"$c"
        dt="--dtype fp8 --scales $d"
        [ "$d" = bf16 ] && dt="--dtype bf16"
        k=moe_gemm_sm90 force=""
        [ "${f:-}" = decode ] && k=decode_kernel force=sm90_fused_decode
        tag="$p-$t-$d${f:+-$f}"
        echo "== $p M = $t $d: ${force:-the expert GEMMs}, warp-stall samples"
        # shellcheck disable=SC2086 # $dt: options
        MOE_FORCE_VARIANT=$force timeout 150 ncu --section SourceCounters --section WarpStateStats \
            -k "regex:$k" --launch-skip 4 --launch-count 1 -f -o "$OUT/stalls-$tag" \
            $B/moe-bench --preset "$p" $dt --tokens "$t" --graph-max 0 --rotate 1 \
            --seconds 0.01 >"$OUT/stalls-$tag.log" 2>&1 ||
            { echo "stalls: ncu failed ($(tail -1 "$OUT/stalls-$tag.log"))"; continue; }
        ncu -i "$OUT/stalls-$tag.ncu-rep" --page source --csv --print-source sass \
            >"$OUT/stalls-$tag.csv" 2>/dev/null
        python3 bench/ncu_stalls.py "$OUT/stalls-$tag.csv" --top 20 | tee "$OUT/stalls-$tag.txt"
    done
    (cd "$OUT" && tar -czf stalls.tgz stalls-*) && rm -f "$OUT"/stalls-*
    ;;
tune)
    for p in ${TUNE_PRESETS:-$presets}; do
        for dt in ${TUNE_DTYPES:-bf16 fp8}; do
            d=""
            [ "$dt" = fp8 ] && d="--dtype fp8 --scales tensor"
            # shellcheck disable=SC2086 # $d: two options or none
            timeout "${TUNE_SECONDS:-150}" \
                mpirun -np "$([ "$ngpu" -ge 2 ] && echo "$ngpu" || echo 1)" $B/moe-tune \
                --preset "$p" $d --out "${TUNE_OUT:-$OUT/tune.json}" --iters 10 2>&1 | quiet |
                tee -a "$OUT/tune.log" | grep -E "^# moe-tune|best" | sed -E 's/^ +//; s/  +/ /g'
        done
    done
    ;;
first)
    # the first step at 20 new token counts on every rank (np = the GPUs, 2 sharing one GPU)
    for p in deepseek-v3-ep8 qwen3-30b-a3b; do
        timeout 150 mpirun -np "$np" $B/moe-bench --first-call --preset "$p" 2>&1 | quiet |
            tail -30
    done
    ;;
kernels)
    # GPU time per kernel of one step (Nsight Compute; caches flushed before each kernel)
    command -v ncu >/dev/null || { echo "kernels: no ncu on this machine"; continue; }
    for T in ${KERNEL_TOKENS:-1 8192}; do
        echo "== ${KERNEL_PRESET:-qwen3-30b-a3b} bf16, x ${KERNEL_X:-bf16}, $T tokens: us per kernel"
        timeout 240 ncu --csv --print-units base --print-kernel-base function \
            --metrics gpu__time_duration.sum \
            $B/moe-run --backend cuda --x-dtype "${KERNEL_X:-bf16}" \
            --preset "${KERNEL_PRESET:-qwen3-30b-a3b}" --tokens "$T" --iters 1 --warmup 1 \
            >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
        awk -F'","' '/gpu__time_duration/ { n = $5; v = $NF;
            gsub(/[,"]/, "", v); printf "%9.1f  %s\n", v / 1000.0, substr(n, 1, 70) }' \
            "$OUT/ncu.csv" | tail -14
        grep -q gpu__time_duration "$OUT/ncu.csv" || tail -5 "$OUT/ncu.err"
    done
    ;;
rotate)
    for r in "" "--rotate 1"; do
        # shellcheck disable=SC2086 # $r: one option or none
        timeout 90 $B/moe-bench --preset qwen3-30b-a3b --dtype fp8 --tokens 1,8,64,512 $r 2>&1 |
            quiet | grep -vE "phases" | head -14
    done
    timeout 90 $B/moe-bench --preset qwen3-30b-a3b --tokens 1,1024 --graph-max 0 2>&1 | quiet |
        grep -vE "phases" | head -12
    ;;
faults)
    for n in 2 4; do
        echo "== test_gpu_faults, $n ranks$([ "$ngpu" -ge "$n" ] || echo " sharing the GPU")"
        MOE_TEST_SHARED_GPU=$([ "$ngpu" -ge "$n" ] && echo 0 || echo lsa) timeout 300 \
            mpirun -np $n --oversubscribe -x MOE_TEST_SHARED_GPU \
            build-gpu/tests/mpi/test_gpu_faults 2>&1 | quiet | tee "$OUT/faults$n.log" |
            grep -E "survivor|teardown|FAIL" | tail -40
        echo "exit ${PIPESTATUS[0]}"
    done
    echo "== test_gpu_faults, 2 ranks, MOE_EP_MICROBATCH=1"
    MOE_EP_MICROBATCH=1 timeout 300 mpirun -np 2 --oversubscribe -x MOE_EP_MICROBATCH \
        build-gpu/tests/mpi/test_gpu_faults 2>&1 | quiet | grep -E "survivor|FAIL" | tail -12
    echo "exit ${PIPESTATUS[0]}"
    # issue 37's run: moe-run under moe-launch, one rank stopped mid-run
    for n in 2 4; do
        for at in 8 8.3; do
            echo "== moe-run qwen3-30b-a3b, $n ranks, lsa, MOE_TIMEOUT_MS=5000, SIGSTOP at $at s"
            log="$OUT/stop-$n-$at.log"
            MOE_TIMEOUT_MS=5000 timeout 120 launch/moe-launch --np $n --bind none \
                --exe $B/moe-run -- --backend cuda --preset qwen3-30b-a3b --tokens 512 \
                --iters 200000 --warmup 0 --seed 37$n >"$log" 2>&1 &
            lp=$!
            sleep "$at"
            v=$(pgrep -f -- "--seed 37$n" | while read -r p; do
                [ "$(cat /proc/"$p"/comm 2>/dev/null)" = moe-run ] && echo "$p"; done | tail -1)
            t0=$(date +%s.%N)
            kill -STOP "$v"
            first="" last=""
            said='^moe-run: rank [0-9]+: .*MOE_STATUS_TIMEOUT' # the survivors' own lines
            while kill -0 "$lp" 2>/dev/null; do
                c=$(grep -cE "$said" "$log")
                [ -z "$first" ] && [ "$c" -ge 1 ] && first=$(date +%s.%N)
                [ "$c" -ge $((n - 1)) ] && { last=$(date +%s.%N); break; }
                sleep 0.1
            done
            wait "$lp"
            rc=$?
            kill -KILL "$v" 2>/dev/null
            echo "exit $rc; survivors reporting TIMEOUT: $(grep -cE "$said" "$log") of" \
                "$((n - 1)); first $(awk "BEGIN { print ${first:-0} - $t0 }") s, last" \
                "$(awk "BEGIN { print ${last:-0} - $t0 }") s after the stop (bound 7 s)"
            grep -E "moe-run: rank|moe-launch:" "$log" | cut -c1-200 | tail -8
        done
    done
    ;;
soak)
    echo "== moe-soak, 2 ranks$([ "$ngpu" -ge 2 ] || echo " sharing the GPU"), ${SOAK_SECONDS:-420} s"
    # shellcheck disable=SC2086 # $W: a command prefix or nothing
    timeout $((${SOAK_SECONDS:-420} + 120)) mpirun -np 2 --oversubscribe $W $B/moe-soak \
        --backend cuda --seconds "${SOAK_SECONDS:-420}" --report 60 \
        --check-every "${SOAK_EVERY:-16}" 2>&1 | quiet |
        tee "$OUT/soak-gpu.log" | tail -12
    ;;
sanitize)
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    # one tool over one test, 2 ranks, its log and exit status under $OUT
    san_one() {
        # API return codes are not reported: NCCL's start-up probes kernel images and gets
        # cudaErrorNoKernelImageForDevice, which it handles (8 a rank); libmoe checks its own
        # shellcheck disable=SC2086 # $3: options or nothing
        # shellcheck disable=SC2086 # $san_env: VAR=value words
        MOE_TEST_FAULT_TIMEOUT_MS=20000 timeout "${SAN_TIMEOUT:-280}" mpirun -np 2 --oversubscribe \
            -x MOE_TEST_FAULT_TIMEOUT_MS $W env $san_env "$cs" --tool "$1" $3 --error-exitcode 9 \
            --report-api-errors no --print-limit "${SAN_PRINT_LIMIT:-20}" "build-gpu/tests/mpi/$2" \
            >"$OUT/sanitize-$1-$2.log" 2>&1
        echo $? >"$OUT/sanitize-$1-$2.rc"
    }
    san_report() {
        local log="$OUT/sanitize-$1-$2.log"
        echo "== compute-sanitizer --tool $1, $2, 2 ranks: exit $(cat "$OUT/sanitize-$1-$2.rc")" \
            "(124: stopped by SAN_TIMEOUT), success lines $(grep -cE "^success:" "$log")," \
            "reports outside NCCL's kernels $(grep -E "^========= +(Error|Race|Warning|Invalid)" \
                "$log" | grep -vc nccl)"
        grep -E "ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|=========  [A-Z]|FAILED" "$log" |
            sort | uniq -c | head -12
    }
    # the tests at a sanitizer's scale: every shape and variant up to 64 tokens, NCCL's start-up
    # under the tool given 10 minutes (it passed 120 s with 12 sanitized ranks on 16 cores);
    # SAN_ENV replaces these (empty: the tests' own scale)
    san_env=${SAN_ENV-MOE_TEST_MAX_TOKENS=64 MOE_TEST_PEER_TIMEOUT_MS=600000}
    runs=()
    for tool in ${SAN_TOOLS:-memcheck racecheck}; do
        extra=""
        [ "$tool" = memcheck ] && extra="--leak-check full"
        # racecheck: NCCL's kernels (flag-based protocols in shared memory) are left out; their
        # reports filled the print limit before libmoe's kernels came up (2026-12-02, 75a1636)
        [ "$tool" = racecheck ] && "$cs" --help 2>&1 | grep -q -- --kernel-name-exclude &&
            extra="--kernel-name-exclude kns=nccl"
        for t in ${SAN_TESTS:-test_gpu_ep test_gpu_shapes test_gpu_fp8 test_gpu_faults}; do
            [ "$tool" = racecheck ] && [ "$t" = test_gpu_faults ] && continue # spins by design
            # SAN_PARALLEL=1: every run at once (the tools' cost is mostly on the CPU side; the
            # ranks of all runs share the one GPU), reported when all have ended
            if [ "${SAN_PARALLEL:-0}" = 1 ]; then
                san_one "$tool" "$t" "$extra" &
                runs+=("$tool $t")
            else
                san_one "$tool" "$t" "$extra"
                san_report "$tool" "$t"
            fi
        done
    done
    wait
    for r in "${runs[@]}"; do
        # shellcheck disable=SC2086 # "tool test"
        san_report $r
    done
    # one archive: a call brings back a few files only
    (cd "$OUT" && tar czf sanitize.tgz sanitize-*.log sanitize-*.rc && rm -f sanitize-*.log sanitize-*.rc)
    ;;
python)
    py=${MOE_PYTHON:-python3}
    if ! "$py" -c "import transformers, pytest" 2>/dev/null; then # beside torch's environment
        "$py" -m pip install -q --no-index --find-links .whl --target /tmp/moe-pydeps \
            transformers==5.24.0 pytest==9.2.0 ||
            echo "transformers/pytest missing: carry .whl (see the usage above)"
        export PYTHONPATH=/tmp/moe-pydeps${PYTHONPATH:+:$PYTHONPATH}
    fi
    lib=$PWD/build-gpu/libmoe.so
    pp=python${PYTHONPATH:+:$PYTHONPATH}
    MOE_REQUIRE_TORCH=1 timeout 420 bash tests/python/run_pytest.sh "$py" "$PWD" "$lib" 0 -rs \
        tests/test_gpu.py tests/test_layer.py tests/test_fused_experts.py \
        >"$OUT/pytest_gpu.log" 2>&1
    grep -E "passed|failed|SKIPPED|FAILED|ERROR|Error" "$OUT/pytest_gpu.log" | head -30
    PYTHONPATH=$pp LIBMOE_LIBRARY=$lib timeout 120 "$py" bench/python_overhead.py \
        --preset qwen3-30b-a3b --tokens 1,8 --json "$OUT/python_overhead.json" 2>&1 | tail -3
    timeout 120 $B/moe-bench --preset qwen3-30b-a3b --tokens 1,8 --rotate 1 2>&1 | quiet |
        grep -vE "phases" | head -12
    PYTHONPATH=$pp LIBMOE_LIBRARY=$lib timeout 300 "$py" examples/generate.py --device cuda \
        --dtype bf16 --new-tokens 16 2>&1 | tail -4
    ;;
*)
    echo "usage: $0 [tests|quick|ep|ep-cap|ep-layer|ep-wide|mps|decode|bf16|fp8|ab|fp8-fast|vs|gemm|gemm-prof|stalls|tune|first|kernels|rotate|faults|soak|sanitize|python]..." >&2
    exit 2
    ;;
esac
done
