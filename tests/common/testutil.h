/* SPDX-License-Identifier: Apache-2.0 */
/* Shared test helpers: cmocka includes, random data, errors, layers with random weights and a
 * naive per-token reference of the whole layer. */
#ifndef MOE_TESTUTIL_H
#define MOE_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "moe/moe.h"

/* Fails the test with the status name and moe_last_error() unless `call` succeeds. */
#define TU_OK(call)                                                                                \
    do {                                                                                           \
        moe_status_t tu_s_ = (call);                                                               \
        if (tu_s_ != MOE_STATUS_SUCCESS)                                                           \
            fail_msg("%s -> %s: %s", #call, moe_status_string(tu_s_), moe_last_error());           \
    } while (0)

/* ||a - ref|| / ||ref|| (NaN anywhere -> INFINITY). */
double tu_rel_err(const float *a, const float *ref, int64_t n);
/* Number of NaN entries. */
int64_t tu_count_nan(const float *a, int64_t n);
/* Uniform in [lo, hi) from a xorshift state. */
void tu_fill_uniform(float *v, int64_t n, float lo, float hi, uint64_t *state);
/* A fresh seed per run unless MOE_TEST_SEED is set; printed so a failure can be replayed. */
uint64_t tu_seed(const char *test);

/* Uneven split of Tg global tokens over `world` ranks (rank r weighs r + 1; rank 1 gets none
 * when there are several): this rank's first token *t0 and count *n. */
void tu_uneven_share(int64_t Tg, int rank, int world, int64_t *t0, int64_t *n);

/* A runtime on MPI_COMM_WORLD with the CPU backend (MPI initialised if needed). */
moe_runtime_t *tu_runtime_cpu(void);

/* cmocka group setup/teardown that create and destroy tu_rt (tu_runtime_cpu). */
extern moe_runtime_t *tu_rt;
int tu_group_setup_cpu(void **state);
int tu_group_teardown(void **state);

/* The value each weight element of a layer made by moe_gen_set_weights(seed) has after the
 * layer stored it in cfg->weight_dtype (bf16 rounding; FP8 per-block quantisation). */
typedef struct tu_weights {
    int E, H, I, S;
    float *router, *bias, *sgate; /* [E,H], [E], [H] */
    float *gate, *up, *down;      /* [E,I,H], [E,I,H], [E,H,I] */
    float *sg, *su, *sd;          /* shared [S,H], [S,H], [H,S] */
} tu_weights_t;

void tu_weights_make(const moe_layer_config_t *cfg, uint64_t seed, tu_weights_t *w);
void tu_weights_free(tu_weights_t *w);

/* Naive per-token formula in double: y = sum_k w_k W2_e (act(W1_e x) * W3_e x) + shared(x),
 * with the routing of the CPU reference (ids/weights given). */
void tu_naive_layer(const moe_layer_config_t *cfg, const tu_weights_t *w, const float *x, int64_t T,
                    const int32_t *ids, const float *topk_w, float *y);

#endif /* MOE_TESTUTIL_H */
