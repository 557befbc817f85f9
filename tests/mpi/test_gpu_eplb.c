/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-GPU (one rank per GPU, or ranks sharing one with MOE_TEST_SHARED_GPU=1): expert
 * placement on the CUDA backend (docs/EPLB.md). With redundant slots, after a placement change
 * and after a rebalance from the device's load window, on one GPU and over every EP transport:
 * the CUDA layer (outputs poisoned first) against the CPU backend's plain layer on this rank's
 * tokens; the rows each rank computed equal the CPU backend's EP layer's with the same
 * placement (the same replica choice, docs/SEMANTICS.md "Replicas"), also in rounds; the load
 * window equals the CPU backend's; deterministic mode bitwise equal to the layer without
 * redundant slots. Skips without a GPU. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

#define E 16
#define MAX_SLOTS (E + 8 * 8)

static int rank, world;
static moe_runtime_t *cpu_world; /* the CPU backend over the world: its EP layer's rows */

static moe_layer_config_t shape(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = E;
    c.top_k = 4;
    c.hidden = 1024;
    c.intermediate = 512;
    c.max_tokens_per_rank = 128;
    return c;
}

enum { PL_DEFAULT, PL_MAP, PL_REBALANCE };
static const char *const mode_name[] = {"default placement", "set_placement", "rebalance"};

typedef struct run_out {
    int64_t window[E];      /* the load window after the first forward */
    int64_t rows;           /* rows_received of the last forward (CUDA: MOE_PROFILE=1) */
    int32_t map[MAX_SLOTS]; /* the placement in force at the end */
    int64_t bytes_moved;    /* bytes received by the placement change (set_placement) */
    int rebalance_moved;    /* the rebalance changed the map */
} run_out_t;

/* y = the layer (weights from seed) on this rank's n tokens x with router logits lg, on runtime
 * rt: created with c, then (mode) its placement set to map, or one forward and a rebalance from
 * its load window before the forward whose output y is. CUDA: device buffers, y poisoned with
 * NaN before each forward. */
static void run_placed(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed, const float *x,
                       int64_t n, const float *lg, int mode, const int32_t *map, float *y,
                       run_out_t *o)
{
    const int slots = c.num_experts + c.num_redundant_experts;
    const size_t xb = sizeof(float) * (size_t)(n * c.hidden + 1);
    const size_t lb = sizeof(float) * (size_t)(n * c.num_experts + 1);
    moe_runtime_info_t ri;
    moe_layer_t *l = NULL;
    moe_layer_stats_t st;
    moe_placement_stats_t ps;
    void *dx = NULL, *dy = NULL, *dl = NULL;
    int32_t before[MAX_SLOTS];
    int64_t win[E], sum = 0;
    int step, i, e, changed = 0;

    assert_true(slots <= MAX_SLOTS);
    memset(o, 0, sizeof(*o));
    TU_OK(moe_runtime_get_info(rt, &ri));
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    if (mode == PL_MAP) {
        TU_OK(moe_layer_set_placement(l, map, slots));
        TU_OK(moe_layer_get_placement_stats(l, &ps));
        o->bytes_moved = ps.bytes_received;
    }
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaMalloc(&dx, xb), cudaSuccess);
        assert_int_equal(cudaMalloc(&dy, xb), cudaSuccess);
        assert_int_equal(cudaMalloc(&dl, lb), cudaSuccess);
        assert_int_equal(cudaMemcpy(dx, x, xb - sizeof(float), cudaMemcpyHostToDevice), 0);
        assert_int_equal(cudaMemcpy(dl, lg, lb - sizeof(float), cudaMemcpyHostToDevice), 0);
    }
    for (step = 0; step < (mode == PL_REBALANCE ? 2 : 1); step++) {
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        a.num_tokens = n;
        if (ri.backend == MOE_BACKEND_CUDA) {
            assert_int_equal(cudaMemset(dy, 0xff, xb), cudaSuccess); /* NaN poison */
            a.x = dx;
            a.y = dy;
            a.router_logits = dl;
        } else {
            for (i = 0; i < n * c.hidden; i++)
                y[i] = NAN;
            a.x = x;
            a.y = y;
            a.router_logits = lg;
        }
        TU_OK(moe_layer_forward(l, &a));
        TU_OK(moe_layer_synchronize(l, NULL));
        if (step > 0)
            continue;
        TU_OK(moe_layer_get_expert_load_window(l, o->window, E));
        for (e = 0; e < E; e++)
            sum += o->window[e];
        assert_int_equal(sum, n * c.top_k); /* every (token, k) pair of this rank's tokens */
        if (mode != PL_REBALANCE)
            continue;
        TU_OK(moe_layer_get_placement(l, before, slots));
        TU_OK(moe_layer_rebalance(l));
        TU_OK(moe_layer_get_expert_load_window(l, win, E)); /* a new window */
        for (e = 0; e < E; e++)
            assert_int_equal(win[e], 0);
        TU_OK(moe_layer_get_placement(l, o->map, slots));
        for (i = 0; i < slots; i++)
            changed |= o->map[i] != before[i];
        o->rebalance_moved = changed;
    }
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
        assert_int_equal(cudaMemcpy(y, dy, xb - sizeof(float), cudaMemcpyDeviceToHost), 0);
        cudaFree(dx);
        cudaFree(dy);
        cudaFree(dl);
    }
    TU_OK(moe_layer_get_stats(l, &st));
    o->rows = st.rows_received;
    TU_OK(moe_layer_get_placement(l, o->map, slots));
    TU_OK(moe_layer_destroy(l));
}

