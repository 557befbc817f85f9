#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Rebuilds bench/results/h200.json from the tables of bench/RESULTS.md (run from the repository
# root: python3 bench/results/make_json.py), plus every moe-bench --json file under
# bench/results/moe-bench/ as a run of its own. META lists, table by table in the order they
# appear, the topic, date, commit and command; a table added to RESULTS.md needs its entry.
import json,re
md=open('bench/RESULTS.md').read().split('\n')
tables=[];cur=None;title=None
for ln in md:
    if ln.startswith('## '): title=ln[3:].strip()
    if ln.startswith('|'):
        cells=[c.strip() for c in ln.strip().strip('|').split('|')]
        if cur is None: cur={'section':title,'header':cells,'rows':[]}
        elif set(''.join(cells))<=set('-: '): pass
        else: cur['rows'].append(cells)
    else:
        if cur: tables.append(cur); cur=None
if cur: tables.append(cur)
def num(c):
    c=c.replace('**','').replace('`','').strip()
    m=re.fullmatch(r'(-?[\d.]+)\s*\(([\d.]+)\)',c)
    if m: return {'value':float(m.group(1)),'score':float(m.group(2))}
    try: return float(c) if '.' in c else int(c)
    except ValueError: return c
META=[
 dict(topic='layer_step_bf16',date='2026-12-03',commit='8f01feb (its bf16 kernels: 2170197\'s but for the kernel parameters\' layout; its fp8 change reverted by f144a86)',unit='us (score)',command='moe-bench --preset P --tokens 1,8,64,512,2048,8192 --seconds 0.1 --json FILE'),
 dict(topic='topk_redux_ab',date='2026-12-03',commit='5188aae against f7d7838',unit='new / base (two interleaved runs)',command='moe-bench --preset P [--dtype fp8 --scales S] --tokens 1,8,64 --seconds 0.1, each tree\'s build in turn'),
 dict(topic='kernels_qwen3_bf16',date='2026-12-01',commit='2626905',unit='us',command='KERNEL_TOKENS="1 8192" bash bench/device_run.sh kernels (Nsight Compute, caches flushed)'),
 dict(topic='gemm_expert_sweeps_ab',date='2026-12-04',commit='59bf912',unit='new us / base us: new / base, two runs in turn (same build)',command='KNOB=MOE_GEMM_EXPERT_GROUPS KNOB_BASE=0 KNOB_NEW=1 KNOB_CASES="P|OPTIONS|M,..." bash bench/device_run.sh knob'),
 dict(topic='slot_ids_load_histogram_ab',date='2026-12-04',commit='bf2adc5',unit='new us / base us: new / base, two runs in turn (same build)',command='KNOB=MOE_SLOT_LOAD_HIST KNOB_BASE=0 KNOB_NEW=1 KNOB_CASES="P|OPTIONS|M,..." bash bench/device_run.sh knob'),
 dict(topic='layer_step_fp8_tensor_and_block',date='2026-12-05',commit='d9f1c2c',unit='us (score)',command='moe-bench --preset P --dtype fp8 --scales tensor|block --tokens 1,8,64,512,2048,8192 --seconds 0.1 --json FILE (as FP8_PRESETS="mixtral-8x7b qwen3-30b-a3b deepseek-v3-ep8" FP8_SECONDS=0.1 bash bench/device_run.sh fp8 runs it)'),
 dict(topic='fp8_large_m_gemm_profile',date='2026-12-05',commit='d9f1c2c',unit='ms, tensor pipe % of elapsed cycles (Nsight Compute, clocks locked at 1.35 GHz)',command='PROF_CASES="mixtral-8x7b:8192:tensor mixtral-8x7b:8192:block deepseek-v3-ep8:8192:tensor" bash bench/device_run.sh gemm-prof'),
 dict(topic='fp8_h_maxima_in_gemm1_ab',date='2026-12-04',commit='c17e62e (its tree before the swap-AB rule, which only turns it off)',unit='new us / base us: new / base, two runs in turn',command='KNOB=MOE_QUANT_H_AMAX KNOB_CASES="P|--dtype fp8 --scales tensor|1,8,64,512,2048,8192;P|--dtype fp8 --scales block|1,8,64,512[,2048]" bash bench/device_run.sh knob'),
 dict(topic='fp8_m192_at_large_m_vs_builtin',date='2026-12-04',commit='3e6d478 (per-tensor), ca8b374 (block)',unit='forced us / built-in us: forced / built-in, two runs (rows per expert)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales tensor|block|sm90_fp8_m192n128_p4 or sm90_fp8_block_m192n128|M,..." bash bench/device_run.sh vs'),
 dict(topic='fp8_n192_tiles_vs_builtin',date='2026-12-05',commit='2f6a09f',unit='forced us / built-in us: forced / built-in, two runs in turn (rows per expert 256 / 512 / 1024 / 2048)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales S --capacity 8192|sm90_fp8_m128n192_p4 or sm90_fp8_block_m128n192|1024,2048,4096,8192" bash bench/device_run.sh vs'),
 dict(topic='fp8_silu_fdividef_ab',date='2026-12-05',commit='b209664 against b4fbe3b',unit='new us / base us: new / base, one run',machine='one H100 80GB HBM3 (the machine lent that day)',command='bash bench/ab_base.sh b4fbe3b; BUILD_TARGETS=moe-bench AB_TOKENS=512,2048,8192 bash bench/device_run.sh ab'),
 dict(topic='fp8_block_m128_from_55_rows_vs_builtin',date='2026-12-04',commit='4b498e6',unit='forced us / built-in us: forced / built-in, two runs (rows per expert)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales block|sm90_fp8_block_m128n128|192,256,384" bash bench/device_run.sh vs'),
 dict(topic='fp8_token_tile_multicast_vs_builtin',date='2026-12-04',commit='4b498e6',unit='forced us / built-in us: forced / built-in, two runs (rows per expert; the built-in tile)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales tensor|block|sm90_fp8_m128n128_p4_mc | sm90_fp8_m192n128_p4_mc | sm90_fp8_block_m128n128_mc | sm90_fp8_block_m192n128_mc|M,..." bash bench/device_run.sh vs'),
 dict(topic='fp8_block_swapab_no_local_memory_ab',date='2026-12-04',commit='009f777 against 0de2858',unit='new us / base us: new / base',command='bash bench/ab_base.sh 0de2858; AB_PRESETS="mixtral-8x7b deepseek-v3-ep8" AB_ARGS="--dtype fp8 --scales block" AB_TOKENS=1,8,64,512 bash bench/device_run.sh ab'),
 dict(topic='fp8_block_n8_pingpong_vs_builtin',date='2026-12-04',commit='d4eb8d2',unit='forced us / built-in us: forced / built-in, two runs (rows per expert)',command='VS_CASES="P|--dtype fp8 --scales block|sm90_fp8_block_swapab_n8_pp|1,8[,64]" bash bench/device_run.sh vs (moe-bench --preset P --dtype fp8 --scales block --tokens ... --seconds 0.1, with and without MOE_FORCE_VARIANT)'),
 dict(topic='wide_wgmma_and_swap_fold_ab',date='2026-12-03',commit='6f6c938 + 2170197 (with m192n128_p4 without its TMA store) against 2634ddd',unit='new / base',command='bash bench/ab_base.sh 2634ddd; AB_PRESETS="qwen3-30b-a3b mixtral-8x7b deepseek-v3-ep8" AB_ARGS="--dtype fp8 --scales tensor;--dtype fp8 --scales block;--dtype bf16" bash bench/device_run.sh ab'),
 dict(topic='fp8_normal_pingpong_vs_builtin',date='2026-12-03',commit='f71fdd7 (the built-in tables for any shape)',unit='forced / built-in at rows per expert, two runs',command='moe-bench --preset P [--intermediate I] --dtype fp8 --scales tensor|block --tokens ... --seconds 0.1 --explain, with and without MOE_FORCE_VARIANT=sm90_fp8_m64n128_pp_p4 | sm90_fp8_block_m64n128_pp'),
 dict(topic='fp8_epilogue_scales_ab',date='2026-12-03',commit='c1ea904 against cc18b5b',unit='new / base; two runs',command='bash bench/ab_base.sh cc18b5b; each moe-bench in turn: moe-bench --preset P --dtype fp8 --scales S --tokens 512,2048,8192 --seconds 0.1 (the second run at 512,2048, and with MOE_GEMM_TMA_STORE=0)'),
 dict(topic='fp8_promotion_interval_and_n8_ab',date='2026-12-03',commit='97c0bfb (m192n128_p4: 1bdfffb)',unit='new / base, two runs',command='VS_CASES="P|--dtype fp8 --scales tensor|VARIANT|M,..." VS_REPS=2 bash bench/device_run.sh vs (moe-bench with and without MOE_FORCE_VARIANT)'),
 dict(topic='fp8_swapab_pingpong_ab',date='2026-12-03',commit='82d1616 (its table change aside)',unit='us, two runs each',command='VS_CASES="P|--dtype fp8 --scales S|sm90_fp8_swapab_n16_pp|1,8,64;..." bash bench/device_run.sh vs (moe-bench --preset P --dtype fp8 --scales S --tokens 1,8,64 --seconds 0.1, with and without MOE_FORCE_VARIANT)'),
 dict(topic='fp8_promotion_ab',date='2026-12-02',commit='62c873a -> 75a1636 (one run)',unit='us, before -> after',command='moe-bench --preset P --dtype fp8 --scales tensor|block --tokens 1,8,64,512,2048,8192 --seconds 0.1 --json FILE, each build in turn'),
 dict(topic='fp8_fast_accumulation',date='2026-12-02',commit='d8b75f0',unit='us (layer TFLOP/s)',command='FP8_PRESETS="mixtral-8x7b deepseek-v3-ep8" bash bench/device_run.sh fp8-fast'),
 dict(topic='fp8_gemm_profile',date='2026-12-02',commit='d8b75f0',unit='us, % of peak',command='bash bench/device_run.sh gemm-prof (Nsight Compute)'),
 dict(topic='fp8_b_uniform_scales_ab',date='2026-12-05',commit='8631004',unit='us (run 1 / 2): on / off, two runs in turn (same build)',machine='one H100 80GB HBM3 (the machine lent that day)',command='KNOB=MOE_GEMM_B_UNIFORM KNOB_BASE=0 KNOB_NEW=1 KNOB_CASES="P|--dtype fp8 --scales tensor --capacity 8192|2048,8192" bash bench/device_run.sh knob'),
 dict(topic='fp8_la_tiles_vs_builtin',date='2026-12-05',commit='8631004',unit='forced us / built-in us (run 1 / 2): forced / built-in (rows per expert)',machine='one H100 80GB HBM3 (the machine lent that day)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales S --capacity 8192|VARIANT|M,..." bash bench/device_run.sh vs'),
 dict(topic='fp8_fast_accum_vs_promoted',date='2026-12-05',commit='8631004',unit='us, one run: --accum fast / --accum promoted, each with its built-in choice',machine='one H100 80GB HBM3 (the machine lent that day)',command='bash bench/device_run.sh fp8-fast'),
 dict(topic='fp8_fast_tiles_forced_vs_builtin',date='2026-12-05',commit='8631004',unit='forced us / built-in us (run 1 / 2): forced / built-in on W8A8_FAST layers (rows per expert)',machine='one H100 80GB HBM3 (the machine lent that day)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales tensor --accum fast --capacity 8192|VARIANT|M,..." bash bench/device_run.sh vs'),
 dict(topic='fp8_fast_tiles_by_shape_vs_builtin',date='2026-12-05',commit="4c110e9's kernels with the fast table's bound at 181 rows",unit='forced us / built-in us (run 1 / 2): forced / built-in on W8A8_FAST layers (rows per expert; the built-in tile)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales tensor --accum fast --capacity 8192|VARIANT|M,..." bash bench/device_run.sh vs'),
 dict(topic='layer_step_fp8_tensor_and_block_h100',date='2026-12-05',commit='5bf7733',unit='us',machine='one H100 80GB HBM3 (the machine lent that day)',command='PREBUILT=1 FP8_SECONDS=0.1 bash bench/device_run.sh fp8 (moe-bench --preset P --dtype fp8 --scales tensor|block --tokens 1,8,64,512,2048,8192 --seconds 0.1 --json FILE)'),
 dict(topic='fp8_fast_accum_vs_promoted_h100',date='2026-12-05',commit='5bf7733',unit='us promoted -> fast (the fast side\'s tile), one run, each with its built-in choice',machine='one H100 80GB HBM3 (the machine lent that day)',command='bash bench/device_run.sh fp8-fast'),
 dict(topic='fused_decode_block_scales_vs_grouped',date='2026-12-05',commit='8631004',unit='us (run 1 / 2): fused / grouped, one token',machine='one H100 80GB HBM3 (the machine lent that day)',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales block|sm90_fused_decode|1" bash bench/device_run.sh vs'),
 dict(topic='peers_bf16',date='2026-12-01 (libmoe, vLLM GEMMs); 2026-11-30 (torch)',commit='32fcdd3 / 8a3c2f0 / e6ed185',unit='us',command='moe-bench --json FILE; python3 bench/torch_peers.py --moe-json FILE --markdown OUT.md'),
 dict(topic='peers_fp8',date='2026-12-01',commit='32fcdd3 / 8a3c2f0 / 2935fd8; vLLM: issue 12',unit='us',command='python3 bench/torch_peers.py --dtype fp8 --moe-json ...'),
 dict(topic='ep_two_h200_allgather',date='2026-11-30',commit='f4c48f6',unit='us',machine='2 x H200 of one host (NVLink), NCCL 2.28.9',command='mpirun -np 2 build-gpu/launch/moe-bench --dispatch-only'),
 dict(topic='ep_mps_lsa',date='2026-12-02',commit='555aca0',unit='us (dispatch / combine / step / wall / graph)',machine='two ranks sharing one H200 under MPS: not two-GPU numbers',command='mpirun -np 2 moe-bench --dispatch-only --capacity 8192 --transport lsa --max-tokens 512 [--told]'),
 dict(topic='ep_mps_untold_ask',date='2026-12-02',commit='cd3a31d (6bef0eb measured)',unit='us (dispatch / wall / graph)',machine='two ranks sharing one H200 under MPS',command='mpirun -np 2 moe-bench --dispatch-only --capacity 8192 --transport lsa --max-tokens 8 [--told | --ask]'),
 dict(topic='first_call',date='2026-12-01',commit='2935fd8',unit='ratio',command='mpirun -np 1 build-gpu/launch/moe-bench --first-call --preset P'),
 dict(topic='tuning_bf16_qwen3_dsv3',date='2026-12-01',commit='f7ac806',unit='us / loss',command='mpirun -np 1 moe-tune --preset P --out bench/tune-h200.json --iters 10'),
 dict(topic='tuning_mixtral_bf16_and_fp8',date='2026-12-02',commit='1814ad6',unit='built-in pick, loss',command='mpirun -np 1 moe-tune --preset P [--dtype fp8 --scales tensor] --iters 10'),
 dict(topic='tuning_fp8_p4',date='2026-12-03',commit='97c0bfb with 1bdfffb\'s m192n128_p4 and the first form of its table',unit='fastest variant us; the current built-in pick\'s loss',command='mpirun -np 1 moe-tune --preset P --dtype fp8 --scales tensor --rows 48,64,96,128,160,192,224,256,320 --no-decode --no-transport --iters 10'),
 dict(topic='tuning_fp8_qwen3_margin',date='2026-12-03',commit='5188aae',unit='fastest variant us; the built-in pick\'s loss; what the file keeps',command='TUNE_PRESETS=qwen3-30b-a3b TUNE_DTYPES=fp8 bash bench/device_run.sh tune (mpirun -np 1 moe-tune --preset qwen3-30b-a3b --dtype fp8 --scales tensor --iters 10)'),
 dict(topic='fused_decode',date='2026-12-04',commit='2e515b3 (the kernel as at HEAD; its built-in crossover 0, so the built-in choice is the grouped path)',unit='us at M = 1 / 2 / 4 / 8 / 16; fused / grouped, two runs; TB/s at M = 1',command='VS_CASES="P|--dtype bf16|sm90_fused_decode|1,2,4,8,16;P|--dtype fp8 --scales tensor|sm90_fused_decode|1,2,4,8,16" VS_REPS=2 bash bench/device_run.sh vs (moe-bench --preset P [--dtype fp8 --scales tensor] --tokens 1,2,4,8,16 --seconds 0.1, with and without MOE_FORCE_VARIANT=sm90_fused_decode)'),
 dict(topic='fused_decode_capacity_8192',date='2026-12-04',commit='02e53d4 (bf16 rows: the kernel as 2e515b3), 39d99ab (fp8 rows)',unit='us at M = 1 / 8; forced / built-in, one run',command='VS_REPS=1 VS_CASES="P|--dtype D --capacity 8192|sm90_fused_decode|1,8;..." bash bench/device_run.sh vs (moe-bench --preset P [--dtype fp8 --scales tensor] --capacity 8192 --tokens 1,8 --seconds 0.1, with and without MOE_FORCE_VARIANT=sm90_fused_decode)'),
 dict(topic='kernels_fused_decode_one_token_bf16',date='2026-12-04',commit='02e53d4',unit='us per kernel, warm-up step / measured step (Nsight Compute, caches flushed)',command='KERNEL_PRESET=P KERNEL_TOKENS=1 bash bench/device_run.sh kernels (ncu --metrics gpu__time_duration.sum moe-run --backend cuda --x-dtype bf16 --preset P --tokens 1 --iters 1 --warmup 1)'),
 dict(topic='fused_decode_operands_ab',date='2026-12-04',commit='2e515b3 against 4837200',unit='us at M = 1 / 8 / 16; new / base',command='bash bench/ab_base.sh 4837200; MOE_FORCE_VARIANT=sm90_fused_decode AB_PRESETS="qwen3-30b-a3b mixtral-8x7b deepseek-v3-ep8" AB_ARGS="--dtype fp8 --scales tensor;--dtype bf16" AB_TOKENS=1,8,16 AB_SECONDS=0.15 bash bench/device_run.sh ab'),
 dict(topic='fused_decode_k1_split',date='2026-12-03',commit='83979d1',unit='us at M = 1 / 8 / 64',command='PRESETS="qwen3-30b-a3b deepseek-v3-ep8 mixtral-8x7b" VARIANTS="grouped fused fused-k1" TOKENS=1,8,64 SECONDS_PER_POINT=0.1 bash bench/decode_run.sh bench; MOE_DECODE_K1_SPLIT=2|4|8 MOE_FORCE_VARIANT=sm90_fused_decode moe-bench --preset qwen3-30b-a3b [--dtype fp8 --scales tensor] --tokens 1,8 --seconds 0.1'),
 dict(topic='kernels_qwen3_fp8_decode',date='2026-12-03',commit='97c0bfb with 1bdfffb\'s fp8 table',unit='us per kernel (Nsight Compute, no cache flush, clocks free)',command='ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --launch-skip 60 --launch-count 24 moe-bench --preset qwen3-30b-a3b --dtype fp8 --scales tensor --tokens T --graph-max 0'),
 dict(topic='decode_latency_knobs',date='2026-12-03',commit='0e52188 (the branch that carried the three changes)',unit='new / base, two runs',command='KNOBS="MOE_COMBINE_BATCH=0:1 MOE_LOGITS_PREFETCH=0:1 MOE_QUANT_PDL=0:1" KNOB_CASES="qwen3-30b-a3b|--dtype fp8 --scales tensor|1,8,64;deepseek-v3-ep8|--dtype fp8 --scales block|1,8;mixtral-8x7b|--dtype fp8 --scales tensor|1,8;qwen3-30b-a3b||1,8" bash bench/device_run.sh knob'),
 dict(topic='fused_decode_timeline',date='2026-12-04',commit='1a3129c (bf16 rows), 3f21907 (fp8 rows), a31371a and 8d4c3f5 (rows so marked)',unit='us from the first warp\'s entry, medians over 20 launches (caches flushed, fresh routing)',command='bench/decode_trace P T DTYPE 1 20 (qwen3|dsv3_ep8|mixtral, tokens, bf16|fp8, GEMM 1 k split, launches)'),
 dict(topic='fused_decode_x_quantisation_ab',date='2026-12-04',commit='81cfc90 against 6a3ab55',unit='us at M = 1 / 2 / 4 / 8; new / base, two interleaved runs',command='MOE_FORCE_VARIANT=sm90_fused_decode moe-bench --preset P [--dtype fp8 --scales tensor] --tokens 1,2,4,8 --seconds 0.15, each tree\'s build in turn'),
 dict(topic='fused_decode_fp8_x_f16_ab',date='2026-12-04',commit='8d4c3f5 against 8f37b5c',unit='us at M = 1 / 2 / 4 / 8; new / base, two interleaved runs',command='MOE_FORCE_VARIANT=sm90_fused_decode moe-bench --preset P --dtype fp8 --scales tensor --tokens 1,2,4[,8] --seconds 0.1, each tree\'s build in turn'),
 dict(topic='fused_decode_fp8_one_token_by_shape',date='2026-12-04',commit='a6e1484',unit='a token\'s expert weights; fused / grouped us at M = 1; fused / grouped, two runs, at M = 1 and 2',command='VS_REPS=2 VS_CASES="P|--dtype fp8 --scales tensor --capacity 8192 [--intermediate I]|sm90_fused_decode|1,2;..." bash bench/device_run.sh vs (moe-bench with and without MOE_FORCE_VARIANT=sm90_fused_decode)'),
 dict(topic='fused_decode_shared_inside_ab',date='2026-12-05',commit='019bc91',unit='inside us / grouped shared us at M = 1 / 8: inside / grouped shared, two runs in turn (the kernel forced on both sides)',command='MOE_FORCE_VARIANT=sm90_fused_decode KNOB=MOE_DECODE_SHARED KNOB_CASES="qwen2-moe-a2.7b||1,8;qwen2-moe-a2.7b|--dtype fp8 --scales tensor|1,8;deepseek-v3|--dtype fp8 --scales tensor|1,8" bash bench/device_run.sh knob'),
 dict(topic='fused_decode_shared_inside_three_paths',date='2026-12-05',commit='019bc91',unit='us',command='moe-bench --preset P [--dtype fp8 --scales tensor] --tokens 1,2,4,8,16,32 --seconds 0.2 with MOE_FUSED_DECODE=0 (grouped), MOE_DECODE_SHARED=0 (the built-in choice before), and MOE_FORCE_VARIANT=sm90_fused_decode (shared inside)'),
 dict(topic='hbm_read_decode_pattern',date='2026-12-04',commit='d56da1d',unit='TB/s over the CTAs\' span / over the events, caches flushed, median of 9',command='bash bench/device_run.sh stream (stream_bench 9)'),
 dict(topic='hbm_read_best_case',date='2026-12-04',commit='d56da1d',unit='TB/s over the CTAs\' span / over the events, caches flushed, median of 9',command='bash bench/device_run.sh stream (stream_bench 9)'),
 dict(topic='python_overhead',date='2026-12-04',commit='60ffb62',unit='us',command='python3 bench/python_overhead.py --preset qwen3-30b-a3b --tokens 1,8; moe-bench --preset qwen3-30b-a3b --tokens 1,8 --rotate 1'),
 dict(topic='correctness',date='2026-11-30 .. 2026-12-02',commit='per row',unit='',command='bash bench/device_run.sh tests (ctest -L gpu, MOE_REQUIRE_GPU=1)'),
 dict(topic='eplb_cpu_moe_run',date='2026-12-02',commit='669661f',unit='imbalance, hash',machine='the 2-core development VM, CPU backend, Open MPI over vader',command='mpirun -np 4 moe-run --experts 64 --top-k 8 --hidden 1024 --intermediate 512 --tokens 4096 --route-skew 1.2 --redundant-experts 4 --eplb'),
 dict(topic='eplb_cpu_weight_moves',date='2026-12-02',commit='ab53ff7',unit='s, GB/s',machine='the 2-core development VM, CPU backend, Open MPI over vader',command='mpirun -np 2 moe-bench --eplb --experts 16 --hidden 7168 --intermediate 2048 --no-step --moves 4'),
]
assert len(tables)==len(META),(len(tables),[t['header'][:2] for t in tables])
out={'about':'The current tables of bench/RESULTS.md as data (same numbers, same sections). Times in microseconds unless "unit" says otherwise; a cell "x (s)" is {"value": x, "score": s}, score = limit / time.',
     'machine':'NVIDIA H200 (132 SMs, clocks not locked), CUDA 13.0, NCCL 2.28.9 unless a table says otherwise',
     'tables':[],'runs':[]}
for t,m in zip(tables,META):
    e=dict(m); e['section']=t['section']; e['columns']=t['header']; e['rows']=[[num(c) for c in r] for r in t['rows']]
    e.setdefault('machine','one NVIDIA H200')
    out['tables'].append(e)
# normalised layer-step points
presets=['mixtral-8x7b','qwen3-30b-a3b','deepseek-v3-ep8']
for t,m in zip(tables,META):
    if m['topic']=='layer_step_fp8_tensor_and_block':
        for r in t['rows']:
            M=int(r[0])
            for i,p in enumerate(presets):
                for sc,cell in (('tensor',r[1+2*i].split(' / ')[0]),('block',r[1+2*i].split(' / ')[1])):
                    v=num(cell)
                    out['runs'].append({'topic':'layer_step_fp8','preset':p,'dtype':'fp8','scales':sc,'tokens':M,'us':v['value'],'score':v['score'],
                                        'date':m['date'],'commit':m.get('commit_'+p,m.get('commit_'+sc,m['commit'])),'command':'moe-bench --preset %s --dtype fp8 --scales %s --tokens 1,8,64,512,2048,8192 --seconds %s'%(p,sc,'0.2' if p in m.get('seconds_02',()) else '0.1')})
    if m['topic'] in ('layer_step_bf16',):
        for r in t['rows']:
            M=int(r[0])
            for i,p in enumerate(presets):
                v=num(r[1+i]); rec={'topic':m['topic'],'preset':p,'dtype':'bf16' if 'bf16' in m['topic'] else 'fp8','scales':None if 'bf16' in m['topic'] else ('tensor' if 'tensor' in m['topic'] else 'block'),'tokens':M,
                     'date':m['date'],'commit':m['commit'] if m['topic']!='layer_step_fp8_block' else ('2935fd8' if i==0 else '8a3c2f0'),'command':m['command'].replace('--preset P','--preset '+p)}
                if isinstance(v,dict): rec['us']=v['value']; rec['score']=v['score']
                else: rec['us']=v
                out['runs'].append(rec)
# moe-bench --json outputs kept whole (bench/results/moe-bench/*.json: one preset x dtype x
# scales each, with its date and commit), one run each
import glob,os
for f in sorted(glob.glob('bench/results/moe-bench/*.json')):
    r=json.load(open(f)); r['topic']='moe_bench_json'; r['file']=os.path.relpath(f)
    # the fused-decode comparison's files: which path ran (moe-bench did not record the
    # environment before 2026-12-05; later files carry "env"; "fused" ran with
    # MOE_FORCE_VARIANT=sm90_fused_decode)
    if '-decode-' in f:
        r['decode_path']=('sm90_fused_decode (forced)' if '-fused-' in f else
                          'the built-in choice (each point\'s explain names it)' if '-builtin-' in f
                          else 'grouped (built-in choice)')
        if '-cap8192-' in f: r['capacity']=8192
    out['runs'].append(r)
# runs that come from neither (none at present) are kept from the file as it was
made={r['topic'] for r in out['runs']}
# (topics whose tables were replaced by newer measurements are dropped, not kept)
retired={'layer_step_fp8_per_tensor','layer_step_fp8_block','layer_step_bf16_remeasured','fused_decode'}
try: kept=[r for r in json.load(open('bench/results/h200.json'))['runs'] if r.get('topic') not in made|retired]
except (OSError,ValueError,KeyError): kept=[]
out['runs']+=kept
json.dump(out,open('bench/results/h200.json','w'),indent=1,ensure_ascii=False)
open('bench/results/h200.json','a').write('\n')
print(len(out['tables']),len(out['runs']))
