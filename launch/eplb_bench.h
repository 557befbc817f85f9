/* SPDX-License-Identifier: Apache-2.0 */
/* moe-bench --eplb (eplb_bench.c): expert placement's step time and weight moves. MPI must be
 * initialised. */
#ifndef MOE_EPLB_BENCH_H
#define MOE_EPLB_BENCH_H

int moe_eplb_bench_main(int argc, char **argv);

#endif