/* A placement other than the default: the planner's for a load falling as 1 / (e + 1). */
static void planned_map(int ranks, int R, int32_t *map)
{
    int64_t load[E];
    int e;
    for (e = 0; e < E; e++)
        load[e] = 100000 / (e + 1);
    TU_OK(moe_eplb_plan(load, E, 1, ranks, 0, R, map, E + R));
}

/* Without redundant slots: every rank's block shifted by 5 experts. */
static void shifted_map(int32_t *map)
{
    int i;
    for (i = 0; i < E; i++)
        map[i] = (i + 5) % E;
}

typedef struct data {
    int64_t n;
    float *x, *lg, *ref, *y, *cpu_y; /* cpu_y: the CPU EP layer's (not compared) */
    int64_t ref_window[E];
} data_t;

static void data_make(data_t *d, uint64_t seed, int64_t n)
{
    moe_layer_config_t c = shape();
    run_out_t o;
    d->n = n;
    d->x = malloc(sizeof(float) * (size_t)(n * c.hidden));
    d->y = malloc(sizeof(float) * (size_t)(n * c.hidden));
    d->ref = malloc(sizeof(float) * (size_t)(n * c.hidden));
    d->cpu_y = malloc(sizeof(float) * (size_t)(n * c.hidden));
    d->lg = malloc(sizeof(float) * (size_t)(n * E));
    assert_true(d->x && d->y && d->ref && d->cpu_y && d->lg);
    moe_gen_tokens(seed, n * rank, n, c.hidden, d->x);
    moe_gen_skewed_logits(seed, n * rank, n, E, 1.2, d->lg);
    /* the reference: the CPU backend's plain layer on this rank alone */
    run_placed(gt_rts.cpu_self, c, seed, d->x, n, d->lg, PL_DEFAULT, NULL, d->ref, &o);
    memcpy(d->ref_window, o.window, sizeof(o.window));
}

static void data_free(data_t *d)
{
    free(d->x);
    free(d->y);
    free(d->ref);
    free(d->cpu_y);
    free(d->lg);
}

static void check_vs_ref(const data_t *d, const run_out_t *o, const char *what)
{
    const int64_t H = shape().hidden;
    double err;
    assert_int_equal(tu_count_nan(d->y, d->n * H), 0);
    err = tu_rel_err(d->y, d->ref, d->n * H);
    print_message("rank %d: %s: rel err %.3g, %lld rows computed\n", rank, what, err,
                  (long long)o->rows);
    assert_true(err <= 1e-2);
    assert_memory_equal(o->window, d->ref_window, sizeof(o->window));
}

/* One GPU (ep_size 1) with two redundant slots: default, a planned map, a rebalance. */
static void test_one_gpu_replicas(void **state)
{
    const uint64_t seed = tu_seed("gpu_eplb_one");
    moe_layer_config_t c = shape();
    int32_t map[MAX_SLOTS];
    data_t d;
    run_out_t o;
    int mode;
    char what[128];
    (void)state;
    data_make(&d, seed, 96);
    c.num_redundant_experts = 2;
    planned_map(1, 2, map);
    for (mode = PL_DEFAULT; mode <= PL_REBALANCE; mode++) {
        run_placed(gt_rts.gpu_self, c, seed, d.x, d.n, d.lg, mode, map, d.y, &o);
        snprintf(what, sizeof(what), "one GPU, R 2, %s", mode_name[mode]);
        check_vs_ref(&d, &o, what);
    }
    data_free(&d);
}

