/* SPDX-License-Identifier: Apache-2.0 */
/* The weight-value check (NaN/Inf weights, FP8 scales not finite and > 0) and the set-weight
 * entry the checkpoint loader uses so that errors name the file's tensor. Internal. */
#ifndef MOE_WEIGHTS_H
#define MOE_WEIGHTS_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Scans rows [r0, r0 + rows) x cols [c0, c0 + cols) of `t` (F32, BF16, F16 or FP8_E4M3):
 * every value finite (FP8 e4m3: not a NaN code), and for FP8 the scales of the blocks those
 * elements use finite and > 0 (`scale_kind` says how t->scale is laid out). The error
 * (MOE_STATUS_NUMERIC_ERROR) reads "<what>: element [r, c] is <value>" or "<what>: scale
 * [r, c] is <value>", with row_off/col_off added to the element indices (the position in a
 * larger tensor that `t` is a slice of) and row_off/128, col_off/128 to the scale indices. */
moe_status_t moe_tensor_check_values(const moe_tensor_t *t, moe_scale_kind_t scale_kind, int64_t r0,
                                     int64_t c0, int64_t rows, int64_t cols, const char *what,
                                     int64_t row_off, int64_t col_off);

/* Scans scales [rows, cols] (row-major): each finite and > 0; offsets as above. */
moe_status_t moe_scales_check(const float *scale, int64_t rows, int64_t cols, const char *what,
                              int64_t row_off, int64_t col_off);

/* 1 when the layer scans weights (skip_weight_check == 0). */
int moe_layer_checks_weight_values(const moe_layer_t *layer);

/* moe_layer_set_weight, with the error messages of the value check naming `origin` (e.g.
 * "dir/model.safetensors: tensor \"...gate.weight\"") and reporting element indices plus
 * (row_off, col_off): where `t` sits in the file's tensor. origin NULL: as set_weight.
 * `input_scale`: the matrix's static activation scale (a checkpoint's input_scale), 0 for none;
 * checked like the FP8 scales (finite, > 0) and kept only by FP8 layers with per-tensor scales,
 * whose W8A8 arithmetic uses it. */
moe_status_t moe_layer_set_weight_from(moe_layer_t *layer, moe_weight_kind_t kind, int expert,
                                       const moe_tensor_t *t, float input_scale, const char *origin,
                                       int64_t row_off, int64_t col_off);

/* The layer's logical experts E, and the logical expert that this rank's expert slot `slot`
 * (0..num_local_experts - 1) holds (-1 out of range): what a loader reads for each slot. */
int moe_layer_num_experts(const moe_layer_t *layer);
int moe_layer_slot_expert(const moe_layer_t *layer, int slot);

/* Of this rank's expert slots' matrices (gate, up, down): 0 when none is set, 1 when all are,
 * 2 when some are. */
int moe_layer_expert_weights_state(const moe_layer_t *layer);

/* Marks every expert slot's matrices of this rank set (1) or not (0), after a placement
 * change moved them. */
void moe_layer_mark_expert_weights(moe_layer_t *layer, int set);

#ifdef __cplusplus
}
#endif

#endif /* MOE_WEIGHTS_H */
