/* SPDX-License-Identifier: Apache-2.0 */
/* Link stubs for the checkpoint fuzz targets: checkpoint.c refers to the layer object, which the
 * targets never create (they stop before moe_layer_load). Reaching a stub is a finding. */
#include <stdlib.h>

#include "moe/moe.h"

moe_status_t moe_layer_get_info(const moe_layer_t *layer, moe_layer_info_t *info)
{
    (void)layer;
    (void)info;
    abort();
}
