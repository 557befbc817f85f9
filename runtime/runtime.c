/* SPDX-License-Identifier: Apache-2.0 */
/* The runtime object: MPI communicator, node-local rank, backend and device choice. */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/diag.h"
#include "runtime/layer.h"
#include "runtime/topology.h"
#include "kernels/cpu/moe_cpu.h"
#ifdef MOE_HAVE_CUDA
#include "kernels/gpu.h"
#endif
#ifdef MOE_HAVE_NCCL
#include "comm/nccl_comm.h"
#endif

/* MOE_BACKEND=cpu|cuda overrides AUTO; CUDA where built and a device is visible. */
static moe_status_t resolve_backend(moe_runtime_t *rt)
{
    moe_backend_t b = rt->config.backend;
    const char *env = moe_env_str("MOE_BACKEND", "auto");

    if (b == MOE_BACKEND_AUTO) {
        if (!strcmp(env, "cpu"))
            b = MOE_BACKEND_CPU;
        else if (!strcmp(env, "cuda"))
            b = MOE_BACKEND_CUDA;
        else if (strcmp(env, "auto"))
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "MOE_BACKEND=%s: expected cpu, cuda or auto", env);
    }
#ifdef MOE_HAVE_CUDA
    rt->num_gpus = moe_gpu_device_count();
#endif
    if (b == MOE_BACKEND_AUTO)
        b = rt->num_gpus > 0 ? MOE_BACKEND_CUDA : MOE_BACKEND_CPU;
    if (b == MOE_BACKEND_CUDA && rt->num_gpus == 0) {
#ifdef MOE_HAVE_CUDA
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "backend cuda: no CUDA device is visible");
#else
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "backend cuda: libmoe was built without CUDA (MOE_CUDA=OFF or no nvcc)");
#endif
    }
    rt->info.backend = b;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t pick_device(moe_runtime_t *rt)
{
    int dev = rt->config.device;
    rt->info.device = -1;
    if (rt->info.backend != MOE_BACKEND_CUDA)
        return MOE_STATUS_SUCCESS;
    if (dev < 0) {
        int64_t d;
        MOE_CHECK(moe_env_int_checked("MOE_DEVICE", -1, &d));
        dev = (int)d;
    }
    if (dev < 0)
        dev = rt->info.local_rank % rt->num_gpus;
    if (dev >= rt->num_gpus)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "device = %d: only %d CUDA device(s) visible",
                         dev, rt->num_gpus);
#ifdef MOE_HAVE_CUDA
    MOE_CHECK(moe_gpu_set_device(dev));
#endif
    rt->info.device = dev;
    return MOE_STATUS_SUCCESS;
}

static void runtime_free(moe_runtime_t *rt);

/* `env`: this rank's verdict on MOE_TIMEOUT_MS, read before the communicator existed; like
 * every other local failure here it waits for the agreement, so that the peers learn of it at
 * once instead of waiting out their timeout. */
static moe_status_t runtime_setup(moe_runtime_t *rt, moe_status_t env)
{
    int64_t bind;
    MOE_CHECK(moe_comm_node_rank(rt->comm, &rt->info.local_rank, &rt->info.local_size));
    moe_cpu_set_host_ranks(rt->info.local_size); /* the CPU products' threads share the host */
    MOE_CHECK(env);
    MOE_CHECK(moe_env_int_checked("MOE_BIND", 0, &bind));
    MOE_CHECK(resolve_backend(rt));
    MOE_CHECK(pick_device(rt));
    moe_log_set_identity(rt->info.rank, rt->info.device);
    if (rt->config.bind || bind)
        MOE_CHECK(moe_topology_bind(rt));
    return MOE_STATUS_SUCCESS;
}

/* After a successful agreement (so every rank calls it): all ranks must run the same backend
 * (MAX over {b, -b} gives max and -min). */
