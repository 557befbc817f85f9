/* SPDX-License-Identifier: Apache-2.0 */
/* moe-run's checkpoint mode: layer config and shard loading from a checkpoint, tokens from and
 * output to safetensors files. Uses only the public API and MPI. */
#include "run_model.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "layer_gen.h"
#include "moe/moe_checkpoint.h"

/* Every rank's status, agreed: the worst one, PEER_FAILURE where this rank was fine. */
static moe_status_t agree(moe_status_t st)
{
    int mine = st != MOE_STATUS_SUCCESS, any = 0;

    if (MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD) != MPI_SUCCESS)
        return MOE_STATUS_MPI_ERROR;
    if (st != MOE_STATUS_SUCCESS)
        return st;
    if (any)
        fprintf(stderr, "moe-run: another rank failed (see its message)\n");
    return any ? MOE_STATUS_PEER_FAILURE : MOE_STATUS_SUCCESS;
}

moe_status_t moe_run_model_config(const char *model, int layer_index, moe_layer_config_t *cfg)
{
    moe_checkpoint_t *ckpt = NULL;
    moe_status_t st = moe_checkpoint_open(model, &ckpt);

    if (st == MOE_STATUS_SUCCESS)
        st = moe_checkpoint_layer_config(ckpt, layer_index, cfg);
    moe_checkpoint_close(ckpt);
    return st;
}

moe_status_t moe_run_model_load(moe_layer_t *layer, const char *model, int layer_index)
{
    moe_checkpoint_t *ckpt = NULL;
    moe_status_t st = moe_checkpoint_open(model, &ckpt);

    if (st == MOE_STATUS_SUCCESS)
        st = moe_layer_load(layer, ckpt, layer_index);
    moe_checkpoint_close(ckpt);
    return agree(st);
}

moe_status_t moe_run_model_tokens(const char *input, uint64_t seed, int64_t t0, int64_t n,
                                  int hidden, float *x)
{
    int64_t total = n, rows = 0, cols = 0;
    moe_dtype_t dt = MOE_DTYPE_INVALID;
    moe_status_t st;

    if (!input) {
        moe_gen_tokens(seed, t0, n, hidden, x);
        return MOE_STATUS_SUCCESS;
    }
    if (MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
        return MOE_STATUS_MPI_ERROR;
    st = moe_safetensors_tensor_info(input, "hidden_states", &dt, &rows, &cols);
    if (st == MOE_STATUS_SUCCESS && (rows != total || cols != hidden)) {
        int rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        if (rank == 0)
            fprintf(stderr,
                    "moe-run: --input %s: hidden_states is [%lld, %lld]; the layer needs "
                    "[%lld, %d] (pass --tokens %lld)\n",
                    input, (long long)rows, (long long)cols, (long long)total, hidden,
                    (long long)rows);
        st = MOE_STATUS_INVALID_ARGUMENT;
    }
    if (st == MOE_STATUS_SUCCESS)
        st = moe_safetensors_read_rows(input, "hidden_states", t0, t0 + n, MOE_DTYPE_F32, x);
    return agree(st);
}

moe_status_t moe_run_model_write_output(const char *output, const float *y, int64_t n, int hidden)
{
    int rank, world, mine, *counts = NULL, *displs = NULL;
    int64_t total = n * hidden;
    float *all = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;

    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    /* One verdict on the size on every rank before anything is sent. */
    MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    if (total > INT_MAX) {
        if (rank == 0)
            fprintf(stderr, "moe-run: --output: %lld values exceed one MPI gather\n",
                    (long long)total);
        return MOE_STATUS_NOT_SUPPORTED;
    }
    mine = (int)(n * hidden);
    if (rank == 0) {
        counts = calloc((size_t)world, sizeof(int));
        displs = calloc((size_t)world, sizeof(int));
        all = malloc(sizeof(float) * (size_t)(total + 1));
        if (!counts || !displs || !all)
            st = MOE_STATUS_OUT_OF_MEMORY;
    }
    /* Rank 0's allocation decides for all: nobody enters a gather rank 0 will not join. */
    MPI_Bcast(&st, (int)sizeof(st), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (st != MOE_STATUS_SUCCESS) {
        free(all);
        free(counts);
        free(displs);
        return st == MOE_STATUS_SUCCESS || rank == 0 ? st : MOE_STATUS_PEER_FAILURE;
    }
    MPI_Gather(&mine, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank == 0)
        for (int r = 1; r < world; r++)
            displs[r] = displs[r - 1] + counts[r - 1];
    MPI_Gatherv(y, mine, MPI_FLOAT, all, counts, displs, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (rank == 0 && st == MOE_STATUS_SUCCESS) {
        const char *name = "hidden_states";
        moe_tensor_t t = {MOE_DTYPE_F32, total / hidden, hidden, all, NULL, 0, 0};
        st = moe_safetensors_write(output, 1, &name, &t);
    }
    free(all);
    free(counts);
    free(displs);
    return agree(st);
}
