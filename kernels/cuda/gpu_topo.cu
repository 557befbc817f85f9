// SPDX-License-Identifier: Apache-2.0
// PCI bus id of a CUDA device, for hwloc locality (runtime/topology.c).
#include <cuda_runtime.h>
#include "kernels/gpu_topo.h"
#include "base/diag.h"

extern "C" moe_status_t moe_gpu_pci_bus_id(int device, char *buf, int len)
{
    cudaError_t e = cudaDeviceGetPCIBusId(buf, len, device);
    if (e != cudaSuccess)
        return moe_error(MOE_STATUS_CUDA_ERROR, "cudaDeviceGetPCIBusId(%d): %s", device,
                         cudaGetErrorString(e));
    return MOE_STATUS_SUCCESS;
}
