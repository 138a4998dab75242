// SwiGLU: out = silu(gate) * up, and its gradient.
//
// Each thread loads all of its inputs for a chunk of elements before writing
// either gradient, which is what makes dgate aliasing dout safe. The loads
// and stores are 16-byte vectors (4 fp32 or 8 bf16) when the tensors are
// aligned; the arithmetic per element is the same either way.
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
template <class T> __global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, std::int64_t n, bool vector) {
    constexpr int P = detail::kPack<T>;
    for (std::int64_t i = detail::grid_stride_begin() * P; i < n; i += detail::grid_stride_step() * P) {
        const bool whole = vector && i + P <= n;
        float g[P], u[P], y[P];
        detail::load_chunk<T>(g, gate, i, n, whole);
        detail::load_chunk<T>(u, up, i, n, whole);
        for (int j = 0; j < P; ++j) y[j] = silu_times(g[j], u[j]);
        detail::store_chunk<T>(out, y, i, n, whole);
    }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n,
                                       bool vector) {
    constexpr int P = detail::kPack<T>;
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
    }
}

bool all_aligned(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (!detail::aligned16(p)) return false;
    return true;
}

template <class T> int chunk_blocks(std::int64_t n) {
    return detail::grid_stride_blocks((n + detail::kPack<T> - 1) / detail::kPack<T>, kThreads);
}

}  // namespace

template <class T> void swiglu_forward(T* out, const T* gate, const T* up, std::int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_forward_kernel<T>, chunk_blocks<T>(n), kThreads, 0, stream, out, gate, up, n,
                   all_aligned({out, gate, up}));
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n,
                     cudaStream_t stream) {
    if (n <= 0) return;
    detail::launch(swiglu_backward_kernel<T>, chunk_blocks<T>(n), kThreads, 0, stream, dgate, dup, dout, gate, up, n,
                   all_aligned({dgate, dup, dout, gate, up}));
}

#define NANOQ_INSTANTIATE(T)                                                                              \
    template void swiglu_forward<T>(T*, const T*, const T*, std::int64_t, cudaStream_t);                  \
    template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, std::int64_t, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
