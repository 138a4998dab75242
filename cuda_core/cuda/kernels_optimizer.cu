// Gradient sum of squares, the optimizer's scale factor and AdamW.
//
// sum_squares uses a fixed number of blocks (a function of n only), each with
// a fixed element assignment and a fixed reduction tree, then one block adds
// the per-block partials in a fixed order: bitwise reproducible. AdamW
// computes in fp32 and writes bf16 values with stochastic rounding, drawing
// one 64-bit counter-based hash per element and taking disjoint 16-bit slices
// of it for the parameter, m and v.
#include <cmath>

#include "../adamw_slots.h"
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kShardElementsPerThread = 8;
constexpr std::int64_t kSumSquaresMaxBlocks = 1024;
constexpr int kElementsPerThread = 8;

int sum_squares_blocks(std::int64_t n) {
    const std::int64_t per_block = static_cast<std::int64_t>(kThreads) * kElementsPerThread;
    const std::int64_t blocks = (n + per_block - 1) / per_block;
    return static_cast<int>(blocks < kSumSquaresMaxBlocks ? blocks : kSumSquaresMaxBlocks);
}

__global__ void __launch_bounds__(kThreads) sum_squares_partial_kernel(float* partial, const float* x, std::int64_t n) {
    NANOQ_SHARED(double[detail::kWarpSize], reduce_space);
    double acc = 0.0;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) {
        const double value = x[i];
        acc += value * value;
    }
    acc = detail::block_sum(acc, reduce_space);
    if (threadIdx.x == 0) partial[blockIdx.x] = static_cast<float>(acc);
}

