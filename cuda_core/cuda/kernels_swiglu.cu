// SwiGLU: out = silu(gate) * up, and its gradient.
//
// Each thread loads all of its inputs for an element before writing either
// gradient, which is what makes dgate aliasing dout safe.
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T> __global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) {
        const float g = detail::to_float(gate[i]);
        out[i] = detail::from_float<T>(g / (1.0f + expf(-g)) * detail::to_float(up[i]));
    }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) {
        const float g = detail::to_float(gate[i]);
        const float u = detail::to_float(up[i]);
        const float d = detail::to_float(dout[i]);
        const float sig = 1.0f / (1.0f + expf(-g));
        const float silu = g * sig;
        dup[i] = detail::from_float<T>(d * silu);
        dgate[i] = detail::from_float<T>(d * u * (sig + silu * (1.0f - sig)));
    }
}

}  // namespace

template <class T> void swiglu_forward(T* out, const T* gate, const T* up, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_forward_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, gate, up, n);
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n,
                     cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_backward_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, dgate, dup, dout,
                                                                                               gate, up, n);
}

#define NANOQ_INSTANTIATE(T)                                                                              \
    template void swiglu_forward<T>(T*, const T*, const T*, std::int64_t, cudaStream_t);                  \
    template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, std::int64_t, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
