/* SPDX-License-Identifier: Apache-2.0 */
/* Presets and reproducible random layers/tokens for moe-run, moe-bench and the tests. Every
 * element is a hash of (seed, kind, expert, row, col), so any rank can make any slice alone. */
#ifndef MOE_LAYER_GEN_H
#define MOE_LAYER_GEN_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills cfg for "tiny", "mixtral-8x7b", "qwen3-30b-a3b", "qwen2-moe-a2.7b", "deepseek-v3",
 * "deepseek-v3-ep8" (32 of its 256 experts: one EP8 shard). Returns 0 if unknown. */
int moe_gen_preset(const char *name, moe_layer_config_t *cfg);
/* Comma-separated preset names, for help texts. */
const char *moe_gen_preset_names(void);

/* Element (r, c) of matrix `kind` (of `expert`, -1 for others) in [-a, a), a = 3/sqrt(cols
 * of the full matrix) (so products keep unit scale); bias and gate vectors are smaller. */
float moe_gen_weight(uint64_t seed, moe_weight_kind_t kind, int expert, int64_t r, int64_t c,
                     int64_t full_cols);
/* Rows [r0, r0 + rows) x cols [c0, c0 + cols) of that matrix into out (row-major). */
void moe_gen_matrix(uint64_t seed, moe_weight_kind_t kind, int expert, int64_t r0, int64_t rows,
                    int64_t c0, int64_t cols, int64_t full_cols, float *out);
/* Tokens [t0, t0 + n) of the global batch, uniform in [-1, 1). */
void moe_gen_tokens(uint64_t seed, int64_t t0, int64_t n, int hidden, float *x);

/* Router logits of tokens [t0, t0 + n) of the global batch, [n, num_experts]: -skew * ln(e + 1)
 * plus a standard Gumbel draw per (token, expert), so a token's first choice is expert e with
 * probability proportional to (e + 1)^-skew (Zipf) and its top k are a draw without replacement
 * by those weights (the Gumbel-max trick). */
void moe_gen_skewed_logits(uint64_t seed, int64_t t0, int64_t n, int num_experts, double skew,
                           float *logits);

/* Sets this rank's slice of every weight of `layer` (config `cfg`) from `seed`. */
moe_status_t moe_gen_set_weights(moe_layer_t *layer, const moe_layer_config_t *cfg, uint64_t seed);
/* The same but for ROUTER and ROUTER_BIAS (a layer run with given routing). */
moe_status_t moe_gen_set_weights_unrouted(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                          uint64_t seed);

/* The static activation scale (a checkpoint's input_scale) moe_gen_set_weights_static gives
 * matrix `kind` of `expert` (-1: the shared MLP's): gate and up in [1, 1.25) / 448 (tokens of
 * moe_gen_tokens never saturate), down in [10, 14) / 448 (h rarely does); 0 (none) for up_proj
 * of experts e % 4 == 3 (their GEMM1 input is then dynamic) and down_proj of e % 3 == 1; 0 for
 * the other kinds. */
float moe_gen_input_scale(uint64_t seed, moe_weight_kind_t kind, int expert);
/* moe_gen_set_weights, the expert and shared matrices with moe_gen_input_scale's static scales
 * (as a checkpoint with activation_scheme "static" has them): FP8 per-tensor layers keep them
 * (W8A8 uses them), every other layer computes as with moe_gen_set_weights. */
moe_status_t moe_gen_set_weights_static(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                        uint64_t seed);

/* The layer-shape options the tools share: --preset NAME, --experts E, --top-k K, --hidden H,
 * --intermediate I (a size sets *preset to "custom"). 1: `opt` is one and `value` is good; 0:
 * it is one and `value` is bad (err holds why); -1: not a shape option. */
int moe_gen_shape_option(const char *opt, const char *value, moe_layer_config_t *cfg,
                         const char **preset, char *err, size_t err_len);

/* The tools' arithmetic options: --dtype bf16|fp8 (*fp8), --scales tensor|channel|block
 * (*scales) and --accum promoted|fast (*fast: fp8_math W8A8_FAST). Same returns as
 * moe_gen_shape_option. */
int moe_gen_fp8_option(const char *opt, const char *value, int *fp8, moe_scale_kind_t *scales,
                       int *fast, char *err, size_t err_len);
/* The arithmetic options together: 0 with err where --scales or --accum fast come without
 * --dtype fp8, else 1. */
int moe_gen_fp8_check(int fp8, moe_scale_kind_t scales, int fast, char *err, size_t err_len);
/* The layer's weights as the tools measure them: bf16, or (fp8) e4m3 W8A8 (W8A8_FAST where
 * `fast`) with `scales` (per-tensor when 0). */
void moe_gen_apply_fp8(moe_layer_config_t *cfg, int fp8, moe_scale_kind_t scales, int fast);

/* Uniform random bf16 in [-a, a) (the top half of an f32: truncation is fine for timing). */
void moe_gen_fill_bf16(uint16_t *p, size_t n, float a, uint64_t *state);

/* Every weight of the layer from one shared random bf16 buffer (FP8 layers: its e4m3 codes with
 * one scale, in the layer's scale kind, so nothing is quantised at set time): fast at any size,
 * for the benchmarks and moe-tune (timing does not depend on the values). `static_act`: every
 * expert and shared matrix with a static activation scale (moe_layer_set_weight_with_input_scale:
 * W8A8 with per-tensor FP8 weights), 1 / 448 for GEMM 1's input (tokens in [-1, 1), as the
 * benchmarks make them) and 2 / 448 for GEMM 2's. */
moe_status_t moe_gen_set_weights_fast(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                      int static_act);

#ifdef __cplusplus
}
#endif

#endif /* MOE_LAYER_GEN_H */
