// Elementwise ops, casts and the bias gradient.
//
// All elementwise kernels are grid-stride loops over int64 indices with a
// capped grid, so any tensor size launches a valid grid. The bias gradient
// goes through the chunked column sums of kernel_utils.cuh (fixed order).
#include "../dropout.h"
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T> __global__ void fill_kernel(T* data, float value, std::int64_t n) {
    const T converted = detail::from_float<T>(value);
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) data[i] = converted;
}

__global__ void cast_f32_to_bf16_kernel(bf16* out, const float* in, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void cast_bf16_to_f32_kernel(float* out, const bf16* in, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = __bfloat162float(in[i]);
}

template <class T> __global__ void add_kernel(T* out, const T* a, const T* b, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = detail::from_float<T>(detail::to_float(a[i]) + detail::to_float(b[i]));
}

template <class T> __global__ void accumulate_kernel(T* out, const T* a, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = detail::from_float<T>(detail::to_float(out[i]) + detail::to_float(a[i]));
}

template <class T>
__global__ void scale_dropout_kernel(T* out, const T* in, float scale, float drop, std::uint64_t site,
                                     const std::uint64_t* seed_base, std::int64_t n) {
    const float kept = drop > 0.0f ? scale / (1.0f - drop) : scale;
    const std::uint64_t seed = drop > 0.0f ? dropout_mask_seed(site, seed_base) : 0;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) {
        const bool keep = drop <= 0.0f || dropout_keep(seed, static_cast<std::uint64_t>(i), drop);
        out[i] = detail::from_float<T>(keep ? detail::to_float(in[i]) * kept : 0.0f);
    }
}

template <class T> __global__ void add_bias_kernel(T* out, const T* bias, std::int64_t n, int cols) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = detail::from_float<T>(detail::to_float(out[i]) + detail::to_float(bias[i % cols]));
}

template <class T> struct BiasGradTerm {
    const T* dout;
    int cols;
    __device__ float operator()(int r, int c) const {
        return detail::to_float(dout[static_cast<std::int64_t>(r) * cols + c]);
    }
};

}  // namespace

cudaError_t kernel_image_status() {
    cudaFuncAttributes attributes;
    const cudaError_t status = cudaFuncGetAttributes(&attributes, fill_kernel<float>);
    if (status != cudaSuccess) cudaGetLastError();
    return status;
}

template <class T> void fill(T* data, float value, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(fill_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, data, value, n);
}

void cast_f32_to_bf16(bf16* out, const float* in, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(cast_f32_to_bf16_kernel, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, in, n);
}

void cast_bf16_to_f32(float* out, const bf16* in, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(cast_bf16_to_f32_kernel, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, in, n);
}

template <class T> void add(T* out, const T* a, const T* b, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(add_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, a, b, n);
}

template <class T> void accumulate(T* out, const T* a, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(accumulate_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, a, n);
}

template <class T>
void scale_dropout(T* out, const T* in, float scale, float drop, std::uint64_t seed, const std::uint64_t* seed_base,
                   std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(scale_dropout_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, in, scale,
                   drop, seed, seed_base, n);
}

template <class T> void add_bias(T* out, const T* bias, int rows, int cols, cudaStream_t stream) {
    const std::int64_t n = static_cast<std::int64_t>(rows) * cols;
    if (n <= 0) return;
    detail::launch(add_bias_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, bias, n, cols);
}

template <class T>
void bias_backward(float* dbias, const T* dout, int rows, int cols, float* scratch, cudaStream_t stream) {
    detail::column_sums(dbias, rows, cols, scratch, BiasGradTerm<T>{dout, cols}, stream);
}

std::size_t bias_backward_scratch_floats(int rows, int cols) { return detail::column_sums_scratch_floats(rows, cols); }

#define NANOQ_INSTANTIATE(T)                                                                       \
    template void fill<T>(T*, float, std::int64_t, cudaStream_t);                                  \
    template void add<T>(T*, const T*, const T*, std::int64_t, cudaStream_t);                      \
    template void accumulate<T>(T*, const T*, std::int64_t, cudaStream_t);                         \
    template void scale_dropout<T>(T*, const T*, float, float, std::uint64_t, const std::uint64_t*, std::int64_t, \
                                   cudaStream_t);                                                  \
    template void add_bias<T>(T*, const T*, int, int, cudaStream_t);                               \
    template void bias_backward<T>(float*, const T*, int, int, float*, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE
template void fill<double>(double*, float, std::int64_t, cudaStream_t);  // the float64 statistics

}  // namespace cuda
}  // namespace nanoq
