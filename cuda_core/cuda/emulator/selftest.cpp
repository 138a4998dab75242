// Kernels that exercise the emulator itself (warp intrinsics with widths and
// masks, block votes, and the faults it must report), run by
// tests/test_cuda_emulated.py through the one exported function below.
// Compiled into the emulated backend only.
#include <cstring>
#include <string>

#include "cuda/kernel_utils.cuh"

namespace nanoq {
namespace cuda {
namespace {

using detail::kFullMask;

// Rows of 64 values (two warps), one row per intrinsic variant.
__global__ void shuffle_kernel(int* out) {
    const int t = threadIdx.x, lane = t % 32;
    const int v = 100 * t;
    int row = 0;
    auto put = [&](int value) { out[64 * row++ + t] = value; };
    put(__shfl_sync(kFullMask, v, (lane + 3) % 32));
    put(__shfl_sync(kFullMask, v, lane + 3, 8));
    put(__shfl_up_sync(kFullMask, v, 2, 16));
    put(__shfl_down_sync(kFullMask, v, 3, 8));
    put(__shfl_xor_sync(kFullMask, v, 5));
    put(__shfl_xor_sync(kFullMask, v, 4, 4));
    put(static_cast<int>(__ballot_sync(kFullMask, lane % 3 == 0)));
    put(__any_sync(kFullMask, t == 40));
    put(__all_sync(kFullMask, t != 40));
    // Two halves of a warp in different intrinsics with their own masks.
    if (lane < 16)
        put(__shfl_xor_sync(0x0000ffffu, v, 1, 16));
    else
        put(__shfl_down_sync(0xffff0000u, v, 1, 16));
    put(static_cast<int>(__shfl_sync(kFullMask, 1.5 * t, 31 - lane)));  // a double
}

__global__ void vote_kernel(int* out) {
    const int t = threadIdx.x;
    out[4 * t + 0] = __syncthreads_count(t % 5 == 0);
    out[4 * t + 1] = __syncthreads_or(t == 77);
    out[4 * t + 2] = __syncthreads_and(t < 1000);
    out[4 * t + 3] = __syncthreads_and(t != 3);
}

// Two sums in a row through the same shared space, as block_sum allows.
__global__ void block_sum_kernel(int* out) {
    NANOQ_SHARED(double[detail::kWarpSize], space);
    const double first = detail::block_sum(static_cast<double>(threadIdx.x), space);
    const double second = detail::block_sum(static_cast<double>(threadIdx.x % 7), space);
    out[2 * threadIdx.x] = static_cast<int>(first);
    out[2 * threadIdx.x + 1] = static_cast<int>(second);
}

__global__ void neighbour_kernel(int* out, bool with_barrier) {
    NANOQ_SHARED(int[128], values);
    const int t = threadIdx.x;
    values[t] = t;
    if (with_barrier) __syncthreads();
    out[t] = values[(t + 1) % blockDim.x];
}

__global__ void dynamic_shared_kernel(int* out) {
    NANOQ_DYNAMIC_SHARED(int, values);
    values[threadIdx.x] = 2 * threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = values[blockDim.x - 1 - threadIdx.x];
}

// Each of these must fail the launch with a clear message.
__global__ void divergent_barrier_kernel(int*) {
    if (threadIdx.x < 16) __syncthreads();
}
__global__ void two_barriers_kernel(int*) {
    if (threadIdx.x % 2)
        __syncthreads();
    else
        __syncthreads();
}
__global__ void exit_before_barrier_kernel(int* out) {
    if (threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
__global__ void shared_overflow_kernel(int*) {
    NANOQ_SHARED(float[32], values);
    values[threadIdx.x + 1] = 1.0f;
}
__global__ void shared_pointer_overflow_kernel(int*) {
    NANOQ_SHARED(float[32], values);
    const detail::smem_ptr<float> upper = values + 16;
    upper[threadIdx.x] = 1.0f;
}
__global__ void dynamic_overflow_kernel(int*) {
    NANOQ_DYNAMIC_SHARED(int, values);
    values[threadIdx.x + 1] = 1;
}
__global__ void shuffle_outside_mask_kernel(int* out) { out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 0); }
__global__ void shuffle_reads_outside_mask_kernel(int* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 20);
}
__global__ void shuffle_exited_lane_kernel(int* out) {
    if (threadIdx.x == 7) return;
    out[threadIdx.x] = __shfl_sync(kFullMask, 1, 0);
}
__global__ void global_overrun_kernel(int* out) { out[threadIdx.x + 1] = 1; }
// Reads one int past the end: no canary sees a read; AddressSanitizer does
// (tests/sanitize/run.sh address checks that it is reported).
__global__ void global_overread_kernel(int* out) {
    const int next = out[threadIdx.x + 1];
    __syncthreads();
    out[threadIdx.x] = next + 1;
}

}  // namespace
}  // namespace cuda
}  // namespace nanoq

