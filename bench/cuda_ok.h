/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA status check of the benchmark programs and of test_gpu_expert_gemm: a failed call
 * prints where and why, then exits 1 (a program's, never the library's way). */
#ifndef MOE_BENCH_CUDA_OK_H
#define MOE_BENCH_CUDA_OK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_OK(x)                                                                                 \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif /* MOE_BENCH_CUDA_OK_H */
