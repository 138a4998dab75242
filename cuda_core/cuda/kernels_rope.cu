// Rotary position embedding, in place, half-split convention.
//
// One thread per rotated pair (x[i], x[i + D/2]): it reads both values before
// writing either, so the in-place update needs no synchronization. The
// backward is the same rotation with the sine negated.
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void rope_kernel(T* x, const float* cos_sin, std::int64_t pairs, int time, int heads, int half,
                            float direction) {
    for (std::int64_t i = detail::grid_stride_begin(); i < pairs; i += detail::grid_stride_step()) {
        const std::int64_t head_row = i / half;  // (b * time + t) * heads + h
        const int pair = static_cast<int>(i - head_row * half);
        const int t = static_cast<int>((head_row / heads) % time);
        const float* cs = cos_sin + (static_cast<std::int64_t>(t) * half + pair) * 2;
        const float c = cs[0], s = direction * cs[1];
        T* xh = x + head_row * 2 * half;
        const float a = detail::to_float(xh[pair]), b = detail::to_float(xh[pair + half]);
        xh[pair] = detail::from_float<T>(a * c - b * s);
        xh[pair + half] = detail::from_float<T>(b * c + a * s);
    }
}

template <class T>
void rotate(T* x, const float* cos_sin, int batch, int time, int heads, int head_dim, float direction,
            cudaStream_t stream) {
    const int half = head_dim / 2;
    const std::int64_t pairs = static_cast<std::int64_t>(batch) * time * heads * half;
    if (pairs <= 0) return;
    detail::launch(rope_kernel<T>, detail::grid_stride_blocks(pairs, kThreads), kThreads, 0, stream, x, cos_sin, pairs, time,
                                                                                        heads, half, direction);
}

}  // namespace

template <class T>
void rope_forward(T* x, const float* cos_sin, int batch, int time, int heads, int head_dim, cudaStream_t stream) {
    rotate(x, cos_sin, batch, time, heads, head_dim, 1.0f, stream);
}

template <class T>
void rope_backward(T* dx, const float* cos_sin, int batch, int time, int heads, int head_dim, cudaStream_t stream) {
    rotate(dx, cos_sin, batch, time, heads, head_dim, -1.0f, stream);
}

#define NANOQ_INSTANTIATE(T)                                                                  \
    template void rope_forward<T>(T*, const float*, int, int, int, int, cudaStream_t);        \
    template void rope_backward<T>(T*, const float*, int, int, int, int, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
