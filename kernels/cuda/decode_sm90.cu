// SPDX-License-Identifier: Apache-2.0
// The fused small-batch decode step's host side (kernels/decode.h): the sync array's size, the
// k split rules, the checks and the launch, which hands the step to the translation unit that
// holds its kernel instances (kernels/cuda/decode_sm90.cuh: the kernel; decode_*_sm90.cu: the
// instances).
#include "kernels/cuda/decode_sm90.cuh"

using namespace moe_dec;

extern "C" size_t moe_decode_sync_count(int num_experts, int hidden, int inter, int split1,
                                        int max_rows)
{
    /* the maxima: one a row, or (block scales) one a row and 128-wide group of inter */
    return (size_t)sync_hmax(num_experts, hidden, inter, split1) +
           (size_t)max_rows * (size_t)((inter + 127) / 128);
}

// A k split for `items` items of a step of one token: enough items for every warp of the GPU,
// at least 256 of the k length `k` a piece, at most MOE_DECODE_MAX_SPLIT
static int split_rule(int64_t items, int k, int num_sms)
{
    const int64_t warps = (int64_t)(num_sms > 0 ? num_sms : 132) * 2 * WARPS;
    int64_t split = items > 0 ? warps / items : 1;
    const int64_t most = k / 256 > 0 ? k / 256 : 1;
    if (split > most)
        split = most;
    if (split > MOE_DECODE_MAX_SPLIT)
        split = MOE_DECODE_MAX_SPLIT;
    return split < 1 ? 1 : (int)split;
}

extern "C" int moe_decode_split(int num_experts, int top_k, int hidden, int inter, int num_sms)
{
    const int64_t touched = top_k < num_experts ? top_k : num_experts;
    return split_rule(touched * ((hidden + TILE2 - 1) / TILE2), inter, num_sms);
}

extern "C" int moe_decode_split1(int num_experts, int top_k, int hidden, int inter, int num_sms)
{
    const int64_t touched = top_k < num_experts ? top_k : num_experts;
    return split_rule(touched * (inter / TILE1), hidden, num_sms);
}

