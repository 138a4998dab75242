// The layout of the whole-shard AdamW's device tables (Backend::adamw_shard,
// backend.h), defined once for the core, the kernels and the op harness.
// Plain C++: kernels may include it.
//
// The per-step values and the segment table live in float64 device tensors,
// not in kernel arguments, so that a captured launch (a CUDA graph) replays
// with new values: the caller writes them before the op runs. Every value is stored exactly
// (floats, integers below 2^53, the seed as two 32-bit halves).
//
// step_values [kAdamWStepSlots]: adamw_step_values(step, seed) (backend.h)
// and the update's gradient clip (set by the trainer; 0 in the op harness),
// where `seed` is the rounding seed of shard element 0; the chunk that
// starts at shard element `at` rounds with seed + at, as adamw() on that
// chunk alone would be given.
#pragma once

namespace nanoq {

enum AdamWStepSlot : int {
    kAdamWLr = 0,
    kAdamWBeta1,
    kAdamWBeta2,
    kAdamWEps,
    kAdamWWeightDecay,
    kAdamWStepNumber,
    kAdamWSeedLow,   // low and high 32 bits of the seed
    kAdamWSeedHigh,
    kAdamWStepSize,  // lr / (1 - beta1^step), in float32 as adamw() computes it
    kAdamWBias2Sqrt,  // sqrt(1 - beta2^step)
    kAdamWDecay,      // 1 - lr * weight_decay: the factor of decayed segments
    kAdamWNoDecay,    // 1 - lr * 0: of the others
    // update()'s gradient clip (0: none), read by optimizer_scale from here so
    // that the update's reductions and scale are captured together.
    kAdamWGradClip,
    kAdamWStepSlots
};
// segments [count, kAdamWSegmentSlots]: each parameter's part of the shard,
// in order, as (first shard element, elements, 1 when it is decayed else 0).
enum AdamWSegmentSlot : int { kAdamWSegmentBegin = 0, kAdamWSegmentCount, kAdamWSegmentDecay, kAdamWSegmentSlots };

}  // namespace nanoq
