/* SPDX-License-Identifier: Apache-2.0 */
/* The grouped expert GEMM variant table (kernels/expert_gemm_table.h). Which variant a step runs is
 * the oracle's choice (runtime/oracle.c; thresholds: docs/KERNELS.md). */
#include "kernels/expert_gemm_table.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "base/diag.h"

#ifdef MOE_HAVE_CUDA
#include "kernels/expert_gemm_simple.h"
#include "kernels/prepare.h"
#endif

/* The table is built without CUDA too (launch NULL): the oracle and the tune file reader
 * (runtime/oracle.c) check variant names, dtypes and archs on any machine. */
#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/expert_gemm_launch.h"
#define L(fn) fn
#else
#define L(fn) NULL
#endif

/* An FP8 variant slots in as another row with its ab_dtype / scale_kind; moe_gemm_select only
 * returns rows whose dtype and scale kind match. */
static const moe_gemm_variant_t variants[] = {
    {"sm90_swapab_n8", 90, 8, 1, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm90_swap8_launch), 0},
    {"sm90_swapab_n16", 90, 16, 1, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm90_swap16_launch),
     0},
    {"sm90_swapab_n32", 90, 32, 1, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm90_swap32_launch),
     0},
    {"sm90_swapab_n64", 90, 64, 1, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm90_swap64_launch),
     0},
    {"sm90_swapab_w128_n32", 90, 32, 1, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_swap32w_launch), 0},
    {"sm90_wgmma_tma_m64n256", 90, 64, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_m64_launch), 0},
    {"sm90_wgmma_tma_m64n256_pp", 90, 64, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_m64pp_launch), 0},
    {"sm90_wgmma_tma_m128n256", 90, 128, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_m128_launch), 0},
    {"sm90_wgmma_tma_m192n128", 90, 192, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_m192_launch), 0},
    {"sm90_wgmma_tma_m256n128", 90, 256, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE,
     L(moe_gemm_sm90_m256_launch), 0},
    {"sm90_fp8_swapab_n16", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap16_launch), 0},
    {"sm90_fp8_swapab_n32", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap32_launch), 0},
    /* _pp: two consumer warpgroups on alternate items (ping-pong) */
    {"sm90_fp8_swapab_n16_pp", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap16pp_launch), 0},
    {"sm90_fp8_swapab_n32_pp", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap32pp_launch), 0},
    /* not in a built-in table: for moe-tune and MOE_FORCE_VARIANT until measured */
    {"sm90_fp8_swapab_w128_n16_pp", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap16wpp_launch), 0},
    {"sm90_fp8_swapab_n8_pp", 90, 8, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap8pp_launch), 0},
    /* _p4: promoted every 4 slices of 128 k, not after each (docs/KERNELS.md, "FP8 W8A8") */
    {"sm90_fp8_swapab_n16_pp_p4", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap16ppi_launch), 0},
    {"sm90_fp8_swapab_n32_pp_p4", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap32ppi_launch), 0},
    {"sm90_fp8_swapab_n64", 90, 64, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_swap64_launch), 0},
    {"sm90_fp8_m64n128", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_m64_launch), 0},
    {"sm90_fp8_m128n128", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_m128_launch), 0},
    {"sm90_fp8_m192n128", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8_m192_launch), 0},
    {"sm90_fp8_m128n128_p4", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m128_launch), 0},
    {"sm90_fp8_m192n128_p4", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m192_launch), 0},
    /* _la: each warpgroup's epilogue under the first stage of its next item's wgmmas */
    {"sm90_fp8_m128n128_p4_la", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m128la_launch), 0},
    {"sm90_fp8_m192n128_p4_la", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m192la_launch), 0},
    /* _mc: 2-CTA clusters on two weight tiles of one row block, the token tile multicast */
    {"sm90_fp8_m128n128_p4_mc", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m128mc_launch), 0},
    {"sm90_fp8_m192n128_p4_mc", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m192mc_launch), 0},
    /* ping-pong: two consumer warpgroups on alternate 64-row items */
    {"sm90_fp8_m64n128_pp_p4", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m64pp_launch), 0},
    /* n192: 96 gate + 96 up weight rows a tile (two consumer warpgroups at most) */
    {"sm90_fp8_m128n192_p4", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m128w_launch), 0},
    /* _la: each warpgroup's epilogue under the first stage of its next item's wgmmas */
    {"sm90_fp8_m128n192_p4_la", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m128wla_launch), 0},
    {"sm90_fp8_m64n192_pp_p4", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8i_m64wpp_launch), 0},
    /* no promotion (fast_accum): the W8A8_FAST tables (runtime/oracle.c), or forced */
    {"sm90_fp8_fast_m64n256", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_m64_launch), 1},
    {"sm90_fp8_fast_m64n256_pp", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_m64pp_launch), 1},
    {"sm90_fp8_fast_m128n256", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_m128_launch), 1},
    {"sm90_fp8_fast_swapab_n8_pp", 90, 8, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_swap8pp_launch), 1},
    {"sm90_fp8_fast_swapab_n16_pp", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_swap16pp_launch), 1},
    {"sm90_fp8_fast_swapab_n32_pp", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL,
     L(moe_gemm_sm90_fp8f_swap32pp_launch), 1},
    {"sm90_fp8_block_swapab_n16", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_swap16_launch), 0},
    {"sm90_fp8_block_swapab_n32", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_swap32_launch), 0},
    {"sm90_fp8_block_swapab_n16_pp", 90, 16, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_swap16pp_launch), 0},
    {"sm90_fp8_block_swapab_n32_pp", 90, 32, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_swap32pp_launch), 0},
    {"sm90_fp8_block_swapab_n8_pp", 90, 8, 1, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_swap8pp_launch), 0},
    {"sm90_fp8_block_m64n128", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m64_launch), 0},
    {"sm90_fp8_block_m128n128", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m128_launch), 0},
    {"sm90_fp8_block_m192n128", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m192_launch), 0},
    /* _la: each warpgroup's epilogue under the first slice of its next item's wgmmas */
    {"sm90_fp8_block_m128n128_la", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m128la_launch), 0},
    {"sm90_fp8_block_m192n128_la", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m192la_launch), 0},
    {"sm90_fp8_block_m128n128_mc", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m128mc_launch), 0},
    {"sm90_fp8_block_m192n128_mc", 90, 192, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m192mc_launch), 0},
    {"sm90_fp8_block_m64n128_pp", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m64pp_launch), 0},
    /* n192 (two consumer warpgroups at most): a 96-row half may cross a 128-row scale block */
    {"sm90_fp8_block_m128n192", 90, 128, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m128w_launch), 0},
    {"sm90_fp8_block_m64n192_pp", 90, 64, 0, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128,
     L(moe_gemm_sm90_fp8b_m64wpp_launch), 0},
    {"sm80_mma_m32n128", 80, 32, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm80_m32_launch), 0},
    {"sm80_mma_m64n128", 80, 64, 0, MOE_DTYPE_BF16, MOE_SCALE_NONE, L(moe_gemm_sm80_m64_launch), 0},
};
#define NUM_VARIANTS ((int)(sizeof(variants) / sizeof(variants[0])))
#undef L

