// RMSNorm forward (optionally fused with the residual add before it) and
// backward with its weight gradient, one kernel each.
//
// Rows stream through 16-byte chunks (kernel_utils.cuh: 4 fp32 or 8 bf16
// elements per load, element-wise when a row is not aligned): thread t of a
// row's block owns chunks t, t + threads, ..., holds them in registers
// between the sum of squares and the normalisation, and writes only the
// elements it read. The thread count and the chunk mapping depend on the
// channel count alone, so rmsnorm_forward and residual_rmsnorm_forward give
// bitwise the same norm of the same sum (recompute reruns the norm alone).
//
// The backward runs a grid of blocks over the rows that depends on the shape
// alone (rows and channels, never the GPU, so results are the same on every
// device): 2^21 row elements in flight over all blocks, i.e. some 256K
// threads of 8 bf16 elements, as many as an H200's 132 SMs hold at most
// (2048 each), and at least 4 rows per block. (Before: 512 blocks, at C = 896 in
// bf16 512 x 128 threads, a quarter of the resident threads, each block
// taking its 16 rows one after another with a barrier per row.) Each block
// keeps its weight-gradient partials in registers and writes them out, and
// the deterministic column sums (kernel_utils.cuh: column_sums, two small
// launches over the many-SM grid) add them in block order, so the result is
// reproducible without float atomics. A thread reads dout and inp of its
// elements before the row's reduction and writes dinp after it, which makes
// dinp aliasing dout (without accumulate) safe.
//
// Optionally the forward's out and the backward's dinp have their largest
// magnitude taken on the way (kernels.h), for fp8's current scaling.
#include <algorithm>
#include <initializer_list>
#include <string>

#include "kernel_utils.cuh"
#include "kernels.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kMaxChunks = 8;        // per thread: rows up to 8 * 1024 chunks
constexpr int kBackwardElements = 1 << 21;  // the backward grid: row elements in flight, over all blocks
constexpr int kBackwardRowsPerBlock = 4;    // and at least this many rows per block

// A row's block: threads (a multiple of 32) and chunks per thread (1, 2, 4, 8).
struct RowLayout {
    int threads, chunks;
};

template <class T> RowLayout row_layout(int channels) {
    const int total = (channels + detail::kPack<T> - 1) / detail::kPack<T>;
    if (total > kMaxThreads * kMaxChunks)
        throw InvalidArgument("rmsnorm of " + std::to_string(channels) + " channels: at most " +
                              std::to_string(kMaxThreads * kMaxChunks * detail::kPack<T>) + " are supported");
    const int threads = std::min(kMaxThreads, (total + detail::kWarpSize - 1) / detail::kWarpSize * detail::kWarpSize);
    int chunks = (total + threads - 1) / threads;
    chunks = chunks <= 1 ? 1 : chunks <= 2 ? 2 : chunks <= 4 ? 4 : 8;
    return {threads, chunks};
}

bool rows_vectorizable(int channels, int pack, std::initializer_list<const void*> pointers) {
    if (channels % pack != 0) return false;
    for (const void* p : pointers)
        if (p && !detail::aligned16(p)) return false;
    return true;
}

