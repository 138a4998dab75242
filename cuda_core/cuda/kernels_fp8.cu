// fp8 (e4m3) operands for the cuBLASLt matmuls, with current per-tensor
// scaling: the tensor's absolute maximum is taken first, then every element
// is multiplied by scale = 448 / amax (e4m3's largest finite value over the
// maximum, so the largest element lands on it), rounded to e4m3 (nearest
// even, saturating) and 1 / scale is written for cuBLASLt to dequantize with.
//
// The maximum is an atomicMax on the float's bits: for non-negative floats
// the bits order as the values do, so the result is exact and independent of
// the order the blocks run in. A NaN element is skipped by the maximum and
// stays NaN when quantized (it reaches the loss, whose step is then skipped).
#include <cuda_fp8.h>

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
__device__ __forceinline__ float fp8_scale(float amax) {
    return amax > 0.0f && isfinite(amax) ? kE4m3Max / amax : 1.0f;
}

template <class T>
__global__ void quantize_kernel(std::uint8_t* out, float* inverse_scale, const float* amax, const T* x,
                                std::int64_t n) {
    const float scale = fp8_scale(*amax);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inverse_scale = 1.0f / scale;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = __nv_cvt_float_to_fp8(detail::to_float(x[i]) * scale, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

template <class T>
void fp8_quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, std::int64_t n,
                  cudaStream_t stream) {
    const int blocks = detail::grid_stride_blocks(n, kThreads);
    if (n > 0) detail::launch(absmax_kernel<T>, blocks, kThreads, 0, stream, amax, x, n);
    detail::launch(quantize_kernel<T>, blocks > 0 ? blocks : 1, kThreads, 0, stream, out, inverse_scale,
                   static_cast<const float*>(amax), x, n);
}

#define NANOQ_INSTANTIATE(T) \
    template void fp8_quantize<T>(std::uint8_t*, float*, float*, const T*, std::int64_t, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
