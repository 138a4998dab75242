// RMSNorm forward and backward, one block per row.
//
// The backward launches the weight gradient (chunked column sums through
// scratch, fixed order) before the input gradient, because dinp may alias
// dout. Within a row, each thread writes only the elements it read, after the
// block reduction barrier, so the in-place input gradient is safe too.
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight, int channels, float eps) {
    NANOQ_SHARED(float[detail::kWarpSize], reduce_space);
    const std::int64_t offset = static_cast<std::int64_t>(blockIdx.x) * channels;
    const T* x = inp + offset;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        const float value = detail::to_float(x[c]);
        sum += value * value;
    }
    sum = detail::block_sum(sum, reduce_space);
    const float scale = 1.0f / sqrtf(sum / channels + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = scale;
    T* o = out + offset;
    for (int c = threadIdx.x; c < channels; c += blockDim.x)
        o[c] = detail::from_float<T>(detail::to_float(weight[c]) * (detail::to_float(x[c]) * scale));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* rstd,
                                  int channels, bool accumulate) {
    NANOQ_SHARED(float[detail::kWarpSize], reduce_space);
    const std::int64_t offset = static_cast<std::int64_t>(blockIdx.x) * channels;
    const T* dy = dout + offset;
    const T* x = inp + offset;
    const float scale = rstd[blockIdx.x];
    float dot = 0.0f;
    for (int c = threadIdx.x; c < channels; c += blockDim.x)
        dot += detail::to_float(dy[c]) * detail::to_float(weight[c]) * detail::to_float(x[c]) * scale;
    dot = detail::block_sum(dot, reduce_space) / channels;
    T* dx = dinp + offset;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        const float xc = detail::to_float(x[c]);
        float grad = scale * (detail::to_float(dy[c]) * detail::to_float(weight[c]) - xc * scale * dot);
        if (accumulate) grad += detail::to_float(dx[c]);
        dx[c] = detail::from_float<T>(grad);
    }
}

template <class T> struct WeightGradTerm {
    const T* dout;
    const T* inp;
    const float* rstd;
    int cols;
    __device__ float operator()(int r, int c) const {
        const std::int64_t i = static_cast<std::int64_t>(r) * cols + c;
        return detail::to_float(dout[i]) * detail::to_float(inp[i]) * rstd[r];
    }
};

}  // namespace

template <class T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int rows, int channels, float eps,
                     cudaStream_t stream) {
    if (rows <= 0 || channels <= 0) return;
    detail::launch(rmsnorm_forward_kernel<T>, rows, kThreads, 0, stream, out, rstd, inp, weight, channels, eps);
}

template <class T>
void rmsnorm_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight, const float* rstd,
                      int rows, int channels, bool accumulate, float* scratch, cudaStream_t stream) {
    if (rows <= 0 || channels <= 0) return;
    detail::column_sums(dweight, rows, channels, scratch, WeightGradTerm<T>{dout, inp, rstd, channels}, stream);
    detail::launch(rmsnorm_backward_input_kernel<T>, rows, kThreads, 0, stream, dinp, dout, inp, weight, rstd, channels,
                                                                    accumulate);
}

std::size_t rmsnorm_backward_scratch_floats(int rows, int channels) {
    return detail::column_sums_scratch_floats(rows, channels);
}

#define NANOQ_INSTANTIATE(T)                                                                                       \
    template void rmsnorm_forward<T>(T*, float*, const T*, const T*, int, int, float, cudaStream_t);               \
    template void rmsnorm_backward<T>(T*, float*, const T*, const T*, const T*, const float*, int, int, bool, float*, \
                                      cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
