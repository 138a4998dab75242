#include "zero.h"

#include <algorithm>

#include "nanoq/errors.h"

namespace nanoq {

BlockLayout::BlockLayout(const ModelConfig& config, int devices) {
    const auto layout = parameter_layout(config);
    total = layout.back().offset + layout.back().numel();
    shard = (total + devices - 1) / devices;
    embed_end = layout.front().numel();
    for (int l = 0; l < config.num_layers; ++l) {
        layers.push_back(layer_range(config, l));
        max_layer = std::max(max_layer, layers.back().second - layers.back().first);
    }
    head_begin = layers.back().second;
}

ShardedLayers::ShardedLayers(int stage, const ModelConfig& config, const BlockLayout& blocks, ShardedState& state,
                             const ModelWeights& resident, Backend& backend, Communicator& comm)
    : stage_(stage), config_(config), blocks_(blocks), state_(state), resident_(resident), backend_(backend),
      comm_(comm) {}

void ShardedLayers::gather(int layer, int buffer, bool now) {
    const auto [begin, end] = blocks_.layers[layer];
    const Tensor block = state_.layer_weights[buffer].slice(0, end - begin);
    comm_.gather_range(block, begin, end, state_.weight_shard, blocks_.shard, now);
    weight_views_[buffer] = bind_layer(config_, layer, block);
    holds_[buffer] = layer;
}

const LayerWeights& ShardedLayers::weights(int layer) {
    if (stage_ < 3) return resident_.layers[layer];
    const int direction = layer >= last_ ? 1 : -1;  // forward climbs, backward descends
    last_ = layer;
    int buffer = holds_[0] == layer ? 0 : holds_[1] == layer ? 1 : -1;
    if (buffer < 0) {
        buffer = holds_[0] == layer - direction ? 1 : 0;  // keep the layer just used, if any
        gather(layer, buffer, true);
    } else {
        comm_.wait();  // its prefetch, issued while the previous layer computed
    }
    // The next layer's gather runs while this one computes (on GPUs: on the
    // communication stream, waited for when that layer is asked for).
    const int next = layer + direction;
    if (next >= 0 && next < config_.num_layers && holds_[1 - buffer] != next) gather(next, 1 - buffer, false);
    return weight_views_[buffer];
}

const LayerWeights& ShardedLayers::grads(int layer) {
    const auto [begin, end] = blocks_.layers[layer];
    grad_views_ = bind_layer(config_, layer, state_.layer_grads.slice(0, end - begin));
    return grad_views_;
}

void ShardedLayers::grads_done(int layer) {
    const auto [begin, end] = blocks_.layers[layer];
    const Tensor block = state_.layer_grads.slice(0, end - begin);
    comm_.reduce_range_add(block, begin, end, state_.grad_shard, blocks_.shard, state_.reduce_scratch);
    backend_.fill(block, 0.0f);  // weight gradients accumulate: the next layer starts from zero
}

void ShardedLayers::reduce_outer() {
    comm_.reduce_range_add(state_.embed_grads, 0, blocks_.embed_end, state_.grad_shard, blocks_.shard,
                           state_.reduce_scratch);
    comm_.reduce_range_add(state_.head_grads, blocks_.head_begin, blocks_.total, state_.grad_shard, blocks_.shard,
                           state_.reduce_scratch);
    backend_.fill(state_.embed_grads, 0.0f);
    backend_.fill(state_.head_grads, 0.0f);
}

}  // namespace nanoq
