// ZeRO stages 1-3: where each device's weights and gradients live, and the
// collectives that move them. The trainer knows the stage only through
// ZeroSharding (buffers, shards, the reductions and gathers around the
// optimizer) and ZeroLayers (the model's LayerSource during a pass).
//
// Every stage shards the optimizer: device r owns the contiguous shard
// [r * shard, (r + 1) * shard) of the flat parameter layout (padded to a
// multiple of the device count), holds master weights and AdamW moments for
// it only, and updates it; shards are the same ranges at every stage, so
// optimizer state and checkpoints do not depend on the stage.
//
// Stage 1 keeps full weights and full float32 gradients on every device; the
// gradients are summed over devices into the owners' shards (reduce-scatter)
// before the optimizer, and the updated shards are all-gathered after it.
// Stage 2 also shards the gradients: a layer's gradients are computed into a
// working buffer and, as soon as the layer's backward is done, summed over
// devices into the owners' gradient shards. Stage 3 also shards the weights:
// each device keeps its shard, and a layer's weights are gathered into one of
// two buffers when the model asks for them, the neighbouring layer's gather
// being issued before the layer computes and waited for only when that layer
// is asked for (double buffering: on GPUs the gather runs on the
// communication stream alongside the compute). The embedding and the head
// (final norm and an untied lm_head) stay whole on every device at stages 2
// and 3: they are needed at both ends of a step.
//
// Overlap. Gradient reductions are issued as soon as a layer's backward is
// done and run on the communication thread (cpu) or stream (cuda) while the
// layers below compute: at stage 1 on the last micro-batch of an optimizer
// step, when each layer's range of the full gradients is final (it is summed
// in place into its owners; an update() that comes before grad_accum
// micro-batches sums the whole buffer instead), at stages 2 and 3 on every
// micro-batch, the layer buffer alternating between two so that the next
// layer's backward writes one while the other is being summed. The compute
// waits for a reduction only when its buffer is reused and at the end of
// the backward. The sums are those of the synchronous path, in the same
// rank order on the cpu communicator: results are bitwise equal to it
// there (ZeroLayers' `overlap` keeps it, for tests); with NCCL, from three
// ranks on, they may differ in the last bits (comm.h).
#pragma once

#include <utility>
#include <vector>

#include "allocator.h"
#include "backend.h"
#include "comm.h"
#include "model.h"
#include "nanoq/config.h"

namespace nanoq {

// The flat layout of the trainable parameters cut into the units the stages
// move: the parameters before the first layer (the embedding), each layer's
// ("model.layers.<l>." names, contiguous), and those after the last (the
// head). With LoRA the layout holds only the adapters: no embedding, no head.
struct BlockLayout {
    BlockLayout(const std::vector<ParameterInfo>& layout, int num_layers, int devices);

    std::int64_t total = 0;       // parameters
    std::int64_t shard = 0;       // elements per device: ceil(total / devices)
    std::int64_t embed_end = 0;   // [0, embed_end): the embedding
    std::int64_t head_begin = 0;  // [head_begin, total): the final norm and an untied lm_head
    std::vector<std::pair<std::int64_t, std::int64_t>> layers;  // [begin, end) of each layer
    std::int64_t max_layer = 0;   // elements of the largest layer
};

// One device's weight and gradient buffers (those its stage does not use stay empty).
struct ZeroBuffers {
    Tensor weights;                       // [padded], full (stages 1 and 2)
    Tensor grads;                         // [padded] float32, full (stage 1)
    Tensor grad_shard;                    // [shard] float32: this device's summed gradients (stages 2, 3)
    Tensor embed_grads, head_grads;       // whole, float32 (stages 2, 3)
    Tensor layer_grads[2];                // [max_layer] float32 each: a layer computing, one reducing (stages 2, 3)
    Tensor weight_shard;                  // [shard] in the weights' dtype (stage 3)
    Tensor embed_weights, head_weights;   // whole (stage 3)
    Tensor layer_weights[2];              // [max_layer] each: the double buffer (stage 3)
    // Stage 1: this optimizer step's gradients are summed into the owners'
    // shards already (the last micro-batch's backward did it).
    bool gradients_reduced = false;
};

// The stage's rules, shared by every device of a trainer.
class ZeroSharding {
public:
    // `layout`: the trainable parameters (what the flat buffers hold).
    ZeroSharding(int stage, const ModelConfig& config, const std::vector<ParameterInfo>& layout, int devices);

    int stage() const { return stage_; }
    const ModelConfig& config() const { return config_; }
    std::int64_t shard() const { return blocks_.shard; }
    std::int64_t padded() const { return blocks_.shard * devices_; }  // the full buffers' length
    const BlockLayout& blocks() const { return blocks_; }
    // Whether the weights of this device's shard live in a buffer of their
    // own (stage 3) rather than inside full weights.
    bool separate_weight_shard() const { return stage_ == 3; }

