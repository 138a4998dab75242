#include "zero.h"

#include <algorithm>
#include <limits>
#include <string>

#include "nanoq/errors.h"

namespace nanoq {

BlockLayout::BlockLayout(const std::vector<ParameterInfo>& layout, int num_layers, int devices) {
    total = layout.back().offset + layout.back().numel();
    shard = (total + devices - 1) / devices;
    std::size_t next = 0;
    auto end_of = [&](std::size_t i) { return layout[i].offset + layout[i].numel(); };
    auto in_layer = [&](std::size_t i, int l) {
        return layout[i].name.rfind("model.layers." + std::to_string(l) + ".", 0) == 0;
    };
    while (next < layout.size() && !in_layer(next, 0)) ++next;
    embed_end = next ? end_of(next - 1) : 0;
    for (int l = 0; l < num_layers; ++l) {
        if (next == layout.size() || !in_layer(next, l))
            throw InternalError("layer " + std::to_string(l) + "'s parameters are not contiguous in the layout");
        const std::int64_t begin = layout[next].offset;
        while (next < layout.size() && in_layer(next, l)) ++next;
        layers.emplace_back(begin, end_of(next - 1));
        max_layer = std::max(max_layer, layers.back().second - begin);
    }
    head_begin = layers.empty() ? embed_end : layers.back().second;
}

ZeroSharding::ZeroSharding(int stage, const ModelConfig& config, const std::vector<ParameterInfo>& layout,
                           int devices)
    : stage_(stage), devices_(devices), config_(config), blocks_(layout, config.num_layers, devices) {}

void ZeroSharding::allocate(NamedAllocator& a, ZeroBuffers& z, DType weight_dtype, const std::string& weights_name,
                            bool offload_gradients, bool gradients) const {
    const BlockLayout& b = blocks_;
    if (stage_ < 3) {
        z.weights = a.allocate(Context::Weights, weights_name, weight_dtype, {padded()});
    } else {
        z.weight_shard = a.allocate(Context::Weights, "weight-shard", weight_dtype, {b.shard});
        z.embed_weights = a.allocate(Context::Weights, "embed-weights", weight_dtype, {b.embed_end});
        z.head_weights = a.allocate(Context::Weights, "head-weights", weight_dtype, {b.total - b.head_begin});
        for (int i = 0; i < 2; ++i)
            z.layer_weights[i] = a.allocate(Context::Weights, "layer-weights." + std::to_string(i), weight_dtype,
                                            {b.max_layer});
    }
    if (!gradients) return;
    if (stage_ == 1) {
        z.grads = a.allocate(Context::Gradients, "gradients", DType::F32, {padded()});
    } else {
        z.grad_shard = a.allocate(Context::Gradients, "gradient-shard", DType::F32, {b.shard},
                                  offload_gradients ? MemoryKind::Pinned : MemoryKind::Device);
        z.embed_grads = a.allocate(Context::Gradients, "embed-gradients", DType::F32, {b.embed_end});
        z.head_grads = a.allocate(Context::Gradients, "head-gradients", DType::F32, {b.total - b.head_begin});
        for (int i = 0; i < 2; ++i)
            z.layer_grads[i] = a.allocate(Context::Gradients, "layer-gradients." + std::to_string(i), DType::F32,
                                          {b.max_layer});
    }
}

void ZeroSharding::fill_zero(Backend& backend, ZeroBuffers& z) const {
    for (const Tensor& t : {z.weights, z.grads, z.grad_shard, z.embed_grads, z.head_grads, z.weight_shard,
                            z.embed_weights, z.head_weights})
        if (t.data) backend.fill(t, 0.0f);
}

ModelWeights ZeroSharding::weight_views(const ZeroBuffers& z) const {
    return stage_ < 3 ? bind_weights(config_, z.weights)
                      : bind_outer(config_, z.embed_weights, z.head_weights, blocks_.head_begin);
}

ModelWeights ZeroSharding::grad_views(const ZeroBuffers& z) const {
    return stage_ == 1 ? bind_weights(config_, z.grads)
                       : bind_outer(config_, z.embed_grads, z.head_grads, blocks_.head_begin);
}

Tensor ZeroSharding::weight_shard(int rank, const ZeroBuffers& z) const {
    return stage_ == 3 ? z.weight_shard : z.weights.slice(rank * blocks_.shard, blocks_.shard);
}

Tensor ZeroSharding::grad_shard(int rank, const ZeroBuffers& z) const {
    return stage_ == 1 ? z.grads.slice(rank * blocks_.shard, blocks_.shard) : z.grad_shard;
}

Tensor ZeroSharding::whole_weights(const ZeroBuffers& z, const ParameterInfo& p) const {
    if (stage_ < 3) return z.weights.slice(p.offset, p.numel());
    if (p.offset < blocks_.embed_end) return z.embed_weights.slice(p.offset, p.numel());
    if (p.offset >= blocks_.head_begin) return z.head_weights.slice(p.offset - blocks_.head_begin, p.numel());
    return Tensor();
}

void ZeroSharding::reduce_gradients(ZeroBuffers& z, Communicator& comm) const {
    if (reduces_at_update(z)) comm.reduce_scatter_sum(z.grads);
}

void ZeroSharding::gather_weights(ZeroBuffers& z, Communicator& comm) const {
    if (stage_ < 3) return comm.all_gather(z.weights);
    // Layers are gathered when used; the embedding and head stay whole.
    comm.gather_range(z.embed_weights, 0, blocks_.embed_end, z.weight_shard, blocks_.shard);
    comm.gather_range(z.head_weights, blocks_.head_begin, blocks_.total, z.weight_shard, blocks_.shard);
}

void ZeroSharding::clear_gradients(Backend& backend, const ZeroBuffers& z) const {
    backend.fill(stage_ == 1 ? z.grads : z.grad_shard, 0.0f);
}

ZeroLayers::ZeroLayers(const ZeroSharding& zero, ZeroBuffers& z, const ModelWeights& resident_weights,
                       const ModelWeights& resident_grads, Backend& backend, Communicator& comm, bool last_micro_batch,
                       bool overlap, CommTrace* trace)
    : stage_(zero.stage()), config_(zero.config()), blocks_(zero.blocks()), z_(z),
      resident_weights_(resident_weights), resident_grads_(resident_grads), backend_(backend), comm_(comm),
      reduce_(zero.stage() > 1 || (last_micro_batch && overlap)), overlap_(overlap), trace_(trace) {}

void ZeroLayers::gather(int layer, int buffer, bool now) {
    const auto [begin, end] = blocks_.layers[layer];
    const Tensor block = z_.layer_weights[buffer].slice(0, end - begin);
    gathers_[buffer] = comm_.gather_range(block, begin, end, z_.weight_shard, blocks_.shard, now);
    weight_views_[buffer] = bind_layer(config_, layer, block);
    holds_[buffer] = layer;
}

const LayerWeights& ZeroLayers::weights(int layer) {
    if (stage_ < 3) return resident_weights_.layers[layer];
    const int direction = layer >= last_ ? 1 : -1;  // forward climbs, backward descends
    last_ = layer;
    int buffer = holds_[0] == layer ? 0 : holds_[1] == layer ? 1 : -1;
    if (buffer < 0) {
        buffer = holds_[0] == layer - direction ? 1 : 0;  // keep the layer just used, if any
        gather(layer, buffer, true);
    } else {
        comm_.wait(gathers_[buffer]);  // its prefetch, issued while the previous layer computed
    }
    // The next layer's gather runs while this one computes (on GPUs: on the
    // communication stream, waited for when that layer is asked for).
    const int next = layer + direction;
    if (next >= 0 && next < config_.num_layers && holds_[1 - buffer] != next) gather(next, 1 - buffer, false);
    return weight_views_[buffer];
}

const LayerWeights& ZeroLayers::grads(int layer) {
    if (stage_ == 1) return resident_grads_.layers[layer];
    const int b = grad_buffer_;
    if (reducing_[b]) {  // the buffer is reused: its reduction must be done
        comm_.wait(reducing_[b]);
        waited(reducing_[b]);
        reducing_[b] = 0;
    }
    const auto [begin, end] = blocks_.layers[layer];
    const Tensor block = z_.layer_grads[b].slice(0, end - begin);
    backend_.fill(block, 0.0f);  // weight gradients accumulate: each layer starts from zero
    grad_views_ = bind_layer(config_, layer, block);
    return grad_views_;
}

void ZeroLayers::grads_done(int layer) {
    if (!reduce_) return;
    if (trace_) trace_->record("backward", layer, 0);
    const auto [begin, end] = blocks_.layers[layer];
    if (stage_ == 1) {
        reduce(z_.grads.slice(begin, end - begin), begin, end, layer);
        return;
    }
    const int b = grad_buffer_;
    const CommTicket ticket = reduce(z_.layer_grads[b].slice(0, end - begin), begin, end, layer);
    if (!overlap_) return;  // done already: the buffer is free
    reducing_[b] = ticket;
    grad_buffer_ = 1 - b;
}

CommTicket ZeroLayers::reduce(const Tensor& grads, std::int64_t begin, std::int64_t end, int label) {
    if (begin == end) return 0;
    const std::int64_t shard = blocks_.shard;
    const Tensor own = stage_ == 1 ? z_.grads.slice(comm_.rank() * shard, shard) : z_.grad_shard;
    const CommTicket ticket = comm_.reduce_range(grads, begin, end, own, shard,
                                                 stage_ == 1 ? RangeSum::Store : RangeSum::Add, !overlap_);
    if (trace_) {
        trace_->record("issue", label, ticket);
        unwaited_.emplace_back(label, ticket);
    }
    if (!overlap_) waited(ticket);
    return ticket;
}

void ZeroLayers::waited(CommTicket ticket) {
    if (!trace_) return;
    auto done = [&](const std::pair<int, CommTicket>& r) { return r.second <= ticket; };
    for (const auto& [label, issued] : unwaited_)
        if (issued <= ticket) trace_->record("wait", label, issued);
    unwaited_.erase(std::remove_if(unwaited_.begin(), unwaited_.end(), done), unwaited_.end());
}

void ZeroLayers::finish_backward() {
    if (!reduce_) return;
    const int head = config_.num_layers;
    if (stage_ == 1) {
        reduce(z_.grads.slice(0, blocks_.embed_end), 0, blocks_.embed_end, -1);
        reduce(z_.grads.slice(blocks_.head_begin, blocks_.total - blocks_.head_begin), blocks_.head_begin,
               blocks_.total, head);
    } else {
        reduce(z_.embed_grads, 0, blocks_.embed_end, -1);
        reduce(z_.head_grads, blocks_.head_begin, blocks_.total, head);
    }
    comm_.wait();
    waited(std::numeric_limits<CommTicket>::max());
    reducing_[0] = reducing_[1] = 0;
    if (stage_ > 1) {
        backend_.fill(z_.embed_grads, 0.0f);
        backend_.fill(z_.head_grads, 0.0f);
    }
}

}  // namespace nanoq