extern "C" moe_status_t moe_decode_check(int num_experts, int top_k, int hidden, int inter, int f8)
{
    const int align = f8 ? 16 : 8;
    if (num_experts <= 0 || num_experts > MOE_DECODE_MAX_EXPERTS)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "decode: num_experts = %d (1 .. %d)",
                         num_experts, MOE_DECODE_MAX_EXPERTS);
    if (top_k <= 0 || top_k > 16)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "decode: top_k = %d (1 .. 16)", top_k);
    if (hidden <= 0 || hidden % align || inter <= 0 || inter % align)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "decode: hidden = %d, inter = %d (multiples of %d expected)", hidden,
                         inter, align);
    if (f8 < 0 || f8 > 2)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "decode: f8 = %d (0 bf16, 1 per-row scales, 2 block scales)", f8);
    /* block scales: one token's x as f16 and its group scales in every CTA's shared memory */
    if (f8 == 2 && (2 * hidden + 15) / 16 * 16 + 4 * ((hidden + 127) / 128) > XS_MAX)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "decode: hidden = %d with block scales (one token's x and its scales "
                         "must fit %d bytes of shared memory)",
                         hidden, XS_MAX);
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_decode_launch(const moe_decode_args_t *a, void *stream)
{
    params p;
    const bool lo = a->lo_counts != nullptr;
    MOE_CHECK(moe_decode_check(a->num_experts, a->top_k, a->hidden, a->inter, a->f8));
    MOE_ARG_CHECK(a->num_tokens >= 0 &&
                      a->num_tokens <= (lo ? MOE_DECODE_MAX_ROWS : MOE_DECODE_MAX_TOKENS),
                  "decode: num_tokens = %lld (at most %d)", (long long)a->num_tokens,
                  lo ? MOE_DECODE_MAX_ROWS : MOE_DECODE_MAX_TOKENS);
    MOE_ARG_CHECK(!lo || (a->top_k == 1 && a->lo_offsets && a->rows_out &&
                          ((uintptr_t)a->rows_out & 15) == 0 && a->x_dtype == MOE_DTYPE_BF16 &&
                          !a->trace),
                  "decode: laid-out rows need top_k = 1 (not %d), lo_offsets, a 16-byte aligned "
                  "rows_out, bf16 x and no trace",
                  a->top_k);
    MOE_ARG_CHECK(!lo || (a->lo_cols >= 1 && a->lo_cols <= MOE_DECODE_MAX_TOKENS),
                  "decode: lo_cols = %d (1 .. %d)", a->lo_cols, MOE_DECODE_MAX_TOKENS);
    const int nsh = a->shared_w13 && a->inter > 0 ? a->shared_inter / a->inter : 0;
    if (a->shared_w13) {
        MOE_ARG_CHECK(a->shared_inter > 0 && a->shared_inter % a->inter == 0,
                      "decode: shared_inter = %d (a multiple of inter = %d)", a->shared_inter,
                      a->inter);
        MOE_ARG_CHECK(a->shared_w2 && (!a->f8 || (a->shared_w13_scale && a->shared_w2_scale)),
                      "decode: the shared MLP needs shared_w2 (and fp8 its scales)");
        MOE_ARG_CHECK(!lo && !a->trace && !a->shared_out && a->split1 <= 1,
                      "decode: the shared MLP inside takes no laid-out rows, trace, shared_out or "
                      "GEMM 1 split (split1 = %d)",
                      a->split1);
        MOE_ARG_CHECK(((uintptr_t)a->shared_w13 & 15) == 0 && ((uintptr_t)a->shared_w2 & 15) == 0,
                      "decode: the shared weights must be 16-byte aligned");
        MOE_CHECK(
            moe_decode_check(a->num_experts + nsh, a->top_k + nsh, a->hidden, a->inter, a->f8));
    }
    MOE_ARG_CHECK(!a->f8 || !(a->input_scale13 || a->input_scale2) ||
                      (a->split1 <= 1 && !a->shared_w13 && !a->trace),
                  "decode: static activation scales take no GEMM 1 split (split1 = %d), shared "
                  "MLP inside or trace",
                  a->split1);
    MOE_ARG_CHECK(a->f8 != 2 || (a->num_tokens <= 1 && !lo && !a->shared_w13 && !a->input_scale13 &&
                                 !a->input_scale2 && a->split1 <= 1 && !a->trace),
                  "decode: block scales take one token a launch (not %lld), the routed form: no "
                  "laid-out rows, shared MLP inside, static scales, GEMM 1 split or trace",
                  (long long)a->num_tokens);
    MOE_ARG_CHECK(a->split >= 1 && a->split <= MOE_DECODE_MAX_SPLIT, "decode: split = %d",
                  a->split);
    MOE_ARG_CHECK(a->split1 >= 0 && a->split1 <= MOE_DECODE_MAX_SPLIT, "decode: split1 = %d",
                  a->split1);
    MOE_ARG_CHECK(a->split1 <= 1 || a->o1, "decode: split1 = %d needs the o1 workspace", a->split1);
    MOE_ARG_CHECK(a->x_dtype == MOE_DTYPE_F32 || a->x_dtype == MOE_DTYPE_BF16,
                  "decode: x dtype %s (F32 or BF16)", moe_dtype_name(a->x_dtype));
    MOE_ARG_CHECK(a->y_dtype == MOE_DTYPE_F32 || a->y_dtype == MOE_DTYPE_BF16,
                  "decode: y dtype %s (F32 or BF16)", moe_dtype_name(a->y_dtype));
    MOE_ARG_CHECK(((uintptr_t)a->x & 15) == 0 && ((uintptr_t)a->w13 & 15) == 0 &&
                      ((uintptr_t)a->w2 & 15) == 0 && ((uintptr_t)a->h & 15) == 0 &&
                      (!a->f8 || ((uintptr_t)a->xq & 15) == 0),
                  "decode: x, weights and workspace must be 16-byte aligned");
    MOE_ARG_CHECK(!a->f8 || (a->w13_scale && a->w2_scale && a->xq && a->xs),
                  "decode: fp8 needs the weight scales and the x workspace");
    if (a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    p.x = a->x;
    p.ids = a->topk_ids;
    p.w = a->topk_weights;
    p.w13 = static_cast<const uint8_t *>(a->w13);
    p.w2 = static_cast<const uint8_t *>(a->w2);
    p.w13s = a->w13_scale;
    p.w2s = a->w2_scale;
    p.shared = static_cast<const __nv_bfloat16 *>(a->shared_out);
    p.gate_logit = a->shared_gate_logit;
    p.y = a->y;
    p.counts = a->counts;
    p.h = static_cast<__nv_bfloat16 *>(a->h);
    p.o = a->o;
    p.xq = a->xq;
    p.xs = a->xs;
    p.sync = a->sync;
    p.sticky = a->sticky;
    p.timeout_ns = a->timeout_ns;
    p.trace = a->trace;
    p.T = (int)a->num_tokens;
    p.k = a->top_k;
    p.E = a->num_experts;
    p.H = a->hidden;
    p.I = a->inter;
    p.split = a->split;
    p.split1 = a->split1 > 1 && !lo ? a->split1 : 1; /* laid-out rows: GEMM 1 whole */
    p.o1 = a->o1;
    p.y_f32 = a->y_dtype == MOE_DTYPE_F32;
    p.gelu = a->gelu;
    p.lo_cnt = a->lo_counts;
    p.lo_off = a->lo_offsets;
    p.rows_out = static_cast<__nv_bfloat16 *>(a->rows_out);
    p.lo_cols = a->lo_cols;
    p.rank = a->sticky_rank;
    p.sticky_bits = a->sticky_bits;
    p.Er = p.E; // the shared MLP's chunks after the routed experts and slots
    p.kr = p.k;
    p.nsh = nsh;
    p.E += nsh;
    p.k += nsh;
    p.SI = a->shared_inter;
    p.sw13 = static_cast<const uint8_t *>(a->shared_w13);
    p.sw2 = static_cast<const uint8_t *>(a->shared_w2);
    p.sw13s = a->shared_w13_scale;
    p.sw2s = a->shared_w2_scale;
    p.in13 = a->f8 ? a->input_scale13 : nullptr;
    p.in2 = a->f8 ? a->input_scale2 : nullptr;
    p.G1 = a->f8 == 2 ? (p.H + 127) / 128 : 0;
    p.G2 = a->f8 == 2 ? (p.I + 127) / 128 : 0;
    const cudaStream_t st = (cudaStream_t)stream;
    if (lo)
        return a->f8 ? run_laid_out<true>(p, a->max_ctas, st)
                     : run_laid_out<false>(p, a->max_ctas, st);
    if (a->f8)
        return a->x_dtype == MOE_DTYPE_F32
                   ? run_routed<true, float>(p, a->y_dtype, a->max_ctas, st)
                   : run_routed<true, __nv_bfloat16>(p, a->y_dtype, a->max_ctas, st);
    return a->x_dtype == MOE_DTYPE_F32
               ? run_routed<false, float>(p, a->y_dtype, a->max_ctas, st)
               : run_routed<false, __nv_bfloat16>(p, a->y_dtype, a->max_ctas, st);
}

extern "C" moe_status_t moe_decode_prepare(void)
{
    MOE_CHECK((prepare_routed<false, float>()));
    MOE_CHECK((prepare_routed<false, __nv_bfloat16>()));
    MOE_CHECK((prepare_routed<true, float>()));
    MOE_CHECK((prepare_routed<true, __nv_bfloat16>()));
    MOE_CHECK(prepare_laid_out<false>());
    return prepare_laid_out<true>();
}