static const char *const transports[] = {"allgather", "lsa", "p2p", "lsa-ll"};
enum { LSA_LL = 3 };

static int transport_runs(int i)
{
    return gt_nccl_runs() || !strncmp(transports[i], "lsa", 3);
}

static void use_transport(int i)
{
    setenv("MOE_EP_TRANSPORT", i == LSA_LL ? "lsa" : transports[i], 1);
    setenv("MOE_EP_LL", i == LSA_LL ? "1" : "0", 1);
}

static void end_transports(void)
{
    unsetenv("MOE_EP_TRANSPORT");
    unsetenv("MOE_EP_LL");
}

/* One EP case: the CUDA layer of config c (transport i, MOE_PROFILE=1 for its rows) against
 * the CPU plain layer (outputs, load window) and the CPU layer of the same layout and placement
 * (the rows each rank computed: the same replica choice; the map after a rebalance). */
static void ep_case(data_t *d, moe_layer_config_t c, int i, int mode, const int32_t *map)
{
    const uint64_t seed = tu_seed("gpu_eplb_ep");
    run_out_t o, cpu;
    char what[256];
    use_transport(i);
    setenv("MOE_PROFILE", "1", 1);
    run_placed(gt_rts.gpu, c, seed, d->x, d->n, d->lg, mode, map, d->y, &o);
    unsetenv("MOE_PROFILE");
    end_transports();
    snprintf(what, sizeof(what), "%s, ep %d x tp %d, R %d, %s%s, rounds of %lld", transports[i],
             c.ep_size, c.tp_size, c.num_redundant_experts, mode_name[mode],
             mode != PL_REBALANCE ? ""
             : o.rebalance_moved  ? " (map changed)"
                                  : " (map kept)",
             (long long)(c.ep_round_tokens ? c.ep_round_tokens : c.max_tokens_per_rank));
    c.ep_round_tokens = 0;
    run_placed(cpu_world, c, seed, d->x, d->n, d->lg, mode, map, d->cpu_y, &cpu);
    check_vs_ref(d, &o, what);
    assert_memory_equal(o.map, cpu.map, sizeof(o.map));
    assert_int_equal(o.rows, cpu.rows);
    assert_int_equal(o.bytes_moved > 0, cpu.bytes_moved > 0);
    assert_int_equal(o.rebalance_moved, cpu.rebalance_moved);
}

/* EP over the world on every transport: R = 2 ep with the default placement, a planned map and
 * a rebalance, and R = 0 with shifted blocks (set_placement, rebalance); in one round and in
 * rounds of 32 tokens. */
static void test_ep_replicas_transports(void **state)
{
    int32_t planned[MAX_SLOTS], shifted[E];
    data_t d;
    size_t i;
    int mode, red, rounds;
    (void)state;
    data_make(&d, tu_seed("gpu_eplb_ep"), 96);
    planned_map(world, 2 * world, planned);
    shifted_map(shifted);
    for (i = 0; i < sizeof(transports) / sizeof(transports[0]); i++) {
        if (!transport_runs((int)i))
            continue;
        for (red = 0; red < 2; red++)
            for (mode = PL_DEFAULT; mode <= PL_REBALANCE; mode++)
                for (rounds = 0; rounds < 2; rounds++) {
                    moe_layer_config_t c = shape();
                    if (!red && mode == PL_DEFAULT)
                        continue; /* the plain EP layer: test_gpu_ep.c */
                    c.ep_size = world;
                    c.num_redundant_experts = red ? 2 * world : 0;
                    c.ep_round_tokens = rounds ? 32 : 0;
                    ep_case(&d, c, (int)i, mode, red ? planned : shifted);
                }
    }
    data_free(&d);
}

/* TP 2 (allgather): the EP groups of two ranks each, R = 2 ep. */
static void test_tp_replicas(void **state)
{
    int32_t planned[MAX_SLOTS];
    data_t d;
    int mode;
    (void)state;
    if (world % 2 || !gt_nccl_runs()) /* TP needs an even world and the allgather transport */
        return;
    data_make(&d, tu_seed("gpu_eplb_ep"), 96);
    planned_map(world / 2, world, planned);
    for (mode = PL_DEFAULT; mode <= PL_REBALANCE; mode++) {
        moe_layer_config_t c = shape();
        c.tp_size = 2;
        c.ep_size = world / 2;
        c.num_redundant_experts = world; /* 2 per EP rank */
        ep_case(&d, c, 0, mode, planned);
    }
    data_free(&d);
}