// Runs test kernel `name` with the given schedule seed on `n` ints of device
// memory, copies them to `out` and returns the CUDA error code; `message`
// receives the error's text.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_selftest(const char* name, unsigned long long seed,
                                                                          int* out, int n, char* message,
                                                                          int message_bytes) {
    using namespace nanoq::cuda;
    nanoq_emu::set_seed(seed);
    cudaStream_t stream = nullptr;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    int* data = nullptr;
    cudaMalloc(&data, sizeof(int) * n);
    cudaMemsetAsync(data, 0, sizeof(int) * n, stream);
    const std::string test = name;
    const std::size_t dynamic = 64 * sizeof(int);
    if (test == "shuffle") detail::launch(shuffle_kernel, 1, 64, 0, stream, data);
    else if (test == "vote") detail::launch(vote_kernel, 1, 96, 0, stream, data);
    else if (test == "block_sum") detail::launch(block_sum_kernel, 1, 256, 0, stream, data);
    else if (test == "neighbour") detail::launch(neighbour_kernel, 1, 128, 0, stream, data, false);
    else if (test == "neighbour_synced") detail::launch(neighbour_kernel, 1, 128, 0, stream, data, true);
    else if (test == "dynamic_shared") detail::launch(dynamic_shared_kernel, 1, 64, dynamic, stream, data);
    else if (test == "divergent_barrier") detail::launch(divergent_barrier_kernel, 1, 32, 0, stream, data);
    else if (test == "two_barriers") detail::launch(two_barriers_kernel, 1, 32, 0, stream, data);
    else if (test == "exit_before_barrier") detail::launch(exit_before_barrier_kernel, 1, 32, 0, stream, data);
    else if (test == "shared_overflow") detail::launch(shared_overflow_kernel, 1, 32, 0, stream, data);
    else if (test == "shared_pointer_overflow") detail::launch(shared_pointer_overflow_kernel, 1, 32, 0, stream, data);
    else if (test == "dynamic_overflow") detail::launch(dynamic_overflow_kernel, 1, 64, dynamic, stream, data);
    else if (test == "shuffle_outside_mask") detail::launch(shuffle_outside_mask_kernel, 1, 32, 0, stream, data);
    else if (test == "shuffle_reads_outside_mask")
        detail::launch(shuffle_reads_outside_mask_kernel, 1, 32, 0, stream, data);
    else if (test == "shuffle_exited_lane") detail::launch(shuffle_exited_lane_kernel, 1, 32, 0, stream, data);
    else if (test == "global_overrun") detail::launch(global_overrun_kernel, 1, n, 0, stream, data);
    else if (test == "global_overread") detail::launch(global_overread_kernel, 1, n, 0, stream, data);
    else if (test == "bad_block") detail::launch(shuffle_kernel, 1, 2048, 0, stream, data);
    cudaError_t status = cudaGetLastError();
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
    std::strncpy(message, status == cudaSuccess ? "" : cudaGetErrorString(status), message_bytes - 1);
    message[message_bytes - 1] = 0;
    cudaMemcpyAsync(out, data, sizeof(int) * n, cudaMemcpyDeviceToHost, stream);
    cudaFree(data);
    cudaStreamDestroy(stream);
    nanoq_emu::set_seed(0, true);
    return static_cast<int>(status);
}