// residual_out = residual + delta (when delta is given; residual_out may
// alias either), then out = weight * x * rstd of x = residual_out (or of
// residual alone without delta). Both kernels are bounded for the largest
// block, so that the register arrays of 4 or 8 chunks spill rather than make
// the launch fail.
template <class T, int kChunks>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_forward_kernel(T* out, float* rstd, T* residual_out, const T* residual, const T* delta, const T* weight,
                           int channels, float eps, bool vector, float* out_max) {
    NANOQ_SHARED(float[detail::kWarpSize], reduce_space);
    constexpr int P = detail::kPack<T>;
    const std::int64_t offset = static_cast<std::int64_t>(blockIdx.x) * channels;
    float x[kChunks][P];
    float sum = 0.0f;
    for (int k = 0; k < kChunks; ++k) {
        const int begin = (k * blockDim.x + threadIdx.x) * P;
        if (begin >= channels) {
            for (int j = 0; j < P; ++j) x[k][j] = 0.0f;
            continue;
        }
        detail::load_chunk<T>(x[k], residual + offset, begin, channels, vector);
        if (delta) {
            float d[P];
            detail::load_chunk<T>(d, delta + offset, begin, channels, vector);
            for (int j = 0; j < P; ++j) x[k][j] = detail::rounded<T>(x[k][j] + d[j]);
            detail::store_chunk<T>(residual_out + offset, x[k], begin, channels, vector);
        }
        for (int j = 0; j < P; ++j) sum += x[k][j] * x[k][j];
    }
    sum = detail::block_sum(sum, reduce_space);
    const float scale = 1.0f / sqrtf(sum / channels + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = scale;
    float m = 0.0f;
    for (int k = 0; k < kChunks; ++k) {
        const int begin = (k * blockDim.x + threadIdx.x) * P;
        if (begin >= channels) continue;
        float w[P], y[P];
        detail::load_chunk<T>(w, weight, begin, channels, vector);
        for (int j = 0; j < P; ++j) y[j] = w[j] * (x[k][j] * scale);
        detail::store_chunk<T>(out + offset, y, begin, channels, vector);
        if (out_max) m = detail::chunk_max<T>(m, y, channels - begin);
    }
    if (out_max) detail::block_max_into(out_max, m, reduce_space);  // out_max is the grid's: all threads or none
}

template <class T, int kChunks>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_backward_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* rstd, int rows,
                            int channels, bool accumulate, bool vector, float* partials, float* dinp_max) {
    NANOQ_SHARED(float[detail::kWarpSize], reduce_space);
    constexpr int P = detail::kPack<T>;
    float w[kChunks][P], dw[kChunks][P];
    for (int k = 0; k < kChunks; ++k) {
        const int begin = (k * blockDim.x + threadIdx.x) * P;
        for (int j = 0; j < P; ++j) w[k][j] = dw[k][j] = 0.0f;
        if (begin < channels) detail::load_chunk<T>(w[k], weight, begin, channels, vector);
    }
    float m = 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const std::int64_t offset = static_cast<std::int64_t>(r) * channels;
        const float scale = rstd[r];
        float dy[kChunks][P], x[kChunks][P];
        float dot = 0.0f;
        for (int k = 0; k < kChunks; ++k) {
            const int begin = (k * blockDim.x + threadIdx.x) * P;
            if (begin >= channels) continue;
            detail::load_chunk<T>(dy[k], dout + offset, begin, channels, vector);
            detail::load_chunk<T>(x[k], inp + offset, begin, channels, vector);
            for (int j = 0; j < P; ++j) dot += dy[k][j] * w[k][j] * x[k][j] * scale;
        }
        dot = detail::block_sum(dot, reduce_space) / channels;
        for (int k = 0; k < kChunks; ++k) {
            const int begin = (k * blockDim.x + threadIdx.x) * P;
            if (begin >= channels) continue;
            float dx[P];
            if (accumulate) detail::load_chunk<T>(dx, dinp + offset, begin, channels, vector);
            for (int j = 0; j < P; ++j) {
                const float grad = scale * (dy[k][j] * w[k][j] - x[k][j] * scale * dot);
                dx[j] = accumulate ? grad + dx[j] : grad;
                dw[k][j] += dy[k][j] * x[k][j] * scale;
            }
            detail::store_chunk<T>(dinp + offset, dx, begin, channels, vector);
            if (dinp_max) m = detail::chunk_max<T>(m, dx, channels - begin);
        }
    }
    if (dinp_max) detail::block_max_into(dinp_max, m, reduce_space);
    float* mine = partials + static_cast<std::int64_t>(blockIdx.x) * channels;
    for (int k = 0; k < kChunks; ++k) {
        const int begin = (k * blockDim.x + threadIdx.x) * P;
        for (int j = 0; j < P; ++j)
            if (begin + j < channels) mine[begin + j] = dw[k][j];
    }
}

