/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA runtime wrappers behind kernels/gpu.h: each call checked and named on failure. */
#include "kernels/gpu.h"

#include <string.h>
#include <time.h>
#include <unistd.h>
#include "kernels/cuda/cuda_check.h"
#include "base/diag.h"

extern "C" {

int moe_gpu_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        return 0;
    }
    return n;
}

moe_status_t moe_gpu_probe(int *count)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    *count = 0;
    /* No device: the driver says so, or there is no driver at all (no /dev/nvidiactl; cudart
     * then reports an insufficient driver). A driver that is there but too old is an error. */
    if (e == cudaErrorNoDevice ||
        (e == cudaErrorInsufficientDriver && access("/dev/nvidiactl", F_OK) != 0)) {
        (void)cudaGetLastError();
        return MOE_STATUS_SUCCESS;
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return moe_error(MOE_STATUS_CUDA_ERROR, "cudaGetDeviceCount: %s (%s)", cudaGetErrorName(e),
                         cudaGetErrorString(e));
    }
    *count = n;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_set_device(int device)
{
    MOE_CUDA_CHECK(cudaSetDevice(device));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_get_device(int *device)
{
    MOE_CUDA_CHECK(cudaGetDevice(device));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_arch(int device, int *arch)
{
    int major = 0, minor = 0;
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    *arch = major * 10 + minor;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_name(int device, char *name, size_t len)
{
    cudaDeviceProp prop;
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    if (len) {
        strncpy(name, prop.name, len - 1);
        name[len - 1] = '\0';
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_device_synchronize(void)
{
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_malloc(void **ptr, size_t bytes)
{
    cudaError_t e;
    *ptr = NULL;
    if (bytes == 0)
        return MOE_STATUS_SUCCESS;
    e = cudaMalloc(ptr, bytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        *ptr = NULL;
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "cudaMalloc of %zu bytes: out of memory", bytes);
    }
    MOE_CUDA_CHECK(e);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_free(void *ptr)
{
    if (ptr)
        MOE_CUDA_CHECK(cudaFree(ptr));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memcpy_h2d(void *dst, const void *src, size_t bytes)
{
    if (bytes)
        MOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memcpy_d2h(void *dst, const void *src, size_t bytes)
{
    if (bytes)
        MOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memset(void *dst, int value, size_t bytes)
{
    /* cudaMemset of device memory may return before the device has done it: wait for it, so
     * that no other stream (a caller's non-blocking one, a peer's stores through IPC) can
     * meet the bytes before they are set */
    if (bytes) {
        MOE_CUDA_CHECK(cudaMemset(dst, value, bytes));
        MOE_CUDA_CHECK(cudaStreamSynchronize(0));
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memcpy_d2h_async(void *dst, const void *src, size_t bytes, void *stream)
{
    if (bytes)
        MOE_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memcpy_d2d_async(void *dst, const void *src, size_t bytes, void *stream)
{
    if (bytes)
        MOE_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_memset_async(void *dst, int value, size_t bytes, void *stream)
{
    if (bytes)
        MOE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, (cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_stream_create(void **stream)
{
    cudaStream_t s = NULL;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = (void *)s;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_stream_destroy(void *stream)
{
    if (stream)
        MOE_CUDA_CHECK(cudaStreamDestroy((cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_stream_synchronize(void *stream)
{
    MOE_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

/* `query` until it stops answering cudaErrorNotReady or the deadline passes: 20 ms of spinning
 * (as cudaStreamSynchronize spins: a healthy step ends within it, at no added latency), then
 * sleeps growing from 20 us to 0.2 ms (a wait on a stopped peer does not hold a core). */
static moe_status_t wait_polled(cudaError_t (*query)(void *), void *obj, int64_t timeout_ms,
                                const char *what)
{
    const double t0 = moe_now_ms(), deadline = t0 + (double)timeout_ms;
    long sleep_ns = 20000;
    for (;;) {
        const cudaError_t e = query(obj);
        double now;
        if (e != cudaErrorNotReady) {
            MOE_CUDA_CHECK(e);
            return MOE_STATUS_SUCCESS;
        }
        now = moe_now_ms();
        if (now >= deadline)
            return moe_error(MOE_STATUS_TIMEOUT,
                             "%s: the device did not finish within %lld ms (a peer stopped or "
                             "died mid-step and a wait on it did not end)",
                             what, (long long)timeout_ms);
        if (now - t0 > 20.0) {
            struct timespec ts = {0, sleep_ns};
            nanosleep(&ts, NULL);
            sleep_ns = sleep_ns < 200000 ? 2 * sleep_ns : 200000;
        }
    }
}

static cudaError_t query_stream(void *s)
{
    return cudaStreamQuery((cudaStream_t)s);
}

static cudaError_t query_event(void *e)
{
    return cudaEventQuery((cudaEvent_t)e);
}

moe_status_t moe_gpu_stream_wait_bounded(void *stream, int64_t timeout_ms, const char *what)
{
    return wait_polled(query_stream, stream, timeout_ms, what);
}

moe_status_t moe_gpu_event_wait_bounded(void *event, int64_t timeout_ms, const char *what)
{
    return wait_polled(query_event, event, timeout_ms, what);
}

moe_status_t moe_gpu_stream_is_capturing(void *stream, int *capturing)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing((cudaStream_t)stream, &cs));
    *capturing = cs != cudaStreamCaptureStatusNone;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_create(void **event)
{
    cudaEvent_t e = NULL;
    MOE_CUDA_CHECK(cudaEventCreate(&e));
    *event = (void *)e;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_destroy(void *event)
{
    if (event)
        MOE_CUDA_CHECK(cudaEventDestroy((cudaEvent_t)event));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_record(void *event, void *stream)
{
    MOE_CUDA_CHECK(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_synchronize(void *event)
{
    MOE_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)event));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_elapsed_ms(void *start, void *stop, float *ms)
{
    MOE_CUDA_CHECK(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)stop));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_event_create_untimed(void **event)
{
    cudaEvent_t e = NULL;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *event = (void *)e;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_stream_wait_event(void *stream, void *event)
{
    MOE_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_capture_begin(void *stream)
{
    MOE_CUDA_CHECK(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_capture_end(void *stream, void **graph)
{
    cudaGraph_t g = NULL;
    MOE_CUDA_CHECK(cudaStreamEndCapture((cudaStream_t)stream, &g));
    *graph = (void *)g;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_instantiate(void *graph, void **graph_exec)
{
    cudaGraphExec_t ge = NULL;
    MOE_CUDA_CHECK(cudaGraphInstantiate(&ge, (cudaGraph_t)graph, 0));
    *graph_exec = (void *)ge;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_launch(void *graph_exec, void *stream)
{
    MOE_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph_exec, (cudaStream_t)stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_destroy(void *graph)
{
    if (graph)
        MOE_CUDA_CHECK(cudaGraphDestroy((cudaGraph_t)graph));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_graph_exec_destroy(void *graph_exec)
{
    if (graph_exec)
        MOE_CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph_exec));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_host_alloc(void **ptr, size_t bytes)
{
    *ptr = NULL;
    if (bytes)
        MOE_CUDA_CHECK(cudaMallocHost(ptr, bytes));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_host_free(void *ptr)
{
    if (ptr)
        MOE_CUDA_CHECK(cudaFreeHost(ptr));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_ipc_handle(void *ptr, void *handle)
{
    cudaIpcMemHandle_t h;
    static_assert(sizeof(h) == MOE_GPU_IPC_HANDLE_BYTES, "IPC handle size");
    MOE_CUDA_CHECK(cudaIpcGetMemHandle(&h, ptr));
    memcpy(handle, &h, sizeof(h));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_ipc_open(const void *handle, void **ptr)
{
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    *ptr = NULL;
    MOE_CUDA_CHECK(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_ipc_close(void *ptr)
{
    if (ptr)
        MOE_CUDA_CHECK(cudaIpcCloseMemHandle(ptr));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_gpu_sm_count(int device, int *sms)
{
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device));
    return MOE_STATUS_SUCCESS;
}

int moe_gpu_can_access_peer_bus(int device, const char *peer_bus_id)
{
    char mine[MOE_GPU_BUS_ID_BYTES];
    int peer = -1;
    if (!peer_bus_id[0] || cudaDeviceGetPCIBusId(mine, (int)sizeof(mine), device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (!strcmp(mine, peer_bus_id)) /* the same GPU (ranks sharing it) */
        return 1;
    if (cudaDeviceGetByPCIBusId(&peer, peer_bus_id) != cudaSuccess) { /* not visible here */
        (void)cudaGetLastError();
        return 0;
    }
    return moe_gpu_can_access_peer(device, peer);
}

int moe_gpu_can_access_peer(int device, int peer_device)
{
    int ok = 0;
    if (device == peer_device)
        return 1;
    if (cudaDeviceCanAccessPeer(&ok, device, peer_device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return ok;
}

} /* extern "C" */
