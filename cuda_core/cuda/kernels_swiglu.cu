// SwiGLU: out = silu(gate) * up, and its gradient.
//
// Each thread loads all of its inputs for a chunk of elements before writing
// either gradient, which is what makes dgate aliasing dout safe. The loads
// and stores are 16-byte vectors (4 fp32 or 8 bf16) when the tensors are
// aligned; the arithmetic per element is the same either way. Optionally
// each output's largest magnitude (kernels.h) is taken on the way, for fp8.
#include <initializer_list>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Thread i handles the chunk of elements [i * P, i * P + P) (kernel_utils.cuh),
// with 16-byte accesses when the tensors are aligned (the last, partial
// chunk element by element).
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, std::int64_t n, bool vector,
                                      float* out_max) {
    NANOQ_SHARED(float[detail::kWarpSize], maxima);
    constexpr int P = detail::kPack<T>;
    float m = 0.0f;
    for (std::int64_t i = detail::grid_stride_begin() * P; i < n; i += detail::grid_stride_step() * P) {
        const bool whole = vector && i + P <= n;
        float g[P], u[P], y[P];
        detail::load_chunk<T>(g, gate, i, n, whole);
        detail::load_chunk<T>(u, up, i, n, whole);
        for (int j = 0; j < P; ++j) y[j] = silu_times(g[j], u[j]);
        detail::store_chunk<T>(out, y, i, n, whole);
        if (out_max) m = detail::chunk_max<T>(m, y, n - i);
    }
    if (out_max) detail::block_max_into(out_max, m, maxima);  // out_max is the grid's: all threads or none
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n,
                                       bool vector, float* dgate_max, float* dup_max) {
    NANOQ_SHARED(float[detail::kWarpSize], maxima);
    constexpr int P = detail::kPack<T>;
    float mg = 0.0f, mu = 0.0f;
    for (std::int64_t i = detail::grid_stride_begin() * P; i < n; i += detail::grid_stride_step() * P) {
        const bool whole = vector && i + P <= n;
        float g[P], u[P], d[P], dg[P], du[P];
        detail::load_chunk<T>(g, gate, i, n, whole);
        detail::load_chunk<T>(u, up, i, n, whole);
        detail::load_chunk<T>(d, dout, i, n, whole);
        for (int j = 0; j < P; ++j) {
            const float sig = 1.0f / (1.0f + expf(-g[j]));
            const float silu = g[j] * sig;
            du[j] = d[j] * silu;
            dg[j] = d[j] * u[j] * (sig + silu * (1.0f - sig));
        }
        detail::store_chunk<T>(dup, du, i, n, whole);
        detail::store_chunk<T>(dgate, dg, i, n, whole);
        if (dgate_max) mg = detail::chunk_max<T>(mg, dg, n - i);
        if (dup_max) mu = detail::chunk_max<T>(mu, du, n - i);
    }
    if (dgate_max) detail::block_max_into(dgate_max, mg, maxima);
    if (dup_max) detail::block_max_into(dup_max, mu, maxima);
}

bool all_aligned(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (!detail::aligned16(p)) return false;
    return true;
}

// With maxima wanted the grid is at most kMaxBlocksWithMaxima blocks (each
// adds one atomic per maximum on one address, and those are serialised);
// 2048 x 256 threads still fill an H200 twice over.
constexpr int kMaxBlocksWithMaxima = 2048;

template <class T> int chunk_blocks(std::int64_t n, bool with_maxima) {
    const int blocks = detail::grid_stride_blocks((n + detail::kPack<T> - 1) / detail::kPack<T>, kThreads);
    return with_maxima && blocks > kMaxBlocksWithMaxima ? kMaxBlocksWithMaxima : blocks;
}

}  // namespace

template <class T>
void swiglu_forward(T* out, const T* gate, const T* up, std::int64_t n, float* out_max, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_forward_kernel<T>, chunk_blocks<T>(n, out_max != nullptr), kThreads, 0, stream, out, gate,
                   up, n, all_aligned({out, gate, up}), out_max);
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n, float* dgate_max,
                     float* dup_max, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_backward_kernel<T>, chunk_blocks<T>(n, dgate_max || dup_max), kThreads, 0, stream, dgate,
                   dup, dout, gate, up, n, all_aligned({dgate, dup, dout, gate, up}), dgate_max, dup_max);
}

#define NANOQ_INSTANTIATE(T)                                                                              \
    template void swiglu_forward<T>(T*, const T*, const T*, std::int64_t, float*, cudaStream_t);              \
    template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, std::int64_t, float*, float*,      \
                                     cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
