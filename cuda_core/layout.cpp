#include "layout.h"

#include <initializer_list>
#include <string>

#include "nanoq/errors.h"

namespace nanoq {

namespace {

// The Hugging Face module inside a layer of each LoraTarget.
constexpr const char* kLoraModules[kLoraTargetCount] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                        "mlp.down_proj"};

}  // namespace

std::pair<std::int64_t, std::int64_t> projection_shape(const ModelConfig& c, int target) {
    const std::int64_t C = c.hidden_size, I = c.intermediate_size;
    const std::int64_t HD = std::int64_t(c.num_heads) * c.head_dim, KD = std::int64_t(c.num_kv_heads) * c.head_dim;
    switch (target) {
        case kLoraQ: return {HD, C};
        case kLoraK:
        case kLoraV: return {KD, C};
        case kLoraO: return {C, HD};
        case kLoraGate:
        case kLoraUp: return {I, C};
        default: return {C, I};
    }
}


Lora Lora::from(const TrainOptions& o) {
    Lora lora;
    if (o.lora_rank == 0) return lora;
    lora.rank = o.lora_rank;
    lora.scale = o.lora_alpha / static_cast<float>(o.lora_rank);
    lora.dropout = o.lora_dropout;
    for (int t = 0; t < kLoraTargetCount; ++t) lora.targets[t] = o.lora_targets.has(static_cast<LoraTarget>(t));
    return lora;
}

std::vector<ParameterInfo> lora_layout(const ModelConfig& c, const Lora& lora) {
    std::vector<ParameterInfo> params;
    std::int64_t offset = 0;
    for (int l = 0; l < c.num_layers; ++l)
        for (int t = 0; t < kLoraTargetCount; ++t) {
            if (!lora.targets[t]) continue;
            const auto [out, in] = projection_shape(c, t);
            const std::string module = "model.layers." + std::to_string(l) + "." + kLoraModules[t];
            for (const auto& [suffix, shape] : {std::pair<const char*, std::vector<std::int64_t>>{
                                                    ".lora_A.weight", {lora.rank, in}},
                                                {".lora_B.weight", {out, lora.rank}}}) {
                ParameterInfo p{module + suffix, shape, true, offset};  // matrices decay
                offset += p.numel();
                params.push_back(std::move(p));
            }
        }
    return params;
}

std::vector<ParameterInfo> parameter_layout(const ModelConfig& c) {
    std::vector<ParameterInfo> params;
    std::int64_t offset = 0;
    auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
        ParameterInfo p{name, std::move(shape), false, offset};
        p.weight_decay = p.shape.size() >= 2;  // matrices decay; norms and biases do not
        offset += p.numel();
        params.push_back(std::move(p));
    };
    const std::int64_t C = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
    const std::int64_t q_out = std::int64_t(c.num_heads) * c.head_dim, kv_out = std::int64_t(c.num_kv_heads) * c.head_dim;
    add("model.embed_tokens.weight", {V, C});
    if (c.max_positions > 0) add("model.embed_positions.weight", {c.max_positions, C});
    for (int l = 0; l < c.num_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        add(p + "input_layernorm.weight", {C});
        // q, k, v (and their biases) contiguous: the packed projection's
        // [q; k; v] weight; gate then up below: the packed gate|up weight.
        add(p + "self_attn.q_proj.weight", {q_out, C});
        add(p + "self_attn.k_proj.weight", {kv_out, C});
        add(p + "self_attn.v_proj.weight", {kv_out, C});
        if (c.qkv_bias) {
            add(p + "self_attn.q_proj.bias", {q_out});
            add(p + "self_attn.k_proj.bias", {kv_out});
            add(p + "self_attn.v_proj.bias", {kv_out});
        }
        add(p + "self_attn.o_proj.weight", {C, q_out});
        if (c.o_bias) add(p + "self_attn.o_proj.bias", {C});
        if (c.qk_norm) {
            add(p + "self_attn.q_norm.weight", {c.head_dim});
            add(p + "self_attn.k_norm.weight", {c.head_dim});
        }
        add(p + "post_attention_layernorm.weight", {C});
        add(p + "mlp.gate_proj.weight", {I, C});
        add(p + "mlp.up_proj.weight", {I, C});
        add(p + "mlp.down_proj.weight", {C, I});
        if (c.mlp_bias) {
            add(p + "mlp.gate_proj.bias", {I});
            add(p + "mlp.up_proj.bias", {I});
            add(p + "mlp.down_proj.bias", {C});
        }
    }
    add("model.norm.weight", {C});
    if (!c.tie_embeddings) add("lm_head.weight", {V, C});
    return params;
}

