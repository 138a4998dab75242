// Where the parameters live: the flat layout of a model's weights (with
// their Hugging Face names) and of its LoRA adapters, and the views of each
// parameter inside a flat buffer.
//
// Per layer the layout is: input norm, the q, k, v weights, their biases,
// o (and its bias), the q/k norms, post norm, gate, up, down (and their
// biases, gate and up contiguous). A learned position table follows the
// token embedding, before the first layer. q/k/v and
// gate/up are thus contiguous, so that the packed projections (backend.h)
// see one [q; k; v] and one [gate; up] matrix; the Hugging Face names stay
// views into them.
//
// The trainer owns flat buffers (weights, gradients, master copy, moments)
// so that sharding and the optimizer see one contiguous range; the model
// sees the per-parameter views bound here. Checkpoints, import and export go
// by name, never by offset.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "nanoq/config.h"
#include "nanoq/options.h"
#include "tensor.h"

namespace nanoq {

// LoRA settings as the model uses them (see TrainOptions::lora_*, checked by
// validate_options). The projections are the LoraTarget of nanoq/options.h.
struct Lora {
    int rank = 0;  // 0: off
    float scale = 0.0f;  // alpha / rank
    float dropout = 0.0f;
    bool targets[kLoraTargetCount] = {};

    bool enabled() const { return rank > 0; }
    // From validated options.
    static Lora from(const TrainOptions& options);
};

// {out, in} features of the projection a LoraTarget names.
std::pair<std::int64_t, std::int64_t> projection_shape(const ModelConfig& config, int target);

struct LayerWeights {
    Tensor input_norm, q, q_bias, k, k_bias, v, v_bias, o, o_bias, q_norm, k_norm, post_norm, gate, up, down;
    Tensor gate_bias, up_bias, down_bias;  // mlp_bias only
    // The same memory as q, k, v (their biases; gate, up) seen as one packed
    // parameter: qkv [(H + 2K) * D, C], qkv_bias [(H + 2K) * D], gate_up [2I, C].
    Tensor qkv, qkv_bias, gate_up;
    // Adapters by LoraTarget: A [rank, in], B [out, rank]; empty when absent.
    Tensor lora_a[kLoraTargetCount], lora_b[kLoraTargetCount];
};

struct ModelWeights {
    Tensor embed, final_norm, lm_head;
    Tensor positions;  // [max_positions, C], learned positions only
    std::vector<LayerWeights> layers;
};

// Views of each parameter inside a flat buffer laid out by parameter_layout().
ModelWeights bind_weights(const ModelConfig& config, const Tensor& flat);
// Views of one layer's parameters inside `block`, a buffer holding exactly
// that layer's range of the flat layout (its "model.layers.<l>." parameters).
LayerWeights bind_layer(const ModelConfig& config, int layer, const Tensor& block);
// The embedding (and position table), final norm and lm_head (the layers
// left empty) in two buffers: `embed` holds the embedding, `head` the flat layout from
// `head_begin` to its end.
ModelWeights bind_outer(const ModelConfig& config, const Tensor& embed, const Tensor& head, std::int64_t head_begin);
// The adapters' parameters (trainable, in their own flat buffer): layer by
// layer, targets in LoraTarget order, A before B; PEFT's names without its
// "base_model.model." prefix.
std::vector<ParameterInfo> lora_layout(const ModelConfig& config, const Lora& lora);
// Views of the adapters in `flat` (laid out by lora_layout) as the layers'
// lora_a/lora_b; every other tensor is left empty.
ModelWeights bind_lora(const ModelConfig& config, const Lora& lora, const Tensor& flat);
// `base` with the adapters of `adapters` attached to its layers.
ModelWeights attach_adapters(ModelWeights base, const ModelWeights& adapters);

}  // namespace nanoq
