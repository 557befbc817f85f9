/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: config.json text through the checkpoint reader (family, layer configs,
 * dense/MoE rule) and the tensor-name maps of every layer it accepts. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/moe_checkpoint.h"
#include "runtime/formats/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Every tensor name of an accepted layer starts with its layer's prefix and fits. */
static void check_names(const moe_checkpoint_t *c, int layer, const moe_layer_config_t *cfg)
{
    const int experts[2] = {0, cfg->num_experts - 1};
    char name[256], want[32];

    snprintf(want, sizeof(want), "model.layers.%d.", layer);
    for (int k = 0; k < MOE_WEIGHT_KIND_COUNT; k++)
        for (int i = 0; i < 2; i++) {
            if (moe_checkpoint_tensor_name(c, layer, (moe_weight_kind_t)k, experts[i], name,
                                           sizeof(name)) != MOE_STATUS_SUCCESS)
                continue;
            if (strncmp(name, want, strlen(want)) != 0 || strlen(name) >= sizeof(name))
                abort();
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    moe_checkpoint_t *c = NULL;
    moe_checkpoint_info_t info;
    const int layers[6] = {0, 1, 2, 3, 61, -1};

    if (moe_checkpoint_from_memory((const char *)data, size, NULL, 0, &c) != MOE_STATUS_SUCCESS)
        return 0;
    if (moe_checkpoint_get_info(c, &info) != MOE_STATUS_SUCCESS)
        abort();
    for (int i = 0; i < 6; i++) {
        moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
        int is_moe = -1, layer = i == 5 ? info.num_layers - 1 : layers[i];
        moe_status_t st = moe_checkpoint_layer_is_moe(c, layer, &is_moe);
        if (st == MOE_STATUS_SUCCESS && is_moe != 0 && is_moe != 1)
            abort();
        if (moe_checkpoint_layer_config(c, layer, &cfg) != MOE_STATUS_SUCCESS)
            continue;
        /* What the reader promises about a config it accepts. */
        if (st != MOE_STATUS_SUCCESS || !is_moe || cfg.num_experts < 1 || cfg.top_k < 1 ||
            cfg.top_k > cfg.num_experts || cfg.hidden < 1 || cfg.intermediate < 1 ||
            cfg.num_shared_experts < 0 || cfg.shared_intermediate < 0 ||
            !(cfg.routed_scaling_factor >= 0) ||
            (cfg.n_group > 1 && (cfg.topk_group < 1 || cfg.topk_group > cfg.n_group)))
            abort();
        check_names(c, layer, &cfg);
    }
    moe_checkpoint_close(c);
    return 0;
}
