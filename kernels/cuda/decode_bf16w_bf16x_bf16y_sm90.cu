// SPDX-License-Identifier: Apache-2.0
// The fused decode kernel's instances for bf16 weights, bf16 x, bf16 y (and the timeline's): a
// translation unit of their own (kernels/cuda/decode_sm90.cuh), compiled beside the others.
#include "kernels/cuda/decode_sm90.cuh"

namespace moe_dec
{
MOE_DECODE_ROUTED(, false, __nv_bfloat16, __nv_bfloat16)
} // namespace moe_dec
