/* SPDX-License-Identifier: Apache-2.0 */
/* Loading MoE layers from published safetensors checkpoints, and reading/writing single
 * tensors in safetensors files. Plain C11; see docs/CHECKPOINTS.md. */
#ifndef MOE_MOE_CHECKPOINT_H
#define MOE_MOE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints                                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct moe_checkpoint moe_checkpoint_t;

/* Model families whose config.json and tensor names libmoe knows (docs/SEMANTICS.md). */
typedef enum moe_model_family {
    MOE_FAMILY_UNKNOWN = 0,    /* no config.json, or a model_type libmoe does not map */
    MOE_FAMILY_MIXTRAL = 1,    /* model_type "mixtral" */
    MOE_FAMILY_QWEN2_MOE = 2,  /* model_type "qwen2_moe" (Qwen1.5-MoE, Qwen2-MoE) */
    MOE_FAMILY_QWEN3_MOE = 3,  /* model_type "qwen3_moe" */
    MOE_FAMILY_DEEPSEEK_V3 = 4 /* model_type "deepseek_v3" (DeepSeek-V3, R1) */
} moe_model_family_t;

typedef struct moe_checkpoint_info {
    moe_model_family_t family;
    char model_type[32]; /* as written in config.json ("" without one) */
    int num_layers;      /* num_hidden_layers (0 without config.json) */
    int num_files;       /* safetensors files of the checkpoint */
    int64_t num_tensors; /* tensors over all files */
} moe_checkpoint_info_t;

/* Opens a checkpoint: a folder with config.json and either model.safetensors.index.json (a
 * sharded checkpoint: its weight_map names the file of each tensor; only those files are read)
 * or else model.safetensors, as transformers reads a folder (other files there, such as
 * consolidated.safetensors or an input file, are ignored); or one .safetensors file
 * (config.json is then looked for beside it). Every file must be a regular file: a FIFO,
 * device, socket or directory is an IO_ERROR naming it, never a hang. Reads config.json, the index
 * and the headers it needs (sharded files are opened when a tensor of theirs is first read); no
 * tensor data is read here. Not collective: each rank opens the checkpoint itself. Errors: IO_ERROR
 * (missing/unreadable), FORMAT_ERROR (a malformed config.json, index or header; the message names
 * the file and the problem). */
moe_status_t moe_checkpoint_open(const char *path, moe_checkpoint_t **ckpt);

/* Closes the files. NULL is fine. */
moe_status_t moe_checkpoint_close(moe_checkpoint_t *ckpt);

moe_status_t moe_checkpoint_get_info(const moe_checkpoint_t *ckpt, moe_checkpoint_info_t *info);

/* Fills the model fields of `config` for decoder layer `layer_index` from config.json:
 * num_experts, top_k, hidden, intermediate, shared experts (and the shared-expert gate of
 * qwen2_moe), activation, scoring, use_score_bias, n_group/topk_group, renormalize,
 * routed_scaling_factor, weight_dtype and scale_kind (FP8 e4m3 with 128x128 block scales from
 * quantization_config). The deployment fields (max_tokens_per_rank, ep_size, tp_size,
 * dispatch, deterministic, check_inputs) are left as the caller set them: start from
 * MOE_LAYER_CONFIG_INIT. Errors: INVALID_ARGUMENT when the layer index is out of range or the
 * layer is dense (the message names the config key that makes it dense, e.g.
 * first_k_dense_replace); NOT_SUPPORTED for an unknown model_type, activation or
 * quantization; FORMAT_ERROR for a missing or mistyped config.json value. */
moe_status_t moe_checkpoint_layer_config(const moe_checkpoint_t *ckpt, int layer_index,
                                         moe_layer_config_t *config);

/* 1 in *is_moe when decoder layer `layer_index` is an MoE layer, 0 when it is dense. */
moe_status_t moe_checkpoint_layer_is_moe(const moe_checkpoint_t *ckpt, int layer_index,
                                         int *is_moe);

/* Sets every weight of `layer` that this rank keeps from decoder layer `layer_index` of the
 * checkpoint: the router (and e_score_correction_bias), the expert matrices of this rank's
 * experts sliced to its part of the intermediate dimension, its slice of the shared
 * expert(s) and the shared-expert gate. Reads only those bytes (pread of the row ranges and
 * row segments), never whole files. The layer must have been created with the model fields
 * that moe_checkpoint_layer_config gives for this layer (else a shape error names the
 * tensor). FP8 tensors go to the layer with their weight_scale_inv block scales (or
 * dequantised, where a TP slice does not fall on 128-row blocks and the layer is not
 * block-scaled). Not collective: every rank loads its own shard; a failure is reported on the
 * rank where it happened. Errors: IO_ERROR, FORMAT_ERROR (missing tensor, wrong shape or
 * dtype, missing scales), and those of moe_layer_set_weight. */
moe_status_t moe_layer_load(moe_layer_t *layer, moe_checkpoint_t *ckpt, int layer_index);

/* ------------------------------------------------------------------------------------------ */
/* Single tensors in safetensors files (moe-run --input / --output, tests)                     */
/* ------------------------------------------------------------------------------------------ */

/* Shape of tensor `name` in the safetensors file `path`, viewed as a matrix: rows = first
 * dimension, cols = product of the others (1-D: [n, 1]). *dtype is its libmoe dtype, or
 * MOE_DTYPE_INVALID for a dtype libmoe cannot convert (F64 converts: reported as F32).
 * Any output pointer may be NULL. */
moe_status_t moe_safetensors_tensor_info(const char *path, const char *name, moe_dtype_t *dtype,
                                         int64_t *rows, int64_t *cols);

/* Reads rows [row_begin, row_end) of tensor `name` (any float dtype: F64, F32, BF16, F16) into
 * `dst` as `dtype` (F32 or BF16), (row_end - row_begin) x cols elements. Reads only those
 * rows. */
moe_status_t moe_safetensors_read_rows(const char *path, const char *name, int64_t row_begin,
                                       int64_t row_end, moe_dtype_t dtype, void *dst);

/* Writes `count` tensors, each as a 2-D [rows, cols] tensor named names[i], into a new
 * safetensors file at `path` (replaced atomically). An FP8 tensor with scales also gets
 * "<name>_scale_inv" (F32 [scale_rows, scale_cols]). */
moe_status_t moe_safetensors_write(const char *path, int count, const char *const *names,
                                   const moe_tensor_t *tensors);

#ifdef __cplusplus
}
#endif

#endif /* MOE_MOE_CHECKPOINT_H */
