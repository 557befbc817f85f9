/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: a whole safetensors file image from memory, and its header as JSON. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "runtime/formats/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Invariants every accepted header must keep; a violation aborts (a finding). */
static void check_header(const moe_st_header_t *h)
{
    uint64_t total = 0;

    for (size_t i = 0; i < h->num_tensors; i++) {
        const moe_st_tensor_t *t = &h->tensors[i];
        uint64_t elems = 1;
        for (int d = 0; d < t->ndim; d++)
            elems *= (uint64_t)t->shape[d];
        if (t->end < t->begin || t->end > h->data_bytes ||
            t->end - t->begin != elems * moe_st_dtype_size(t->dtype) ||
            (uint64_t)t->rows * (uint64_t)t->cols != elems)
            abort();
        if (moe_st_header_find(h, t->name) != t)
            abort();
        total += t->end - t->begin;
    }
    if (total != h->data_bytes)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    moe_st_header_t *h = NULL;
    moe_json_doc_t *doc = NULL;

    if (moe_st_parse_buffer(data, size, "fuzz", &h) == MOE_STATUS_SUCCESS) {
        check_header(h);
        (void)moe_st_header_metadata(h, "format");
        moe_st_header_free(h);
    }
    /* The JSON parser on its own, on everything after the length field. */
    if (size > 8 && moe_json_parse((const char *)data + 8, size - 8, 1 << 16, "fuzz", &doc) ==
                        MOE_STATUS_SUCCESS)
        moe_json_free(doc);
    return 0;
}
