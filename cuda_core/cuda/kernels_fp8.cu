// fp8 operands for the cuBLASLt matmuls, with current per-tensor scaling:
// the tensor's absolute maximum is taken first, then every element is
// multiplied by scale = max / amax (the format's largest finite value, 448
// for e4m3 and 57344 for e5m2, over the maximum, so the largest element
// lands on it), rounded to the format (nearest even, saturating) and
// 1 / scale is written for cuBLASLt to dequantize with. The transposing
// variant writes x[rows, cols] as out[cols, rows] through a shared-memory
// tile, so that both the reads and the writes are coalesced: cuBLASLt's fp8
// kernels take only K-contiguous operands, and the backward's products
// consume dy, W and x along another dimension than they are stored.
//
// The maximum is an atomicMax on the float's bits: for non-negative floats
// the bits order as the values do, so the result is exact and independent of
// the order the blocks run in. A NaN element is skipped by the maximum and
// stays NaN when quantized (it reaches the loss, whose step is then skipped).
//
// The weight cache's variant (fp8_quantize_cached) launches the same kernels
// with a slot's stamp and the cache's generation: each kernel returns at
// once when they are equal, so a current slot costs a few empty launches,
// and the decision is the device's (a replayed graph makes it anew).
#include <cuda_fp8.h>

#include <algorithm>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The weight cache's check (fp8_quantize_cached): with a stamp, a kernel
// does nothing when the slot is current (its stamp equals the generation).
__device__ __forceinline__ bool current(const unsigned* stamp, const unsigned* generation) {
    return stamp && *stamp == *generation;
}

