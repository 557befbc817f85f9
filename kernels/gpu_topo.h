/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA-free declaration: a device's PCI bus id ("0000:3b:00.0"). */
#ifndef MOE_GPU_TOPO_H
#define MOE_GPU_TOPO_H

#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

moe_status_t moe_gpu_pci_bus_id(int device, char *buf, int len);

#ifdef __cplusplus
}
#endif

#endif /* MOE_GPU_TOPO_H */
