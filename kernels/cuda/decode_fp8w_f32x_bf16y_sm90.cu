// SPDX-License-Identifier: Apache-2.0
// The fused decode kernel's instances for fp8 weights (W8A8), f32 x, bf16 y: a translation
// unit of their own (kernels/cuda/decode_sm90.cuh), compiled beside the others.
#include "kernels/cuda/decode_sm90.cuh"

namespace moe_dec
{
MOE_DECODE_ROUTED(, true, float, __nv_bfloat16)
} // namespace moe_dec