static moe_status_t check_same_backend(moe_runtime_t *rt)
{
    int64_t b[2];
    b[0] = rt->info.backend;
    b[1] = -(int64_t)rt->info.backend;
    MOE_CHECK(moe_comm_allreduce_i64(rt->comm, b, 2, MOE_REDUCE_MAX));
    if (b[0] != -b[1])
        return moe_error(MOE_STATUS_MISMATCH, "ranks chose different backends (cpu and cuda)");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_create(const moe_runtime_config_t *config, const void *mpi_comm,
                                moe_runtime_t **runtime)
{
    moe_runtime_config_t dflt = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt;
    moe_status_t st, local, env = MOE_STATUS_SUCCESS;
    int64_t timeout_ms = 300000;

    moe_error_clear();
    MOE_ARG_CHECK(runtime != NULL, "runtime = NULL: need a place for the handle");
    *runtime = NULL;
    if (!config)
        config = &dflt;
    MOE_ARG_CHECK(config->backend >= MOE_BACKEND_AUTO && config->backend <= MOE_BACKEND_CUDA,
                  "backend = %d: not a moe_backend_t", (int)config->backend);
    MOE_ARG_CHECK(config->timeout_ms >= 0, "timeout_ms = %d: must be >= 0", config->timeout_ms);
    MOE_ARG_CHECK(config->device >= -1, "device = %d: must be >= -1", config->device);
    /* MOE_TIMEOUT_MS: bound on every wait for a peer (default 5 minutes); a bad value is an
     * error naming it, never a silent default. It is reported after the start-up collectives
     * (runtime_setup), which run under the default meanwhile. */
    if (!config->timeout_ms &&
        (env = moe_env_int_checked("MOE_TIMEOUT_MS", 300000, &timeout_ms)) != MOE_STATUS_SUCCESS)
        timeout_ms = 300000;
    rt = calloc(1, sizeof(*rt));
    if (!rt)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "runtime");
    rt->config = *config;
    rt->timeout_ms = config->timeout_ms ? config->timeout_ms : (int)timeout_ms;
    st = moe_comm_create(mpi_comm, rt->timeout_ms, &rt->comm, &rt->owns_mpi);
    if (st != MOE_STATUS_SUCCESS) {
        moe_comm_finalize_mpi(rt->owns_mpi);
        free(rt);
        return st;
    }
    rt->info.rank = moe_comm_rank(rt->comm);
    rt->info.world_size = moe_comm_size(rt->comm);
    rt->info.numa_node = -1;
    gethostname(rt->info.hostname, sizeof(rt->info.hostname) - 1);
    local = runtime_setup(rt, env);
    st = moe_comm_agree(rt->comm, local);
    if (st == MOE_STATUS_SUCCESS)
        st = check_same_backend(rt);
    if (st != MOE_STATUS_SUCCESS) {
        runtime_free(rt);
        return st;
    }
    MOE_LOG_INFO("INIT", "runtime: rank %d/%d local %d/%d backend %s device %d", rt->info.rank,
                 rt->info.world_size, rt->info.local_rank, rt->info.local_size,
                 moe_backend_name(rt->info.backend), rt->info.device);
    *runtime = rt;
    return MOE_STATUS_SUCCESS;
}

/* Frees without touching the thread's error message (used on create's failure path). */
static void runtime_free(moe_runtime_t *rt)
{
    int owns = rt->owns_mpi;
#ifdef MOE_HAVE_NCCL
    if (rt->gpu_sym_free)
        rt->gpu_sym_free(rt->gpu_sym);
    moe_nccl_destroy(rt->gpu_ctx); /* made by the first multi-GPU layer */
#endif
#ifdef MOE_HAVE_CUDA
    moe_gpu_free(rt->gpu_ws);
#endif
    moe_comm_destroy(rt->comm);
    free(rt);
    moe_comm_finalize_mpi(owns);
}

moe_status_t moe_runtime_destroy(moe_runtime_t *rt)
{
    moe_error_clear();
    if (rt)
        runtime_free(rt);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_max_tokens(moe_runtime_t *rt, int64_t num_tokens,
                                    int64_t *max_tokens_across_ranks)
{
    /* the runtime's agreement, with the largest count in the same all-reduce */
    moe_status_t local = MOE_STATUS_SUCCESS;
    int64_t m;
    moe_error_clear();
    MOE_ARG_CHECK(rt != NULL, "runtime = NULL");
    if (!max_tokens_across_ranks)
        local = moe_error(MOE_STATUS_INVALID_ARGUMENT,
                          "max_tokens_across_ranks = NULL: need a place for the result");
    else if (num_tokens < 0)
        local = moe_error(MOE_STATUS_INVALID_ARGUMENT, "num_tokens = %lld: must be >= 0",
                          (long long)num_tokens);
    m = local == MOE_STATUS_SUCCESS ? num_tokens : 0;
    MOE_CHECK(moe_comm_agree_max(rt->comm, local, &m));
    *max_tokens_across_ranks = m;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_get_info(const moe_runtime_t *rt, moe_runtime_info_t *info)
{
    moe_error_clear();
    MOE_ARG_CHECK(rt != NULL, "runtime = NULL");
    MOE_ARG_CHECK(info != NULL, "info = NULL");
    *info = rt->info;
    info->workspace_bytes = rt->gpu_ws_bytes + rt->gpu_sym_bytes;
    return MOE_STATUS_SUCCESS;
}
