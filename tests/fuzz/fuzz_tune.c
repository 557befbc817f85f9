/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: tune files (MOE_TUNE_FILE) through the oracle's reader; an accepted file
 * writes back to text that reads back to the same tables, every pick names a variant that
 * runs the query's dtype on its arch, and a decode crossover is only for what the fused kernel
 * runs. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/expert_gemm_table.h"
#include "runtime/oracle.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Nearly every input is ignored with a warning: keep them off stderr (MOE_DEBUG=WARN shows). */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("MOE_DEBUG", "NONE", 0);
    return 0;
}

static void check_picks(const moe_oracle_t *o)
{
    static const double rows[] = {0, 1, 2.5, 16, 33, 96, 1e4, 1e12};
    static const moe_dtype_t dt[3] = {MOE_DTYPE_BF16, MOE_DTYPE_FP8_E4M3, MOE_DTYPE_FP8_E4M3};
    static const moe_scale_kind_t sc[3] = {MOE_SCALE_NONE, MOE_SCALE_PER_CHANNEL,
                                           MOE_SCALE_BLOCK_128};
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 3; l++)
            for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                const moe_oracle_query_t q = {90,    dt[k],   sc[k], l ? 8 : 1, 1,
                                              l - 1, rows[i], 0,     0.0,       0};
                moe_oracle_choice_t c;
                const moe_gemm_variant_t *v;
                if (!moe_oracle_pick_gemm(o, &q, &c))
                    abort(); /* sm_90 has a built-in table for each */
                v = moe_gemm_variant_by_name(c.name);
                if (!v || v->ab_dtype != dt[k] || v->scale_kind != sc[k] ||
                    !moe_gemm_variant_runs_on(v, 90) || !(rows[i] <= c.hi) ||
                    !(rows[i] > c.lo || c.lo == 0))
                    abort();
                if (moe_oracle_pick_transport(o, &q, &c) &&
                    moe_oracle_transport_by_name(c.name) < 0)
                    abort();
                /* a decode crossover only for what the fused kernel runs, named as such */
                {
                    const int d = moe_oracle_decode_tokens(o, &q, &c);
                    if (d < 0 || (d > 0 && (sc[k] == MOE_SCALE_BLOCK_128 ||
                                            strcmp(c.name, MOE_ORACLE_FUSED_DECODE))))
                        abort();
                }
            }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const moe_oracle_target_t target = {"NVIDIA H200", 90, {4096, 14336, 8, 2}};
    moe_oracle_table_t t, back;
    moe_oracle_t o;
    char *text, *again;
    size_t n;

    moe_oracle_init(&o);
    if (moe_oracle_load_text(&o, (const char *)data, size, "fuzz", &target) == 0 &&
        (o.tuned.num_groups != 0 || o.warning[0] == '\0'))
        abort(); /* ignored: defaults and a warning */
    check_picks(&o);
    moe_oracle_free(&o);

    if (moe_oracle_parse((const char *)data, size, "fuzz", &t) != MOE_STATUS_SUCCESS)
        return 0;
    n = moe_oracle_format(&t, NULL, 0);
    text = malloc(n + 1);
    if (!text || moe_oracle_format(&t, text, n + 1) != n)
        abort();
    if (moe_oracle_parse(text, n, "fuzz again", &back) != MOE_STATUS_SUCCESS)
        abort(); /* what the writer writes, the reader reads */
    again = malloc(n + 1);
    if (!again || moe_oracle_format(&back, again, n + 1) != n || memcmp(text, again, n))
        abort(); /* and the same tables come back */
    free(again);
    free(text);
    moe_oracle_table_free(&back);
    moe_oracle_table_free(&t);
    return 0;
}
