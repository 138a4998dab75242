// Fused cross-entropy over logit rows, with optional in-place gradient.
//
// One block per row computes the log-sum-exp with an online (max, sum) pair
// per thread, merged in a fixed tree. Per-row loss and lse go to scratch; a
// single-block kernel then folds them into the statistics: each thread sums a
// contiguous span of rows in double, and the spans are added in a fixed tree,
// so the result does not depend on scheduling.
#include <cmath>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kIgnoreIndex = -100;
constexpr int kRowThreads = 1024;
constexpr int kStatsThreads = 256;
constexpr int kFirstPositions = 1024;

struct MaxSum {
    float max;
    float sum;  // sum of exp(x - max)
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    if (a.max == -INFINITY) return b;
    if (b.max == -INFINITY) return a;
    const float m = fmaxf(a.max, b.max);
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum x) {
    for (int offset = detail::kWarpSize / 2; offset > 0; offset /= 2) {
        const MaxSum other{__shfl_xor_sync(detail::kFullMask, x.max, offset),
                           __shfl_xor_sync(detail::kFullMask, x.sum, offset)};
        x = merge(x, other);
    }
    return x;
}

// Writes row_loss[r] and row_lse[r] (unused for ignored rows) and, with
// `with_grad`, the gradient over the logits.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_row_kernel(T* logits, const std::int32_t* targets, float* row_loss, float* row_lse, int vocab,
                             float z_loss, bool with_grad) {
    NANOQ_SHARED(MaxSum[detail::kWarpSize], warp_results);
    const int r = blockIdx.x;
    const int target = targets[r];
    T* row = logits + static_cast<std::int64_t>(r) * vocab;
    if (target == kIgnoreIndex) {
        if (with_grad)
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) row[j] = detail::from_float<T>(0.0f);
        return;
    }
    const float target_logit = detail::to_float(row[target]);
    MaxSum local{-INFINITY, 0.0f};
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float x = detail::to_float(row[j]);
        if (x > local.max) {
            local.sum = local.sum * expf(local.max - x) + 1.0f;
            local.max = x;
        } else {
            local.sum += expf(x - local.max);
        }
    }
    const int lane = threadIdx.x % detail::kWarpSize, warp = threadIdx.x / detail::kWarpSize;
    local = warp_merge(local);
    if (lane == 0) warp_results[warp] = local;
    __syncthreads();
    MaxSum total = lane < static_cast<int>(blockDim.x / detail::kWarpSize) ? warp_results[lane]
                                                                           : MaxSum{-INFINITY, 0.0f};
    total = warp_merge(total);
    const float lse = total.max + logf(total.sum);
    if (threadIdx.x == 0) {
        row_loss[r] = lse - target_logit;
        row_lse[r] = lse;
    }
    if (!with_grad) return;
    const float factor = 1.0f + 2.0f * z_loss * lse;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float grad = expf(detail::to_float(row[j]) - lse) * factor;
        if (j == target) grad -= 1.0f;
        row[j] = detail::from_float<T>(grad);
    }
}

enum PartialSlot { kLoss = 0, kLoss1k, kLse, kZ, kPartialSlots };

__global__ void __launch_bounds__(kStatsThreads)
    cross_entropy_stats_kernel(StatValue* stats, const std::int32_t* targets, const float* row_loss,
                               const float* row_lse, int rows, int first_position, int time, float z_loss) {
    NANOQ_SHARED(double[kPartialSlots][kStatsThreads], sums);
    NANOQ_SHARED(int[2][kStatsThreads], counts);
    NANOQ_SHARED(float[kStatsThreads], maxima);
    const int tid = threadIdx.x;
    const int span = (rows + kStatsThreads - 1) / kStatsThreads;
    const int begin = min(rows, tid * span), end = min(rows, begin + span);
    double loss = 0, loss1k = 0, lse_sum = 0, z = 0;
    int tokens = 0, tokens1k = 0;
    float lse_max = -INFINITY;
    for (int r = begin; r < end; ++r) {
        if (targets[r] == kIgnoreIndex) continue;
        const float lse = row_lse[r];
        ++tokens;
        loss += row_loss[r];
        lse_sum += lse;
        lse_max = fmaxf(lse_max, lse);
        z += static_cast<double>(z_loss) * lse * lse;
        if ((first_position + r) % time < kFirstPositions) {
            ++tokens1k;
            loss1k += row_loss[r];
        }
    }
    sums[kLoss][tid] = loss;
    sums[kLoss1k][tid] = loss1k;
    sums[kLse][tid] = lse_sum;
    sums[kZ][tid] = z;
    counts[0][tid] = tokens;
    counts[1][tid] = tokens1k;
    maxima[tid] = lse_max;
    __syncthreads();
    for (int stride = kStatsThreads / 2; stride > 0; stride /= 2) {
        if (tid < stride) {
            for (int slot = 0; slot < kPartialSlots; ++slot) sums[slot][tid] += sums[slot][tid + stride];
            counts[0][tid] += counts[0][tid + stride];
            counts[1][tid] += counts[1][tid + stride];
            maxima[tid] = fmaxf(maxima[tid], maxima[tid + stride]);
        }
        __syncthreads();
    }
    if (tid == 0) {
        stats[kLossSum] += sums[kLoss][0];
        stats[kTokens] += counts[0][0];
        stats[kLoss1kSum] += sums[kLoss1k][0];
        stats[kTokens1k] += counts[1][0];
        stats[kLseSum] += sums[kLse][0];
        stats[kLseMax] = fmax(stats[kLseMax], static_cast<double>(maxima[0]));
        stats[kZLossSum] += sums[kZ][0];
    }
}

}  // namespace

template <class T>
void cross_entropy(T* logits, const std::int32_t* targets, StatValue* stats, int rows, int vocab, int first_position,
                   int time, float z_loss, bool with_grad, float* scratch, cudaStream_t stream) {
    if (rows <= 0) return;
    float* row_loss = scratch;
    float* row_lse = scratch + rows;
    detail::launch(cross_entropy_row_kernel<T>, rows, kRowThreads, 0, stream, logits, targets, row_loss, row_lse, vocab, z_loss,
                                                                  with_grad);
    detail::launch(cross_entropy_stats_kernel, 1, kStatsThreads, 0, stream, stats, targets, row_loss, row_lse, rows,
                                                                first_position, time, z_loss);
}

std::size_t classifier_scratch_floats(int rows) { return 2 * static_cast<std::size_t>(rows > 0 ? rows : 0); }

#define NANOQ_INSTANTIATE(T)                                                                                     \
    template void cross_entropy<T>(T*, const std::int32_t*, StatValue*, int, int, int, int, float, bool, float*, \
                                   cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
