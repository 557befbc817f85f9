/* SPDX-License-Identifier: Apache-2.0 */
/* The runtime's only door to the CUDA runtime: devices, memory, streams, events, graphs.
 * CUDA-free: streams, events and graphs cross as `void *` (cudaStream_t, cudaEvent_t,
 * cudaGraph_t, cudaGraphExec_t). A NULL stream is the legacy default stream. Every call
 * returns MOE_STATUS_CUDA_ERROR naming the failed CUDA call on error. */
#ifndef MOE_GPU_H
#define MOE_GPU_H

#include <stddef.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Visible CUDA devices; 0 on any error (no driver, no device). Never sets an error. */
int moe_gpu_device_count(void);
/* *count = the visible devices; 0 with success only when the driver reports no device
 * (cudaErrorNoDevice). Any other failure (driver too old, broken install) is an error. */
moe_status_t moe_gpu_probe(int *count);
moe_status_t moe_gpu_set_device(int device);
moe_status_t moe_gpu_get_device(int *device);
/* Compute capability as major * 10 + minor (90 for H100/H200). */
moe_status_t moe_gpu_arch(int device, int *arch);
/* The device's marketing name ("NVIDIA H200"), NUL-terminated in name[len]. */
moe_status_t moe_gpu_name(int device, char *name, size_t len);
moe_status_t moe_gpu_device_synchronize(void);

/* Device memory. moe_gpu_free(NULL) is fine. */
moe_status_t moe_gpu_malloc(void **ptr, size_t bytes);
moe_status_t moe_gpu_free(void *ptr);

/* Synchronous copies (h2d, d2h, d2d) and memset. */
moe_status_t moe_gpu_memcpy_h2d(void *dst, const void *src, size_t bytes);
moe_status_t moe_gpu_memcpy_d2h(void *dst, const void *src, size_t bytes);
moe_status_t moe_gpu_memset(void *dst, int value, size_t bytes);

/* Stream-ordered copies and memset (capturable; host memory should be pinned for overlap). */
moe_status_t moe_gpu_memcpy_d2h_async(void *dst, const void *src, size_t bytes, void *stream);
moe_status_t moe_gpu_memcpy_d2d_async(void *dst, const void *src, size_t bytes, void *stream);
moe_status_t moe_gpu_memset_async(void *dst, int value, size_t bytes, void *stream);

/* Streams (non-blocking with respect to the legacy stream). */
moe_status_t moe_gpu_stream_create(void **stream);
moe_status_t moe_gpu_stream_destroy(void *stream);
moe_status_t moe_gpu_stream_synchronize(void *stream);
/* Waits on the host for `stream` (or `event`) with a deadline: polls (20 ms of spinning, then
 * sleeps of at most 0.2 ms, so a long wait does not hold a core) for at most `timeout_ms`, and
 * returns MOE_STATUS_TIMEOUT naming `what` where the device has not finished by then (a peer
 * stopped mid-step whose device-side wait did not end: the host never waits longer than the
 * device would). The work stays queued; CUDA errors as the synchronize calls. */
moe_status_t moe_gpu_stream_wait_bounded(void *stream, int64_t timeout_ms, const char *what);
moe_status_t moe_gpu_event_wait_bounded(void *event, int64_t timeout_ms, const char *what);
/* 1 if `stream` is being captured into a graph, else 0. */
moe_status_t moe_gpu_stream_is_capturing(void *stream, int *capturing);

/* Events with timing. elapsed: milliseconds from `start` to `stop` (both recorded). */
moe_status_t moe_gpu_event_create(void **event);
moe_status_t moe_gpu_event_destroy(void *event);
moe_status_t moe_gpu_event_record(void *event, void *stream);
moe_status_t moe_gpu_event_synchronize(void *event);
moe_status_t moe_gpu_event_elapsed_ms(void *start, void *stop, float *ms);
/* An event without timing (orders streams: cheaper to record and wait on). */
moe_status_t moe_gpu_event_create_untimed(void **event);
/* Later work on `stream` waits for `event`'s last record (graph capture: joins the capture). */
moe_status_t moe_gpu_stream_wait_event(void *stream, void *event);

/* Graphs: capture the work queued on `stream` between begin and end (thread-local mode),
 * instantiate once, launch many times. */
moe_status_t moe_gpu_graph_capture_begin(void *stream);
moe_status_t moe_gpu_graph_capture_end(void *stream, void **graph);
moe_status_t moe_gpu_graph_instantiate(void *graph, void **graph_exec);
moe_status_t moe_gpu_graph_launch(void *graph_exec, void *stream);
moe_status_t moe_gpu_graph_destroy(void *graph);
moe_status_t moe_gpu_graph_exec_destroy(void *graph_exec);

/* Pinned host memory for fast and asynchronous copies; with unified addressing the device can
 * read and write it too (the step verdict word). */
moe_status_t moe_gpu_host_alloc(void **ptr, size_t bytes);
moe_status_t moe_gpu_host_free(void *ptr);

/* CUDA IPC of device memory between processes of one host (the all-to-all's symmetric
 * buffer). A handle is MOE_GPU_IPC_HANDLE_BYTES opaque bytes. */
#define MOE_GPU_IPC_HANDLE_BYTES 64
moe_status_t moe_gpu_ipc_handle(void *ptr, void *handle);
/* Maps a peer's buffer into this process (and enables peer access to its device). */
moe_status_t moe_gpu_ipc_open(const void *handle, void **ptr);
moe_status_t moe_gpu_ipc_close(void *ptr);
/* Multiprocessors of `device`. */
moe_status_t moe_gpu_sm_count(int device, int *sms);
/* 1 when this device can load/store the memory of `peer_device` directly (NVLink or PCIe P2P). */
int moe_gpu_can_access_peer(int device, int peer_device);
/* A GPU's PCI bus id ("0000:19:00.0", moe_gpu_pci_bus_id in kernels/gpu_topo.h) names it the
 * same in every process of a host, whatever each one's CUDA_VISIBLE_DEVICES (device ordinals
 * do not). 1 when `device` is the GPU with that bus id, or can access it directly and it is
 * visible in this process; 0 otherwise (and for an empty id). */
#define MOE_GPU_BUS_ID_BYTES 16
int moe_gpu_can_access_peer_bus(int device, const char *peer_bus_id);

#ifdef __cplusplus
}
#endif

#endif /* MOE_GPU_H */
