// The CUDA runtime API subset nanoq uses, implemented by the CPU emulator
// (emulator.cpp). Device memory is host memory with canaries after every
// buffer; streams are in-order queues drained by worker threads; events
// order streams as on a GPU; stream capture records work into graphs that
// are replayed later (CUDA graphs, with CUDA's rules on what a capture may
// not do). Error codes and their numbers are CUDA's.
#pragma once

#include "nanoq_emulator.h"

enum cudaError_t : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorInvalidDevice = 101,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureMerge = 902,
    cudaErrorStreamCaptureUnmatched = 903,
    cudaErrorStreamCaptureUnjoined = 904,
    cudaErrorStreamCaptureIsolation = 905,
    cudaErrorCapturedEvent = 907,
    cudaErrorStreamCaptureWrongThread = 908,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind : int {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

constexpr unsigned int cudaStreamDefault = 0x0;
constexpr unsigned int cudaStreamNonBlocking = 0x1;
constexpr unsigned int cudaEventDefault = 0x0;
constexpr unsigned int cudaEventBlockingSync = 0x1;
constexpr unsigned int cudaEventDisableTiming = 0x2;
constexpr unsigned int cudaHostAllocDefault = 0x0;

// Legacy default stream handle.
#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

// The attributes nanoq asks for. The emulated devices are of compute
// capability 9.0 (Hopper), or NANOQ_EMU_COMPUTE_CAPABILITY ("8.0", "10.0", ...).
enum cudaDeviceAttr : int { cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrComputeCapabilityMinor = 76 };

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);

// A kernel's attributes (none that nanoq reads). As on a GPU, it fails with
// cudaErrorNoKernelImageForDevice where the build has no code the current
// device can run: the emulated code counts as built for the architectures
// NANOQ_CUDA_ARCHITECTURES names (cmake/cuda_emulator.cmake), and a kernel
// launch fails the same way.
struct cudaFuncAttributes {
    int maxThreadsPerBlock = 1024;
};
namespace nanoq_emu {
cudaError_t func_attributes(cudaFuncAttributes* attributes);
}
template <class T> inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, T* /*entry*/) {
    return nanoq_emu::func_attributes(attributes);
}

cudaError_t cudaMalloc(void** pointer, std::size_t bytes);
template <class T> inline cudaError_t cudaMalloc(T** pointer, std::size_t bytes) {
    return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
cudaError_t cudaFree(void* pointer);
// Stream-ordered allocation (the runtime's default memory pool on a GPU).
// A block freed in stream order stays with the device's pool, still taken
// from the device, until cudaMemPoolTrimTo or a stream, event or device
// synchronisation (the default release threshold of 0).
cudaError_t cudaMallocAsync(void** pointer, std::size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream);
typedef struct EmulatedMemPool* cudaMemPool_t;
cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* pool, int device);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, std::size_t min_bytes_to_keep);
cudaError_t cudaMallocHost(void** pointer, std::size_t bytes);
template <class T> inline cudaError_t cudaMallocHost(T** pointer, std::size_t bytes) {
    return cudaMallocHost(reinterpret_cast<void**>(pointer), bytes);
}
cudaError_t cudaHostAlloc(void** pointer, std::size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* pointer);
cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes);

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, std::size_t bytes,
                                cudaStream_t stream = nullptr);
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, std::size_t bytes);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
// Host time between the two events' latest completed records, as on a GPU
// (the emulator's streams run on host threads).
cudaError_t cudaEventElapsedTime(float* milliseconds, cudaEvent_t start, cudaEvent_t end);

// ---- stream capture and graphs ---------------------------------------------
// Work queued on a capturing stream is recorded, not run; a stream that
// waits on an event recorded in a capture joins it (fork), and the capture
// must end with every joined stream's work joined back into the stream that
// began it. What CUDA forbids during a capture is an error here too, and
// invalidates the capture: synchronising or querying a capturing stream or
// the device, querying or synchronising an event recorded in a capture,
// copies to or from pageable host memory on a capturing stream, waiting on
// an event recorded outside the capture, and calls that may synchronise
// implicitly (cudaMalloc, cudaFree, cudaMallocHost, cudaFreeHost, cudaMemcpy,
// cudaMemset) from any thread while a global-mode capture runs, or from the
// capturing thread of a thread-local one. A launched graph runs its nodes in
// a random order that honours the recorded dependencies (from the seed), so
// a dependency missing from the capture shows.
enum cudaStreamCaptureMode : int {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus : int {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2,
};
typedef struct nanoq_emu_graph* cudaGraph_t;
typedef struct nanoq_emu_graph_exec* cudaGraphExec_t;

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

namespace nanoq_emu {
// Queues `work` on `stream` (the host continues at once); an Error it
// throws becomes the stream's sticky error. Used by the emulated libraries
// (cuBLASLt, CUB, NCCL) to run their work in stream order.
void enqueue(cudaStream_t stream, std::function<void()> work, const char* what);
// Whether `device` was lost (nanoq_emu_lose_device in emulator.cpp): as on a
// GPU after a fatal fault, everything on it fails from then on.
bool device_lost(int device);
// With NANOQ_EMU_JITTER_US=N, sleeps up to N microseconds at random (in a
// quarter of the calls), at the points where host threads and streams meet:
// a stream's next task, stream and event queries, event records, NCCL's
// calls and their work. Varies the interleavings a race needs, which the
// seeded schedule of a kernel's threads does not; 0 or unset: never.
void jitter();
// A stopped host (nanoq_emu_nccl_stall_rank in emu_libraries.cpp): from
// stall_host(device) on, the stream and event queries of unfinished work
// by threads whose current device is `device` block, as in a process that
// stopped, until release_stalled_host() (a peer gave up: it aborted its
// communicator).
void stall_host(int device);
void release_stalled_host();
}  // namespace nanoq_emu
