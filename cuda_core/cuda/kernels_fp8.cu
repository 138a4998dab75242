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
#include <cuda_fp8.h>

#include <algorithm>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T> __global__ void absmax_kernel(float* amax, const T* x, std::int64_t n) {
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
                                std::int64_t n, Fp8Format format) {
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
                               int cols, Fp8Format format) {
    NANOQ_SHARED(float[kTile * (kTile + 1)], tile);  // +1: no bank conflicts on the transposed reads
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

}  // namespace

template <class T>
void fp8_quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, std::int64_t n, Fp8Format format,
                  cudaStream_t stream) {
    const int blocks = detail::grid_stride_blocks(n, kThreads);
    if (n > 0) detail::launch(absmax_kernel<T>, blocks, kThreads, 0, stream, amax, x, n);
    detail::launch(quantize_kernel<T>, blocks > 0 ? blocks : 1, kThreads, 0, stream, out, inverse_scale,
                   static_cast<const float*>(amax), x, n, format);
}

template <class T>
void fp8_quantize_transposed(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, int rows, int cols,
                             Fp8Format format, cudaStream_t stream) {
    const std::int64_t n = std::int64_t(rows) * cols;
    if (n > 0) detail::launch(absmax_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, amax, x, n);
    const dim3 grid(std::max(1, (cols + kTile - 1) / kTile), std::max(1, (rows + kTile - 1) / kTile));
    detail::launch(quantize_transposed_kernel<T>, grid, dim3(kTile, kTileLanes), 0, stream, out, inverse_scale,
                   static_cast<const float*>(amax), x, rows, cols, format);
}

#define NANOQ_INSTANTIATE(T)                                                                                        \
    template void fp8_quantize<T>(std::uint8_t*, float*, float*, const T*, std::int64_t, Fp8Format, cudaStream_t); \
    template void fp8_quantize_transposed<T>(std::uint8_t*, float*, float*, const T*, int, int, Fp8Format,          \
                                             cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