const moe_gemm_variant_t *moe_gemm_variants(int *count)
{
    if (count)
        *count = NUM_VARIANTS;
    return variants;
}

/* Variants on trial (moe_gemm_variant_on_trial), each with the date it was built and what
 * clears it: test_gpu_expert_gemm on a GPU and a measurement (then it leaves this list). */
static const char *const on_trial[] = {
    /* 2026-12-05 (docs/KERNELS.md, "Epilogue under the next item's first stage"): all passed
     * test_gpu_expert_gemm on an H100 (8631004). Forced against the built-in table the same day
     * at a capacity of 8192 (two runs): m192n128_p4_la 1.05 on Qwen3-30B-A3B at 512 rows per
     * expert, m128n192_p4_la 1.02 on Mixtral-8x7B at 2048, so neither replaced its tile; the
     * m128n128 ones unmeasured. sm90_fp8_block_m192n128_la won and left the list (the block
     * table past 362 rows per expert). */
    "sm90_fp8_m128n128_p4_la",
    "sm90_fp8_m192n128_p4_la",
    "sm90_fp8_m128n192_p4_la",
    "sm90_fp8_block_m128n128_la",
    /* 2026-12-05: swap-AB tiles without promotion (fp8_math W8A8_FAST); passed
     * test_gpu_expert_gemm on an H100 (8631004); sm90_fp8_fast_swapab_n16_pp forced on a
     * W8A8_FAST Mixtral-8x7B layer at 8 / 64 tokens 1.02 / 1.00 of the promoted n8_pp / n16_pp
     * (two runs): no gain, so no table */
    "sm90_fp8_fast_swapab_n8_pp",
    "sm90_fp8_fast_swapab_n16_pp",
    "sm90_fp8_fast_swapab_n32_pp",
};

int moe_gemm_variant_on_trial(const moe_gemm_variant_t *v)
{
    if (!v)
        return 0;
    for (size_t i = 0; i < sizeof(on_trial) / sizeof(on_trial[0]); i++)
        if (strcmp(v->name, on_trial[i]) == 0)
            return 1;
    return 0;
}

int moe_gemm_variant_runs_on(const moe_gemm_variant_t *v, int arch)
{
    /* sm_90a code runs on compute capability 9.0 alone; the sm_80 family carries PTX that
     * the driver compiles for any newer device. */
    if (!v)
        return 0;
    return v->min_arch == 90 ? arch == 90 : arch >= v->min_arch;
}

#ifdef MOE_HAVE_CUDA
static moe_status_t prepare_variant(const moe_gemm_variant_t *v)
{
    /* Never dereferenced: max_blocks = 0 returns before any operand is read. */
    static _Alignas(16) char dummy[16];
    static float dummy_scale[1];
    moe_gemm_args_t g;
    int epi;
    memset(&g, 0, sizeof(g));
    g.a = g.b = g.c = dummy;
    g.a_scale = g.b_scale = dummy_scale;
    g.block_expert = g.num_blocks = (const int32_t *)dummy;
    g.c = dummy;
    g.num_experts = 1;
    g.n = g.k = 64;
    g.ab_dtype = v->ab_dtype;
    g.scale_kind = v->scale_kind;
    for (epi = MOE_GEMM_EPI_STORE; epi <= MOE_GEMM_EPI_GELU_MUL; epi++) {
        g.epilogue = (moe_gemm_epilogue_t)epi;
        MOE_CHECK(v->launch(&g, NULL));
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gemm_prepare(int arch)
{
    for (int i = 0; i < NUM_VARIANTS; i++)
        if (moe_gemm_variant_runs_on(&variants[i], arch))
            MOE_CHECK(prepare_variant(&variants[i]));
    return prepare_variant(moe_gemm_simple_variant());
}
#endif

const moe_gemm_variant_t *moe_gemm_variant_by_name(const char *name)
{
    if (!name)
        return NULL;
    for (int i = 0; i < NUM_VARIANTS; i++)
        if (strcmp(variants[i].name, name) == 0)
            return &variants[i];
    return NULL;
}
