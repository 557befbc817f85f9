/* SPDX-License-Identifier: Apache-2.0 */
/* moe-bench --dispatch-only (dispatch_bench.c). MPI must be initialised. */
#ifndef MOE_DISPATCH_BENCH_H
#define MOE_DISPATCH_BENCH_H

int moe_dispatch_bench_main(int argc, char **argv);

#endif
