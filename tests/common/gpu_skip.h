/* SPDX-License-Identifier: Apache-2.0 */
/* The one rule for GPU tests: skip (exit 77) only when no CUDA device exists; any other CUDA
 * failure fails the test; MOE_REQUIRE_GPU=1 (the GPU machine) turns a skip into a failure. */
#ifndef MOE_GPU_SKIP_H
#define MOE_GPU_SKIP_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "kernels/gpu.h"
#include "base/diag.h"

#define GT_SKIP 77

/* Returns 0 to run (at least `need` devices), else the exit code: 77 skip, 1 failure. */
static inline int gt_gpu_gate(int need)
{
    int n = 0;
    const char *req = getenv("MOE_REQUIRE_GPU");
    int require = req && req[0] && req[0] != '0';
    if (moe_gpu_probe(&n) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "CUDA is broken here (not a missing device): %s\n", moe_last_error());
        return 1;
    }
    if (n >= need)
        return 0;
    fprintf(stderr, "%d CUDA device(s), %d needed: %s\n", n, need,
            require ? "MOE_REQUIRE_GPU=1, so this is a failure" : "skipped");
    return require ? 1 : GT_SKIP;
}

/* MOE_TEST_FILTER=<pattern> (e.g. test_decode_block*): only the tests whose names match it run,
 * for a quick look at a few; called before cmocka runs the group. */
static inline void gt_test_filter(void)
{
    const char *f = getenv("MOE_TEST_FILTER");
    if (f)
        cmocka_set_test_filter(f);
}

#endif /* MOE_GPU_SKIP_H */
