// ZeRO stages 2 and 3: where each layer's gradients and weights live.
//
// Stage 1 keeps full weights and full gradients on every device and shards
// only the optimizer (trainer.cpp). Stage 2 also shards the gradients: a
// layer's gradients are computed into one working buffer and, as soon as the
// layer's backward is done, summed over devices into the owners' gradient
// shards. Stage 3 also shards the weights: each device keeps its shard, and a
// layer's weights are gathered into one of two buffers when the model asks for
// them, the neighbouring layer's gather being issued before the layer computes
// and waited for only when that layer is asked for (double buffering: on GPUs
// the gather runs on the communication stream alongside the compute). The embedding and the head (final norm and an untied
// lm_head) stay whole on every device: they are needed at both ends of a step.
// Shards are the same contiguous ranges of the flat layout at every stage, so
// optimizer state and checkpoints do not depend on the stage.
#pragma once

#include <utility>
#include <vector>

#include "backend.h"
#include "comm.h"
#include "model.h"
#include "nanoq/config.h"

namespace nanoq {

// The flat parameter layout cut into the units the stages move.
struct BlockLayout {
    BlockLayout(const ModelConfig& config, int devices);

    std::int64_t total = 0;       // parameters
    std::int64_t shard = 0;       // elements per device: ceil(total / devices)
    std::int64_t embed_end = 0;   // [0, embed_end): the embedding
    std::int64_t head_begin = 0;  // [head_begin, total): the final norm and an untied lm_head
    std::vector<std::pair<std::int64_t, std::int64_t>> layers;  // [begin, end) of each layer
    std::int64_t max_layer = 0;   // elements of the largest layer
};

// A device's buffers for stages 2 and 3 (unused ones stay empty).
struct ShardedState {
    Tensor grad_shard;                    // [shard] float32: this device's summed gradients
    Tensor embed_grads, head_grads;       // whole, float32
    Tensor layer_grads;                   // [max_layer] float32, one layer at a time
    Tensor reduce_scratch;                // float32, as large as the largest of the three above
    Tensor weight_shard;                  // [shard] in the weights' dtype (stage 3)
    Tensor embed_weights, head_weights;   // whole (stage 3)
    Tensor layer_weights[2];              // [max_layer] each: the double buffer (stage 3)
};

// The model's LayerSource at stages 2 and 3 (one per step or validation).
class ShardedLayers final : public LayerSource {
public:
    ShardedLayers(int stage, const ModelConfig& config, const BlockLayout& blocks, ShardedState& state,
                  const ModelWeights& resident, Backend& backend, Communicator& comm);

    const LayerWeights& weights(int layer) override;
    const LayerWeights& grads(int layer) override;
    void grads_done(int layer) override;
    // After backward: the embedding's and the head's gradients to their owners.
    void reduce_outer();

private:
    void gather(int layer, int buffer, bool now);

    int stage_;
    const ModelConfig& config_;
    const BlockLayout& blocks_;
    ShardedState& state_;
    const ModelWeights& resident_;  // full weights (stage 2)
    Backend& backend_;
    Communicator& comm_;
    int holds_[2] = {-1, -1};  // the layer in each weight buffer
    LayerWeights weight_views_[2];
    LayerWeights grad_views_;
    int last_ = -1;            // the layer asked for last: gives the direction of travel
};

}  // namespace nanoq
