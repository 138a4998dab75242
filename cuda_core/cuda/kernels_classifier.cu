// Fused cross-entropy over logit rows, with optional in-place gradient.
//
// One block per row computes the log-sum-exp with an online (max, sum) pair
// per thread, merged in a fixed tree; rows are read in 16-byte packs where
// the vocabulary allows (a multiple of 4 float32 or 8 bf16 logits). Per-row loss and lse go to scratch; a
// single-block kernel then folds them into the statistics: each thread sums a
// contiguous span of rows in double, and the spans are added in a fixed tree,
// so the result does not depend on scheduling.
#include <cmath>
#include <cstdint>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

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

// L consecutive logits, loaded and stored as one access (16 bytes when L
// fills them).
template <class T, int L> struct alignas(sizeof(T) * L) Pack {
    T v[L];
};

// Folds L logits into a thread's running (max, sum): the max moves once per
// pack, so a pack costs L exponentials plus at most one rescale.
template <int L> __device__ __forceinline__ MaxSum absorb(MaxSum local, const float (&x)[L]) {
    float m = x[0];
    for (int k = 1; k < L; ++k) m = fmaxf(m, x[k]);
    if (m > local.max) {
        local.sum *= expf(local.max - m);
        local.max = m;
    }
    for (int k = 0; k < L; ++k) local.sum += expf(x[k] - local.max);
    return local;
}

// Writes row_loss[r] and row_lse[r] (unused for ignored rows) and, with
// `with_grad`, the gradient over the logits: one read of the row for the
// log-sum-exp, one read and one write for the gradient, each in packs of L
// (vocab % L == 0 and the rows 16-byte aligned for L > 1).
template <class T, int L>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_row_kernel(T* logits, const std::int32_t* targets, float* row_loss, float* row_lse, int vocab,
                             float z_loss, bool with_grad) {
    using P = Pack<T, L>;
    NANOQ_SHARED(MaxSum[detail::kWarpSize], warp_results);
    const int r = blockIdx.x;
    const int target = targets[r];
    const int packs = vocab / L;
    T* row = logits + static_cast<std::int64_t>(r) * vocab;
    P* row_packs = reinterpret_cast<P*>(row);
    if (target == kIgnoreIndex) {
        if (with_grad) {
            P zeros;
            for (int k = 0; k < L; ++k) zeros.v[k] = detail::from_float<T>(0.0f);
            for (int j = threadIdx.x; j < packs; j += blockDim.x) row_packs[j] = zeros;
        }
        return;
    }
    const float target_logit = detail::to_float(row[target]);
    MaxSum local{-INFINITY, 0.0f};
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
        const P p = row_packs[j];
        float x[L];
        for (int k = 0; k < L; ++k) x[k] = detail::to_float(p.v[k]);
        local = absorb(local, x);
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
    for (int j = threadIdx.x; j < packs; j += blockDim.x) {
        P p = row_packs[j];
        for (int k = 0; k < L; ++k) {
            float grad = expf(detail::to_float(p.v[k]) - lse) * factor;
            if (j * L + k == target) grad -= 1.0f;
            p.v[k] = detail::from_float<T>(grad);
        }
        row_packs[j] = p;
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
    constexpr int lanes = 16 / sizeof(T);
    const bool packed = vocab % lanes == 0 && reinterpret_cast<std::uintptr_t>(logits) % 16 == 0;
    if (packed)
        detail::launch(cross_entropy_row_kernel<T, lanes>, rows, kRowThreads, 0, stream, logits, targets, row_loss,
                       row_lse, vocab, z_loss, with_grad);
    else
        detail::launch(cross_entropy_row_kernel<T, 1>, rows, kRowThreads, 0, stream, logits, targets, row_loss,
                       row_lse, vocab, z_loss, with_grad);
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