    // Allocates one device's buffers (or plans them, with a planning
    // allocator); `weights_name` names the full weights ("weights", or
    // "adapters" with LoRA). Without `gradients` (an inference trainer)
    // the gradient buffers are left out.
    void allocate(NamedAllocator& allocator, ZeroBuffers& z, DType weight_dtype, const std::string& weights_name,
                  bool offload_gradients, bool gradients = true) const;
    // Sets the allocated buffers to zero.
    void fill_zero(Backend& backend, ZeroBuffers& z) const;
    // The model's views of the embedding, final norm and head (and, at
    // stages 1 and 2, of the layers' weights; at stage 1 of their gradients).
    ModelWeights weight_views(const ZeroBuffers& z) const;
    ModelWeights grad_views(const ZeroBuffers& z) const;

    // This rank's part of the weights and its summed gradients, [shard] each
    // (the gradients once reduce_gradients has run).
    Tensor weight_shard(int rank, const ZeroBuffers& z) const;
    Tensor grad_shard(int rank, const ZeroBuffers& z) const;
    // Where this device holds trainable parameter p whole: the full weights
    // (stages 1 and 2), or at stage 3 the replicated embedding/head; else
    // empty (a stage-3 layer parameter, held only as shards).
    Tensor whole_weights(const ZeroBuffers& z, const ParameterInfo& p) const;
    // Whether this optimizer step's gradients are already summed over
    // devices into the owners' shards (else each device holds its own sums
    // in `grads`).
    bool gradients_summed(const ZeroBuffers& z) const { return stage_ > 1 || z.gradients_reduced; }

    // Before the optimizer: every device's gradients summed into the owners'
    // shards (stage 1, unless the backward did it already: reduces_at_update).
    void reduce_gradients(ZeroBuffers& z, Communicator& comm) const;
    bool reduces_at_update(const ZeroBuffers& z) const { return stage_ == 1 && !z.gradients_reduced; }
    // After the optimizer updated this rank's weight shard: the weights every
    // device keeps whole, refreshed from their owners.
    void gather_weights(ZeroBuffers& z, Communicator& comm) const;
    // After the update: gradients back to zero for the next optimizer step
    // (device work only: the caller resets ZeroBuffers::gradients_reduced).
    void clear_gradients(Backend& backend, const ZeroBuffers& z) const;

private:
    int stage_;
    int devices_;
    ModelConfig config_;
    BlockLayout blocks_;
};

// The model's LayerSource for one forward (+ backward) pass of one device.
class ZeroLayers final : public LayerSource {
public:
    // `resident_*`: the device's weight and gradient views (weight_views and
    // grad_views, or the LoRA views at stage 1). `last_micro_batch`: this
    // backward completes the optimizer step's gradients. `overlap` false:
    // reductions run synchronously, as before the overlap (stage 1: all at
    // update()), kept for tests. `trace`: where to record the order of
    // backward and reductions (tests), or null.
    ZeroLayers(const ZeroSharding& zero, ZeroBuffers& z, const ModelWeights& resident_weights,
               const ModelWeights& resident_grads, Backend& backend, Communicator& comm, bool last_micro_batch = false,
               bool overlap = true, CommTrace* trace = nullptr);

    const LayerWeights& weights(int layer) override;
    const LayerWeights& grads(int layer) override;
    void grads_done(int layer) override;
    // After backward: the embedding's and the head's gradients to their
    // owners, and the compute ordered after every reduction of the pass.
    // Device work only (it may be captured as a CUDA graph): the caller sets
    // ZeroBuffers::gradients_reduced from reduced_in_backward().
    void finish_backward();
    // Stage 1: whether this pass sums the gradients into the owners' shards.
    bool reduced_in_backward() const { return stage_ == 1 && reduce_; }

private:
    void gather(int layer, int buffer, bool now);
    // Issues the reduction of [begin, end) of the flat layout from `grads`
    // (a range of the full gradients at stage 1, stored in place; a
    // gradient buffer at stages 2 and 3, added to the shard); `label` is the
    // layer for the trace.
    CommTicket reduce(const Tensor& grads, std::int64_t begin, std::int64_t end, int label);
    // The compute was ordered after reduction `ticket` (and those before it): traced.
    void waited(CommTicket ticket);

    int stage_;
    const ModelConfig& config_;
    const BlockLayout& blocks_;
    ZeroBuffers& z_;
    const ModelWeights& resident_weights_;
    const ModelWeights& resident_grads_;
    Backend& backend_;
    Communicator& comm_;
    bool reduce_;              // this backward sums gradients over devices
    bool overlap_;
    CommTrace* trace_;
    int holds_[2] = {-1, -1};  // the layer in each weight buffer
    CommTicket gathers_[2] = {0, 0};  // the gather that fills each weight buffer
    LayerWeights weight_views_[2];
    int last_ = -1;            // the layer asked for last: gives the direction of travel
    // Stages 2 and 3: the gradient buffer of the next layer, and for each
    // the reduction still reading it (ticket 0: none).
    int grad_buffer_ = 0;
    CommTicket reducing_[2] = {0, 0};
    LayerWeights grad_views_;
    std::vector<std::pair<int, CommTicket>> unwaited_;  // traced reductions not waited for yet: (label, ticket)
};

}  // namespace nanoq