template <class T>
__global__ void absmax_kernel(float* amax, const T* x, std::int64_t n, const unsigned* stamp,
                              const unsigned* generation) {
    if (current(stamp, generation)) return;
    float m = 0.0f;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        m = fmaxf(m, fabsf(detail::to_float(x[i])));
    m = detail::warp_max(m);
    if (threadIdx.x % detail::kWarpSize == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

// The scale for a maximum: 1 where there is nothing to scale (all zeros) or
// the maximum is not finite.
__device__ __forceinline__ float fp8_scale(float amax, Fp8Format format) {
    const float largest = format == Fp8Format::E4M3 ? kE4m3Max : kE5m2Max;
    return amax > 0.0f && isfinite(amax) ? largest / amax : 1.0f;
}

__device__ __forceinline__ std::uint8_t to_fp8(float scaled, Fp8Format format) {
    return __nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, format == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <class T>
__global__ void quantize_kernel(std::uint8_t* out, float* inverse_scale, const float* amax, const T* x,
                                std::int64_t n, Fp8Format format, const unsigned* stamp, const unsigned* generation) {
    if (current(stamp, generation)) return;
    const float scale = fp8_scale(*amax, format);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inverse_scale = 1.0f / scale;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = to_fp8(detail::to_float(x[i]) * scale, format);
}

// One kTile x kTile tile per block, kTile x kTileLanes threads: each reads
// kTile / kTileLanes rows of the tile (consecutive threads, consecutive
// columns) and writes as many of its transpose (consecutive rows).
constexpr int kTile = 32, kTileLanes = 8;

template <class T>
__global__ void __launch_bounds__(kTile * kTileLanes)
    quantize_transposed_kernel(std::uint8_t* out, float* inverse_scale, const float* amax, const T* x, int rows,
                               int cols, Fp8Format format, const unsigned* stamp, const unsigned* generation) {
    NANOQ_SHARED(float[kTile * (kTile + 1)], tile);  // +1: no bank conflicts on the transposed reads
    if (current(stamp, generation)) return;  // the whole block returns: no thread waits at the barrier
    const float scale = fp8_scale(*amax, format);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *inverse_scale = 1.0f / scale;
    const int first_col = blockIdx.x * kTile, first_row = blockIdx.y * kTile;
    for (int i = threadIdx.y; i < kTile; i += kTileLanes) {
        const int r = first_row + i, c = first_col + threadIdx.x;
        if (r < rows && c < cols) tile[i * (kTile + 1) + threadIdx.x] = detail::to_float(x[std::int64_t(r) * cols + c]);
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTile; i += kTileLanes) {
        const int c = first_col + i, r = first_row + threadIdx.x;  // out[c, r] = x[r, c]
        if (r < rows && c < cols)
            out[std::int64_t(c) * rows + r] = to_fp8(tile[threadIdx.x * (kTile + 1) + i] * scale, format);
    }
}

// One thread: a stale slot's maximum restarts from 0.
__global__ void restart_kernel(float* amax, const unsigned* stamp, const unsigned* generation) {
    if (!current(stamp, generation)) *amax = 0.0f;
}

// One thread, after the slot's quantization: the slot is current. A kernel
// of its own, so that no block of the quantization sees the new stamp early.
__global__ void stamp_kernel(unsigned* stamp, const unsigned* generation) { *stamp = *generation; }

__global__ void advance_kernel(unsigned* generation) { *generation += 1; }

template <class T>
void quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, int rows, int cols, bool transposed,
              Fp8Format format, const unsigned* stamp, const unsigned* generation, cudaStream_t stream) {
    const std::int64_t n = std::int64_t(rows) * cols;
    const int blocks = detail::grid_stride_blocks(n, kThreads);
    if (n > 0) detail::launch(absmax_kernel<T>, blocks, kThreads, 0, stream, amax, x, n, stamp, generation);
    if (transposed) {
        const dim3 grid(std::max(1, (cols + kTile - 1) / kTile), std::max(1, (rows + kTile - 1) / kTile));
        detail::launch(quantize_transposed_kernel<T>, grid, dim3(kTile, kTileLanes), 0, stream, out, inverse_scale,
                       static_cast<const float*>(amax), x, rows, cols, format, stamp, generation);
    } else {
        detail::launch(quantize_kernel<T>, blocks > 0 ? blocks : 1, kThreads, 0, stream, out, inverse_scale,
                       static_cast<const float*>(amax), x, n, format, stamp, generation);
    }
}

}  // namespace

template <class T>
void fp8_quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, std::int64_t n, Fp8Format format,
                  cudaStream_t stream) {
    // One row of n (the plain kernel never looks at rows and cols apart).
    const int blocks = detail::grid_stride_blocks(n, kThreads);
    if (n > 0) detail::launch(absmax_kernel<T>, blocks, kThreads, 0, stream, amax, x, n, nullptr, nullptr);
    detail::launch(quantize_kernel<T>, blocks > 0 ? blocks : 1, kThreads, 0, stream, out, inverse_scale,
                   static_cast<const float*>(amax), x, n, format, nullptr, nullptr);
}

template <class T>
void fp8_quantize_transposed(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, int rows, int cols,
                             Fp8Format format, cudaStream_t stream) {
    quantize<T>(out, amax, inverse_scale, x, rows, cols, true, format, nullptr, nullptr, stream);
}

template <class T>
void fp8_quantize_cached(std::uint8_t* out, float* amax, float* inverse_scale, unsigned* stamp,
                         const unsigned* generation, const T* x, int rows, int cols, bool transposed,
                         cudaStream_t stream) {
    detail::launch(restart_kernel, 1, 1, 0, stream, amax, static_cast<const unsigned*>(stamp), generation);
    quantize<T>(out, amax, inverse_scale, x, rows, cols, transposed, Fp8Format::E4M3, stamp, generation, stream);
    detail::launch(stamp_kernel, 1, 1, 0, stream, stamp, generation);
}

void fp8_advance_generation(unsigned* generation, cudaStream_t stream) {
    detail::launch(advance_kernel, 1, 1, 0, stream, generation);
}

#define NANOQ_INSTANTIATE(T)                                                                                        \
    template void fp8_quantize<T>(std::uint8_t*, float*, float*, const T*, std::int64_t, Fp8Format, cudaStream_t); \
    template void fp8_quantize_transposed<T>(std::uint8_t*, float*, float*, const T*, int, int, Fp8Format,          \
                                             cudaStream_t);                                                        \
    template void fp8_quantize_cached<T>(std::uint8_t*, float*, float*, unsigned*, const unsigned*, const T*, int, \
                                         int, bool, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
