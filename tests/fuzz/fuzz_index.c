/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: model.safetensors.index.json text. Every weight_map entry of an accepted
 * index must be found by the reader's lookup (sorted names, sorted shard ids) and map to its own
 * shard, checked against a plain scan of the same JSON; the family's tensor names (first byte
 * picks the family) are looked up the same way. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_checkpoint.h"
#include "runtime/formats/checkpoint.h"
#include "base/json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const configs[4] = {
    "{\"model_type\": \"mixtral\"}",
    "{\"model_type\": \"qwen2_moe\"}",
    "{\"model_type\": \"qwen3_moe\"}",
    "{\"model_type\": \"deepseek_v3\"}",
};

/* The shard of `name` by a linear scan of the weight_map, or NULL. */
static const char *scan(const moe_json_t *wm, const char *name)
{
    for (const moe_json_t *m = wm->child; m; m = m->next)
        if (!strcmp(m->key, name))
            return m->string;
    return NULL;
}

static void same(const char *a, const char *b)
{
    if ((a == NULL) != (b == NULL) || (a && strcmp(a, b) != 0))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    moe_checkpoint_t *c = NULL;
    moe_json_doc_t *doc = NULL;
    const moe_json_t *wm;
    const char *cfg;
    char name[256];

    if (size < 1)
        return 0;
    cfg = configs[data[0] & 3];
    if (moe_checkpoint_from_memory(cfg, strlen(cfg), (const char *)data + 1, size - 1, &c) !=
        MOE_STATUS_SUCCESS)
        return 0;
    /* Accepted: the same text parses, and its weight_map is an object of strings. */
    if (moe_json_parse((const char *)data + 1, size - 1, 0, "fuzz", &doc) != MOE_STATUS_SUCCESS)
        abort();
    wm = moe_json_get(moe_json_root(doc), "weight_map");
    if (!wm || wm->type != MOE_JSON_OBJECT)
        abort();
    for (const moe_json_t *m = wm->child; m; m = m->next)
        same(moe_checkpoint_tensor_file(c, m->key), m->string);
    for (int layer = 0; layer < 3; layer++)
        for (int k = 0; k < MOE_WEIGHT_KIND_COUNT; k++)
            for (int e = 0; e < 3; e++)
                if (moe_checkpoint_tensor_name(c, layer, (moe_weight_kind_t)k, e, name,
                                               sizeof(name)) == MOE_STATUS_SUCCESS)
                    same(moe_checkpoint_tensor_file(c, name), scan(wm, name));
    same(moe_checkpoint_tensor_file(c, ""), scan(wm, ""));
    moe_json_free(doc);
    moe_checkpoint_close(c);
    return 0;
}
