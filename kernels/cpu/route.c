/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference routing: softmax or sigmoid scores, optional bias and grouped top-k. */
#include "kernels/cpu/moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include "base/diag.h"

/* Index of the largest allowed score; ties go to the lower index. -1 if none allowed. */
static int argmax_allowed(const float *v, const unsigned char *allowed, int n)
{
    int best = -1, i;
    for (i = 0; i < n; i++) {
        if (!allowed[i])
            continue;
        if (best < 0 || v[i] > v[best])
            best = i;
    }
    return best;
}

static moe_status_t check_params(const moe_route_params_t *p)
{
    MOE_ARG_CHECK(p->num_experts > 0 && p->num_experts <= 65536,
                  "num_experts = %d: must be in 1..65536", p->num_experts);
    MOE_ARG_CHECK(p->top_k > 0 && p->top_k <= p->num_experts,
                  "top_k = %d: must be in 1..num_experts (%d)", p->top_k, p->num_experts);
    if (p->n_group > 1) {
        MOE_ARG_CHECK(p->num_experts % p->n_group == 0,
                      "n_group = %d does not divide num_experts = %d", p->n_group, p->num_experts);
        MOE_ARG_CHECK(p->topk_group >= 1 && p->topk_group <= p->n_group,
                      "topk_group = %d: must be in 1..n_group (%d)", p->topk_group, p->n_group);
        MOE_ARG_CHECK(p->top_k <= p->topk_group * (p->num_experts / p->n_group),
                      "top_k = %d exceeds the experts of topk_group = %d groups", p->top_k,
                      p->topk_group);
    }
    return MOE_STATUS_SUCCESS;
}

/* Keeps the topk_group groups with the largest sum of their two best choice scores. */
static void mask_groups(const moe_route_params_t *p, const float *choice, unsigned char *allowed,
                        float *gscore, unsigned char *gallowed)
{
    const int gsize = p->num_experts / p->n_group;
    int g, i, j;

    for (g = 0; g < p->n_group; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (i = g * gsize; i < (g + 1) * gsize; i++) {
            if (choice[i] > b1) {
                b2 = b1;
                b1 = choice[i];
            } else if (choice[i] > b2) {
                b2 = choice[i];
            }
        }
        gscore[g] = gsize >= 2 ? b1 + b2 : b1;
        gallowed[g] = 1;
    }
    /* Choose groups by clearing their gallowed mark: afterwards kept = !gallowed. */
    for (j = 0; j < p->topk_group; j++)
        gallowed[argmax_allowed(gscore, gallowed, p->n_group)] = 0;
    for (i = 0; i < p->num_experts; i++)
        allowed[i] = !gallowed[i / gsize];
}

moe_status_t moe_cpu_route(const moe_route_params_t *p, const float *logits, const float *bias,
                           int64_t num_tokens, int32_t *topk_ids, float *topk_weights)
{
    const int E = p->num_experts, K = p->top_k;
    float *score = NULL, *choice = NULL, *gscore = NULL;
    unsigned char *allowed = NULL, *gallowed = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;
    int64_t t;

    MOE_CHECK(check_params(p));
    score = malloc(sizeof(float) * (size_t)E);
    choice = malloc(sizeof(float) * (size_t)E);
    allowed = malloc((size_t)E);
    gscore = malloc(sizeof(float) * (size_t)(p->n_group > 1 ? p->n_group : 1));
    gallowed = malloc((size_t)(p->n_group > 1 ? p->n_group : 1));
    if (!score || !choice || !allowed || !gscore || !gallowed) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "cpu route: %d experts", E);
        goto out_free;
    }
    for (t = 0; t < num_tokens; t++) {
        const float *l = logits + t * E;
        int32_t *ids = topk_ids + t * K;
        float *w = topk_weights + t * K;
        float sum = 0.0f;
        int e, j;

        if (p->scoring == MOE_SCORING_SOFTMAX) {
            float mx = -INFINITY;
            for (e = 0; e < E; e++)
                mx = l[e] > mx ? l[e] : mx;
            for (e = 0; e < E; e++) {
                score[e] = expf(l[e] - mx);
                sum += score[e];
            }
            for (e = 0; e < E; e++)
                score[e] /= sum;
        } else {
            for (e = 0; e < E; e++)
                score[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        for (e = 0; e < E; e++) {
            choice[e] = score[e];
            if (p->scoring == MOE_SCORING_SIGMOID && p->use_bias && bias)
                choice[e] += bias[e];
        }
        if (p->n_group > 1)
            mask_groups(p, choice, allowed, gscore, gallowed);
        else
            for (e = 0; e < E; e++)
                allowed[e] = 1;
        sum = 0.0f;
        for (j = 0; j < K; j++) {
            int best = argmax_allowed(choice, allowed, E);
            allowed[best] = 0;
            ids[j] = best;
            w[j] = score[best];
            sum += w[j];
        }
        if (p->renormalize) {
            /* DeepSeek adds 1e-20 to the sum of sigmoid scores; softmax families do not. */
            float denom = p->scoring == MOE_SCORING_SIGMOID ? sum + 1e-20f : sum;
            for (j = 0; j < K; j++)
                w[j] /= denom;
        }
        if (p->scaling != 0.0f && p->scaling != 1.0f)
            for (j = 0; j < K; j++)
                w[j] *= p->scaling;
    }
out_free:
    free(score);
    free(choice);
    free(allowed);
    free(gscore);
    free(gallowed);
    return st;
}