namespace {

// A parameter's view in `buffer`, which holds the flat layout from `base` on.
Tensor view(const ParameterInfo& p, const Tensor& buffer, std::int64_t base) {
    Tensor t = buffer.slice(p.offset - base, p.numel());
    t.ndim = static_cast<int>(p.shape.size());
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = p.shape[i];
    return t;
}

// One view over parameters that lie back to back in the layout, in the
// given order, with their first dimensions summed (empty when they are).
Tensor packed(std::initializer_list<const Tensor*> parts) {
    const Tensor& first = **parts.begin();
    if (!first.data) return Tensor();
    Tensor whole = first;
    char* end = static_cast<char*>(first.data) + first.bytes();
    for (auto it = parts.begin() + 1; it != parts.end(); ++it) {
        const Tensor& part = **it;
        if (part.data != end || part.ndim != first.ndim || part.dtype != first.dtype)
            throw InternalError("packed parameters are not contiguous in the layout");
        whole.shape[0] += part.shape[0];
        end += part.bytes();
    }
    return whole;
}

// The views of one layer, taking its parameters in layout order from `take`.
template <class Take>
LayerWeights take_layer(const ModelConfig& c, Take&& take) {
    LayerWeights l;
    l.input_norm = take(true);
    l.q = take(true);
    l.k = take(true);
    l.v = take(true);
    l.q_bias = take(c.qkv_bias);
    l.k_bias = take(c.qkv_bias);
    l.v_bias = take(c.qkv_bias);
    l.o = take(true);
    l.o_bias = take(c.o_bias);
    l.q_norm = take(c.qk_norm);
    l.k_norm = take(c.qk_norm);
    l.post_norm = take(true);
    l.gate = take(true);
    l.up = take(true);
    l.down = take(true);
    l.gate_bias = take(c.mlp_bias);
    l.up_bias = take(c.mlp_bias);
    l.down_bias = take(c.mlp_bias);
    l.qkv = packed({&l.q, &l.k, &l.v});
    l.qkv_bias = packed({&l.q_bias, &l.k_bias, &l.v_bias});
    l.gate_up = packed({&l.gate, &l.up});
    return l;
}

// Index in parameter_layout() of the first parameter of `layer`.
std::size_t first_parameter(const ModelConfig& c, int layer) {
    const std::size_t per_layer =
        9 + (c.qkv_bias ? 3 : 0) + (c.o_bias ? 1 : 0) + (c.qk_norm ? 2 : 0) + (c.mlp_bias ? 3 : 0);
    return (c.max_positions > 0 ? 2 : 1) + static_cast<std::size_t>(layer) * per_layer;
}

}  // namespace

ModelWeights bind_lora(const ModelConfig& c, const Lora& lora, const Tensor& flat) {
    const auto layout = lora_layout(c, lora);
    std::size_t next = 0;
    ModelWeights w;
    w.layers.resize(c.num_layers);
    for (LayerWeights& layer : w.layers)
        for (int t = 0; t < kLoraTargetCount; ++t) {
            if (!lora.targets[t]) continue;
            layer.lora_a[t] = view(layout.at(next++), flat, 0);
            layer.lora_b[t] = view(layout.at(next++), flat, 0);
        }
    if (next != layout.size()) throw InternalError("lora layout and adapter binding disagree");
    return w;
}

ModelWeights attach_adapters(ModelWeights base, const ModelWeights& adapters) {
    for (std::size_t l = 0; l < base.layers.size(); ++l)
        for (int t = 0; t < kLoraTargetCount; ++t) {
            base.layers[l].lora_a[t] = adapters.layers.at(l).lora_a[t];
            base.layers[l].lora_b[t] = adapters.layers.at(l).lora_b[t];
        }
    return base;
}

ModelWeights bind_weights(const ModelConfig& c, const Tensor& flat) {
    // Walks the same layout as parameter_layout(), in the same order.
    const auto layout = parameter_layout(c);
    std::size_t next = 0;
    auto take = [&](bool present) -> Tensor { return present ? view(layout.at(next++), flat, 0) : Tensor(); };
    ModelWeights w;
    w.embed = take(true);
    w.positions = take(c.max_positions > 0);
    for (int l = 0; l < c.num_layers; ++l) w.layers.push_back(take_layer(c, take));
    w.final_norm = take(true);
    w.lm_head = c.tie_embeddings ? w.embed : take(true);
    if (next != layout.size()) throw InternalError("parameter layout and weight binding disagree");
    return w;
}

ModelWeights bind_outer(const ModelConfig& c, const Tensor& embed, const Tensor& head, std::int64_t head_begin) {
    const auto layout = parameter_layout(c);
    ModelWeights w;
    w.embed = view(layout.front(), embed, 0);
    if (c.max_positions > 0) w.positions = view(layout.at(1), embed, 0);
    const std::size_t first_head = first_parameter(c, c.num_layers);
    w.final_norm = view(layout.at(first_head), head, head_begin);
    w.lm_head = c.tie_embeddings ? w.embed : view(layout.at(first_head + 1), head, head_begin);
    return w;
}

LayerWeights bind_layer(const ModelConfig& c, int layer, const Tensor& block) {
    const auto layout = parameter_layout(c);
    std::size_t next = first_parameter(c, layer);
    const std::int64_t base = layout.at(next).offset;
    return take_layer(c, [&](bool present) { return present ? view(layout.at(next++), block, base) : Tensor(); });
}

}  // namespace nanoq