__global__ void __launch_bounds__(kThreads) sum_squares_total_kernel(StatValue* out, const float* partial, int blocks) {
    NANOQ_SHARED(double[detail::kWarpSize], reduce_space);
    double acc = 0.0;
    for (int i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
    acc = detail::block_sum(acc, reduce_space);
    if (threadIdx.x == 0) out[0] += acc;
}

// Mirrors the host computation in Trainer::update(), in double.
__global__ void optimizer_scale_kernel(float* out, const StatValue* gathered, int ranks, int stride,
                                       const double* grad_clip_value) {
    const float grad_clip = static_cast<float>(grad_clip_value[0]);
    double tokens = 0.0, squares = 0.0, loss = 0.0;
    for (int r = 0; r < ranks; ++r) {
        const StatValue* row = gathered + static_cast<std::int64_t>(r) * stride;
        tokens += row[kTokens];
        squares += row[kSumSquaresSlot];
        loss += row[kLossSum];
    }
    const std::int64_t token_count = static_cast<std::int64_t>(tokens);
    // No counted token skips the update too (see Backend::optimizer_scale).
    out[2] = token_count && isfinite(squares) && isfinite(loss) ? 0.0f : 1.0f;
    const double inv_tokens = token_count ? 1.0 / static_cast<double>(token_count) : 0.0;
    const double norm = sqrt(squares) * inv_tokens;
    double clip = 1.0;
    if (grad_clip > 0.0f && norm > grad_clip) clip = grad_clip / norm;
    out[0] = static_cast<float>(inv_tokens * clip);
    out[1] = static_cast<float>(norm);
}

template <class T> __device__ __forceinline__ T store_value(float x, std::uint32_t random16);
template <> __device__ __forceinline__ float store_value<float>(float x, std::uint32_t) { return x; }
template <> __device__ __forceinline__ bf16 store_value<bf16>(float x, std::uint32_t random16) {
    return detail::bf16_stochastic(x, random16);
}

struct AdamWConstants {
    float beta1, beta2, eps, step_size, decay, bias2_sqrt;
};

// The key of a chunk's rounding noise: element i of the chunk draws
// splitmix64(key + i).
__host__ __device__ __forceinline__ std::uint64_t adamw_stream_key(std::uint64_t chunk_seed, int step) {
    const std::uint64_t step_key = detail::splitmix64(static_cast<std::uint64_t>(static_cast<std::uint32_t>(step)));
    return detail::splitmix64(chunk_seed ^ step_key);
}

// One element's update, shared by both kernels so that they round alike;
// returns the stored parameter.
template <class TParam, class TState>
__device__ __forceinline__ TParam adamw_element(TParam* param, const float* grad, TState* m, TState* v, std::int64_t i,
                                                float scale, const AdamWConstants& k, std::uint64_t random) {
    const float g = grad[i] * scale;
    const float m_new = k.beta1 * detail::to_float(m[i]) + (1.0f - k.beta1) * g;
    const float v_new = k.beta2 * detail::to_float(v[i]) + (1.0f - k.beta2) * g * g;
    const float p_new =
        detail::to_float(param[i]) * k.decay - k.step_size * m_new / (sqrtf(v_new) / k.bias2_sqrt + k.eps);
    const TParam stored = store_value<TParam>(p_new, static_cast<std::uint32_t>(random & 0xffffu));
    param[i] = stored;
    m[i] = store_value<TState>(m_new, static_cast<std::uint32_t>((random >> 16) & 0xffffu));
    v[i] = store_value<TState>(v_new, static_cast<std::uint32_t>((random >> 32) & 0xffffu));
    return stored;
}

template <class TParam, class TState>
__global__ void adamw_kernel(TParam* param, const float* grad, TState* m, TState* v, std::int64_t n,
                             AdamWConstants k, const float* grad_scale, std::uint64_t stream_key) {
    if (grad_scale[2] != 0.0f) return;  // a non-finite loss or gradient: the update is skipped
    const float scale = *grad_scale;
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        adamw_element(param, grad, m, v, i, scale, k,
                      detail::splitmix64(stream_key + static_cast<std::uint64_t>(i)));
}

// The whole shard in one launch. Each block walks one contiguous range of
// the shard, its threads side by side (coalesced), and each thread its
// elements upwards, so that it finds an element's segment (a binary search
// of the table) and its rounding chunk only when it leaves the previous one:
// a few times per thread. (A grid-wide stride, millions of elements, would
// leave the segment at nearly every element and search again each time.)
// Elements in no segment (the shard's padding) are left alone. Every
// element's update depends on that element alone, so the walk's order does
// not change a bit of the result.
template <class TParam, class TState, class TWeight>
__global__ void adamw_shard_kernel(TParam* param, TWeight* weights, const float* grad, TState* m, TState* v,
                                   std::int64_t n, const double* values, const double* segments, int segment_count,
                                   std::int64_t chunk, const float* grad_scale) {
    if (grad_scale[2] != 0.0f) return;
    const float scale = *grad_scale;
    AdamWConstants k{static_cast<float>(values[kAdamWBeta1]), static_cast<float>(values[kAdamWBeta2]),
                     static_cast<float>(values[kAdamWEps]), static_cast<float>(values[kAdamWStepSize]), 0.0f,
                     static_cast<float>(values[kAdamWBias2Sqrt])};
    const float decay = static_cast<float>(values[kAdamWDecay]), no_decay = static_cast<float>(values[kAdamWNoDecay]);
    const int step = static_cast<int>(values[kAdamWStepNumber]);
    const std::uint64_t seed = static_cast<std::uint64_t>(values[kAdamWSeedLow]) |
                               (static_cast<std::uint64_t>(values[kAdamWSeedHigh]) << 32);
    auto slot = [&](int s, int field) {
        return static_cast<std::int64_t>(segments[static_cast<std::int64_t>(s) * kAdamWSegmentSlots + field]);
    };
    std::int64_t segment_begin = 0, segment_end = 0, chunk_begin = 0, chunk_end = 0;
    std::uint64_t stream_key = 0;
    const std::int64_t threads = blockDim.x;
    const std::int64_t per_block = ((n + gridDim.x - 1) / gridDim.x + threads - 1) / threads * threads;
    const std::int64_t block_begin = static_cast<std::int64_t>(blockIdx.x) * per_block;
    const std::int64_t block_end = block_begin + per_block < n ? block_begin + per_block : n;
    for (std::int64_t i = block_begin + threadIdx.x; i < block_end; i += threads) {
        if (i >= segment_end) {
            int lo = 0, hi = segment_count - 1, found = -1;  // the last segment beginning at or before i
            while (lo <= hi) {
                const int mid = (lo + hi) / 2;
                if (slot(mid, kAdamWSegmentBegin) <= i) {
                    found = mid;
                    lo = mid + 1;
                } else {
                    hi = mid - 1;
                }
            }
            if (found < 0) continue;
            segment_begin = slot(found, kAdamWSegmentBegin);
            segment_end = segment_begin + slot(found, kAdamWSegmentCount);
            if (i >= segment_end) continue;
            k.decay = segments[static_cast<std::int64_t>(found) * kAdamWSegmentSlots + kAdamWSegmentDecay] != 0.0
                          ? decay
                          : no_decay;
            chunk_end = 0;
        }
        if (i >= chunk_end) {
            chunk_begin = segment_begin + (i - segment_begin) / chunk * chunk;
            chunk_end = chunk_begin + chunk < segment_end ? chunk_begin + chunk : segment_end;
            stream_key = adamw_stream_key(seed + static_cast<std::uint64_t>(chunk_begin), step);
        }
        const std::uint64_t random = detail::splitmix64(stream_key + static_cast<std::uint64_t>(i - chunk_begin));
        const TParam stored = adamw_element(param, grad, m, v, i, scale, k, random);
        if (weights) weights[i] = detail::from_float<TWeight>(detail::to_float(stored));
    }
}

}  // namespace

