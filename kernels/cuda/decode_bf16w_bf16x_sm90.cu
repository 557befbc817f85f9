// SPDX-License-Identifier: Apache-2.0
// The fused decode kernel's instances for bf16 weights, bf16 x (and the timeline's): a translation
// unit of their own (kernels/cuda/decode_sm90.cuh), compiled beside the others.
#include "kernels/cuda/decode_sm90.cuh"

namespace moe_dec
{
template moe_status_t run_routed<false, __nv_bfloat16>(const params &, moe_dtype_t, int,
                                                       cudaStream_t);
template moe_status_t prepare_routed<false, __nv_bfloat16>();
} // namespace moe_dec
