/* SPDX-License-Identifier: Apache-2.0 */
/* The shared MLP of an EP step beside the exchange: forked onto the side stream
 * (MOE_EP_SHARED_OVERLAP=1) or run in place, and joined before its output is read. */

#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/gpu.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"

/* The whole shared MLP (and Qwen2's gate) on this rank's T tokens: on the stream, or where
 * MOE_EP_SHARED_OVERLAP=1 on the side stream after an event of the stream's, so it runs
 * while the stream goes on (moe_cuda_ep_shared_join orders its output before the stream reads it).
 */
moe_status_t moe_cuda_ep_shared_fork(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                     void *stream)
{
    cuda_layer_t *s = l->state;
    moe_forward_args_t g;
    void *on = s->side ? s->side : stream;
    if (s->ss == 0 || T == 0)
        return MOE_STATUS_SUCCESS;
    if (s->side) {
        MOE_CHECK(moe_gpu_event_record(s->ev_fork, stream));
        MOE_CHECK(moe_gpu_stream_wait_event(s->side, s->ev_fork));
    }
    g = *ok;
    g.stream = on;
    MOE_CHECK(moe_cuda_shared_experts(s, ok->x, ok->dtype, T, on));
    MOE_CHECK(moe_cuda_shared_gate(l, &g));
    if (s->side) {
        MOE_CHECK(moe_gpu_event_record(s->ev_join, s->side));
        s->shared_pending = 1;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_ep_shared_join(cuda_layer_t *s, void *stream)
{
    if (!s->shared_pending)
        return MOE_STATUS_SUCCESS;
    s->shared_pending = 0;
    return moe_gpu_stream_wait_event(stream, s->ev_join);
}