void sum_squares(StatValue* out, const float* x, std::int64_t n, float* scratch, cudaStream_t stream) {
    if (n <= 0) return;
    const int blocks = sum_squares_blocks(n);
    detail::launch(sum_squares_partial_kernel, blocks, kThreads, 0, stream, scratch, x, n);
    detail::launch(sum_squares_total_kernel, 1, kThreads, 0, stream, out, scratch, blocks);
}

std::size_t sum_squares_scratch_floats(std::int64_t n) {
    return n > 0 ? static_cast<std::size_t>(sum_squares_blocks(n)) : 0;
}

void optimizer_scale(float* out, const StatValue* gathered, int ranks, int stride, const double* grad_clip,
                     cudaStream_t stream) {
    detail::launch(optimizer_scale_kernel, 1, 1, 0, stream, out, gathered, ranks, stride, grad_clip);
}

template <class TParam, class TState>
void adamw(TParam* param, const float* grad, TState* m, TState* v, std::int64_t n, float lr, float beta1,
           float beta2, float eps, float weight_decay, int step, const float* grad_scale, std::uint64_t seed,
           cudaStream_t stream) {
    if (n <= 0) return;
    // Same fp32 expressions as the CPU backend.
    const float bias1 = 1.0f - std::pow(beta1, static_cast<float>(step));
    const float bias2_sqrt = std::sqrt(1.0f - std::pow(beta2, static_cast<float>(step)));
    const AdamWConstants k{beta1, beta2, eps, lr / bias1, 1.0f - lr * weight_decay, bias2_sqrt};
    detail::launch(adamw_kernel<TParam, TState>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, param,
                   grad, m, v, n, k, grad_scale, adamw_stream_key(seed, step));
}

template <class TParam, class TState, class TWeight>
void adamw_shard(TParam* param, TWeight* weights, const float* grad, TState* m, TState* v, std::int64_t n,
                 const double* step_values, const double* segments, int segment_count, std::int64_t chunk,
                 const float* grad_scale, cudaStream_t stream) {
    if (n <= 0 || segment_count <= 0) return;
    // At least kShardElementsPerThread elements a thread (more where the grid
    // is at its cap): a thread's walk crosses segments even in small tests.
    const int blocks = detail::grid_stride_blocks((n + kShardElementsPerThread - 1) / kShardElementsPerThread, kThreads);
    detail::launch(adamw_shard_kernel<TParam, TState, TWeight>, blocks, kThreads, 0, stream, param, weights, grad, m,
                   v, n, step_values, segments, segment_count, chunk, grad_scale);
}

#define NANOQ_INSTANTIATE(TParam, TState)                                                                        \
    template void adamw<TParam, TState>(TParam*, const float*, TState*, TState*, std::int64_t, float, float, float, \
                                        float, float, int, const float*, std::uint64_t, cudaStream_t);
NANOQ_INSTANTIATE(float, float)
NANOQ_INSTANTIATE(float, bf16)
NANOQ_INSTANTIATE(bf16, float)
NANOQ_INSTANTIATE(bf16, bf16)
#undef NANOQ_INSTANTIATE

#define NANOQ_INSTANTIATE(TParam, TState, TWeight)                                                             \
    template void adamw_shard<TParam, TState, TWeight>(TParam*, TWeight*, const float*, TState*, TState*,       \
                                                       std::int64_t, const double*, const double*, int,        \
                                                       std::int64_t, const float*, cudaStream_t);
NANOQ_INSTANTIATE(float, float, float)
NANOQ_INSTANTIATE(float, float, bf16)
NANOQ_INSTANTIATE(float, bf16, float)
NANOQ_INSTANTIATE(float, bf16, bf16)
NANOQ_INSTANTIATE(bf16, float, float)
NANOQ_INSTANTIATE(bf16, float, bf16)
NANOQ_INSTANTIATE(bf16, bf16, float)
NANOQ_INSTANTIATE(bf16, bf16, bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
