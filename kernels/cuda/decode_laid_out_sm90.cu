// SPDX-License-Identifier: Apache-2.0
// The fused decode kernel's instances for laid-out rows (an EP step's low-latency layout), bf16 and
// fp8 weights: a translation unit of their own (kernels/cuda/decode_sm90.cuh), compiled beside the
// others.
#include "kernels/cuda/decode_sm90.cuh"

namespace moe_dec
{
template moe_status_t run_laid_out<false>(const params &, int, cudaStream_t);
template moe_status_t run_laid_out<true>(const params &, int, cudaStream_t);
template moe_status_t prepare_laid_out<false>();
template moe_status_t prepare_laid_out<true>();
} // namespace moe_dec