/* Deterministic mode: the EP layer with redundant slots (default placement, a planned map, a
 * rebalance) bitwise equal to the same layer without them, on every transport that takes it
 * (not p2p), and one GPU with two redundant slots bitwise equal to one GPU without. */
static void test_deterministic_bitwise(void **state)
{
    const uint64_t seed = tu_seed("gpu_eplb_det");
    moe_layer_config_t c = shape();
    const int64_t n = 40;
    const size_t bytes = sizeof(float) * (size_t)(n * c.hidden);
    float *x = malloc(bytes), *y0 = malloc(bytes), *y = malloc(bytes);
    float *lg = malloc(sizeof(float) * (size_t)(n * E));
    int32_t planned[MAX_SLOTS], planned1[E + 2];
    run_out_t o;
    int i, mode;
    (void)state;
    assert_true(x && y0 && y && lg);
    c.deterministic = 1;
    moe_gen_tokens(seed, n * rank, n, c.hidden, x);
    moe_gen_skewed_logits(seed, n * rank, n, E, 1.2, lg);
    planned_map(world, 2 * world, planned);
    planned_map(1, 2, planned1);
    c.num_redundant_experts = 0;
    run_placed(gt_rts.gpu_self, c, seed, x, n, lg, PL_DEFAULT, NULL, y0, &o);
    c.num_redundant_experts = 2;
    for (mode = PL_DEFAULT; mode <= PL_REBALANCE; mode++) {
        run_placed(gt_rts.gpu_self, c, seed, x, n, lg, mode, planned1, y, &o);
        print_message("rank %d: deterministic one GPU, R 2, %s vs R 0\n", rank, mode_name[mode]);
        assert_memory_equal(y0, y, bytes);
    }
    c.ep_size = world;
    for (i = 0; i <= LSA_LL; i++) {
        if (i == 2 || !transport_runs(i)) /* p2p refuses deterministic mode */
            continue;
        use_transport(i);
        c.num_redundant_experts = 0;
        run_placed(gt_rts.gpu, c, seed, x, n, lg, PL_DEFAULT, NULL, y0, &o);
        c.num_redundant_experts = 2 * world;
        for (mode = PL_DEFAULT; mode <= PL_REBALANCE; mode++) {
            run_placed(gt_rts.gpu, c, seed, x, n, lg, mode, planned, y, &o);
            print_message("rank %d: deterministic %s, R %d, %s vs R 0\n", rank, transports[i],
                          2 * world, mode_name[mode]);
            assert_memory_equal(y0, y, bytes);
        }
        end_transports();
    }
    free(x);
    free(y0);
    free(y);
    free(lg);
}

/* Bad maps: the same verdict on every rank, naming the value. */
static void test_bad_map(void **state)
{
    moe_layer_config_t c = shape();
    moe_layer_t *l = NULL;
    int32_t map[MAX_SLOTS];
    int i;
    (void)state;
    c.ep_size = world;
    c.num_redundant_experts = world;
    TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 3));
    TU_OK(moe_layer_get_placement(l, map, E + world));
    for (i = 0; i < E + world; i++)
        if (map[i] == 3)
            map[i] = 4; /* expert 3 in no slot */
    assert_int_equal(moe_layer_set_placement(l, map, E + world), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "logical expert 3"));
    assert_int_equal(moe_layer_set_placement(l, map, E), MOE_STATUS_INVALID_ARGUMENT);
    TU_OK(moe_layer_destroy(l));
}

static int setup(void **state)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    if (gt_group_setup(state))
        return -1;
    rc.backend = MOE_BACKEND_CPU;
    rc.device = -1;
    rc.timeout_ms = 120000;
    return moe_runtime_create(&rc, NULL, &cpu_world) ? -1 : 0;
}

static int teardown(void **state)
{
    moe_runtime_destroy(cpu_world);
    return gt_group_teardown(state);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_one_gpu_replicas), cmocka_unit_test(test_ep_replicas_transports),
    cmocka_unit_test(test_tp_replicas),      cmocka_unit_test(test_deterministic_bitwise),
    cmocka_unit_test(test_bad_map),
};

GT_MPI_MAIN(tests, setup, teardown, rank, world)
