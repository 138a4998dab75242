// The layout of the loss statistics, defined once for the core, both
// backends' kernels and the op test harness (op_harness/op_runner.h).
//
// A device's statistics buffer holds kStatCount float64 values (StatValue),
// filled by Backend::cross_entropy(): float64 keeps token counts exact up to
// 2^53 and loss sums accurate for any realistic step (float32 stops counting
// at 2^24 = 16.7M tokens). Plain C++: kernels may include it.
#pragma once

// X(enumerator, name): the slots in order.
#define NANOQ_STAT_SLOTS(X)                                                         \
    X(kLossSum, "loss_sum")     /* sum of cross-entropy over counted tokens */      \
    X(kTokens, "tokens")        /* number of counted tokens (target != -100) */     \
    X(kLoss1kSum, "loss_1k_sum") /* the same, restricted to positions < 1024 */     \
    X(kTokens1k, "tokens_1k")                                                       \
    X(kLseSum, "lse_sum")       /* sum of log-sum-exp over counted tokens */        \
    X(kLseMax, "lse_max")       /* max of log-sum-exp over counted tokens */        \
    X(kZLossSum, "z_loss_sum")  /* sum of z_loss * lse^2 over counted tokens */

namespace nanoq {

// A target with this id is not counted (no loss, no gradient): PyTorch's
// ignore_index, nanoq.trainer.IGNORE_INDEX.
constexpr int kIgnoreIndex = -100;

using StatValue = double;  // statistics tensors have dtype kStatDType (backend.h)

enum StatSlot : int {
#define NANOQ_STAT_ENUMERATOR(id, name) id,
    NANOQ_STAT_SLOTS(NANOQ_STAT_ENUMERATOR)
#undef NANOQ_STAT_ENUMERATOR
    kStatCount
};

// Each rank's row of the gathered optimizer statistics (float64): its
// StatSlots, then the sum of squares of its (summed-loss) gradient shard.
constexpr int kSumSquaresSlot = kStatCount;
constexpr int kGatherStride = kStatCount + 1;

}  // namespace nanoq
