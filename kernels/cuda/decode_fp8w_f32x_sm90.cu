// SPDX-License-Identifier: Apache-2.0
// The fused decode kernel's instances for fp8 weights (W8A8), f32 x: a translation unit of their
// own (kernels/cuda/decode_sm90.cuh), compiled beside the others.
#include "kernels/cuda/decode_sm90.cuh"

namespace moe_dec
{
template moe_status_t run_routed<true, float>(const params &, moe_dtype_t, int, cudaStream_t);
template moe_status_t prepare_routed<true, float>();
} // namespace moe_dec
