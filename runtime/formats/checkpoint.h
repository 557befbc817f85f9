/* SPDX-License-Identifier: Apache-2.0 */
/* In-memory entry points to the checkpoint reader (config.json, the index, the tensor-name
 * maps) for the fuzz targets and tests. Internal. */
#ifndef MOE_CHECKPOINT_INTERNAL_H
#define MOE_CHECKPOINT_INTERNAL_H

#include <stddef.h>
#include "moe/moe_checkpoint.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A checkpoint from config.json text and index text (either may be NULL, lengths in bytes,
 * no NUL needed), parsed and validated as moe_checkpoint_open would; no file is opened, so
 * moe_layer_load on it fails. Close with moe_checkpoint_close. */
moe_status_t moe_checkpoint_from_memory(const char *config, size_t config_len, const char *index,
                                        size_t index_len, moe_checkpoint_t **ckpt);

/* The shard file the index maps tensor `name` to, or NULL. */
const char *moe_checkpoint_tensor_file(const moe_checkpoint_t *ckpt, const char *name);

/* The full name of the tensor of `kind` (and `expert`) of decoder layer `layer_index` under
 * the checkpoint family's naming (docs/SEMANTICS.md). INVALID_ARGUMENT for an unknown family, a
 * kind the family does not have, or `n` too small. */
moe_status_t moe_checkpoint_tensor_name(const moe_checkpoint_t *ckpt, int layer_index,
                                        moe_weight_kind_t kind, int expert, char *out, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CHECKPOINT_INTERNAL_H */
