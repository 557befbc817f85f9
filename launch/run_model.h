/* SPDX-License-Identifier: Apache-2.0 */
/* moe-run --model DIR --layer N [--input FILE] [--output FILE]: a checkpoint's layer, its
 * tokens from a safetensors file, its output gathered to rank 0. Public API + MPI only. */
#ifndef MOE_RUN_MODEL_H
#define MOE_RUN_MODEL_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills the model fields of *cfg for decoder layer `layer_index` of the checkpoint at `model`
 * (deployment fields are left as they are). Not collective. */
moe_status_t moe_run_model_config(const char *model, int layer_index, moe_layer_config_t *cfg);

/* Loads this rank's shard of the layer. Collective over MPI_COMM_WORLD: every rank calls it,
 * and if any rank fails every rank returns an error (MOE_STATUS_PEER_FAILURE on the others),
 * so that no rank goes on into a forward that the failed one never joins. */
moe_status_t moe_run_model_load(moe_layer_t *layer, const char *model, int layer_index);

/* This rank's tokens [t0, t0 + n) of the global batch into x [n, hidden] (f32): from tensor
 * "hidden_states" [tokens, hidden] (F64/F32/BF16/F16) of the safetensors file `input`, whose
 * token count must equal the global batch (the sum of n over the ranks), or random from
 * `seed` (the same tokens as a preset run) when input is NULL. Collective (checks the count). */
moe_status_t moe_run_model_tokens(const char *input, uint64_t seed, int64_t t0, int64_t n,
                                  int hidden, float *x);

/* Gathers every rank's y [n, hidden] in rank (= token) order to rank 0, which writes `output`
 * as a safetensors file with tensor "hidden_states" F32 [tokens, hidden]. Collective. */
moe_status_t moe_run_model_write_output(const char *output, const float *y, int64_t n, int hidden);

#ifdef __cplusplus
}
#endif

#endif /* MOE_RUN_MODEL_H */