int backward_blocks(int rows, int channels) {
    const int by_rows = (rows + kBackwardRowsPerBlock - 1) / kBackwardRowsPerBlock;
    return std::max(1, std::min(by_rows, kBackwardElements / channels));
}

template <class T>
void launch_forward(T* out, float* rstd, T* residual_out, const T* residual, const T* delta, const T* weight,
                    int rows, int channels, float eps, float* out_max, cudaStream_t stream) {
    if (rows <= 0 || channels <= 0) return;
    const RowLayout layout = row_layout<T>(channels);
    const bool vector = rows_vectorizable(channels, detail::kPack<T>, {out, residual_out, residual, delta, weight});
    auto go = [&](auto kernel) {
        detail::launch(kernel, rows, layout.threads, 0, stream, out, rstd, residual_out, residual, delta, weight,
                       channels, eps, vector, out_max);
    };
    switch (layout.chunks) {
        case 1: go(rmsnorm_forward_kernel<T, 1>); break;
        case 2: go(rmsnorm_forward_kernel<T, 2>); break;
        case 4: go(rmsnorm_forward_kernel<T, 4>); break;
        default: go(rmsnorm_forward_kernel<T, 8>); break;
    }
}

}  // namespace

template <class T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int rows, int channels, float eps,
                     float* out_max, cudaStream_t stream) {
    launch_forward<T>(out, rstd, nullptr, inp, nullptr, weight, rows, channels, eps, out_max, stream);
}

template <class T>
void residual_rmsnorm_forward(T* residual_out, T* out, float* rstd, const T* residual, const T* delta,
                              const T* weight, int rows, int channels, float eps, float* out_max,
                              cudaStream_t stream) {
    launch_forward<T>(out, rstd, residual_out, residual, delta, weight, rows, channels, eps, out_max, stream);
}

template <class T>
void rmsnorm_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight, const float* rstd,
                      int rows, int channels, bool accumulate, float* dinp_max, void* scratch, cudaStream_t stream) {
    if (rows <= 0 || channels <= 0) return;
    const RowLayout layout = row_layout<T>(channels);
    const bool vector = rows_vectorizable(channels, detail::kPack<T>, {dinp, dout, inp, weight});
    const int blocks = backward_blocks(rows, channels);
    float* partials = static_cast<float*>(scratch);  // [blocks, channels], then column_sums' own scratch
    auto go = [&](auto kernel) {
        detail::launch(kernel, blocks, layout.threads, 0, stream, dinp, dout, inp, weight, rstd, rows, channels,
                       accumulate, vector, partials, dinp_max);
    };
    switch (layout.chunks) {
        case 1: go(rmsnorm_backward_kernel<T, 1>); break;
        case 2: go(rmsnorm_backward_kernel<T, 2>); break;
        case 4: go(rmsnorm_backward_kernel<T, 4>); break;
        default: go(rmsnorm_backward_kernel<T, 8>); break;
    }
    detail::column_sums(dweight, blocks, channels, partials + static_cast<std::int64_t>(blocks) * channels,
                        detail::MatrixColumns{partials, channels, 0}, stream);
}

std::size_t rmsnorm_backward_scratch_bytes(int rows, int channels) {
    if (rows <= 0 || channels <= 0) return 0;
    const int blocks = backward_blocks(rows, channels);
    return sizeof(float) * (static_cast<std::size_t>(blocks) * channels +
                            detail::column_sums_scratch_floats(blocks, channels));
}

#define NANOQ_INSTANTIATE(T)                                                                                     \
    template void rmsnorm_forward<T>(T*, float*, const T*, const T*, int, int, float, float*, cudaStream_t);     \
    template void residual_rmsnorm_forward<T>(T*, T*, float*, const T*, const T*, const T*, int, int, float,    \
                                              float*, cudaStream_t);                                             \
    template void rmsnorm_backward<T>(T*, float*, const T*, const T*, const T*, const float*, int, int, bool,   \
                                      float*, void*, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
