// Generation: the model's forward pass over one sequence with a KV cache.
//
// The same ops as the training forward (model.cpp), on the rows of one
// sequence only: a prompt runs as one causal attention over its positions
// (the prefill), each later token as one query attending to the cached keys
// and values (Backend::attention_decode). Nothing is kept for a backward,
// so one layer's activations are reused by every layer, and each layer's
// output replaces its input in place (cache.residual).
#include <algorithm>
#include <string>

#include "model.h"
#include "nanoq/errors.h"

namespace nanoq {

KvCache ModelMemory::allocate_kv_cache(NamedAllocator& alloc) const {
    const ModelConfig& c = config_;
    const std::int64_t T = T_, C = c.hidden_size, I = c.intermediate_size;
    const std::int64_t HD = std::int64_t(c.num_heads) * c.head_dim, KD = std::int64_t(c.num_kv_heads) * c.head_dim;
    auto make = [&](const std::string& name, DType dtype, std::int64_t elements) {
        return alloc.allocate(Context::KvCache, "kv-cache." + name, dtype, {elements});
    };
    KvCache cache;
    cache.capacity = T_;
    for (int l = 0; l < c.num_layers; ++l) {
        cache.keys.push_back(make("layer." + std::to_string(l) + ".keys", dtype_, T * KD));
        cache.values.push_back(make("layer." + std::to_string(l) + ".values", dtype_, T * KD));
    }
    cache.tokens = make("tokens", DType::I32, T);
    cache.residual = make("residual", dtype_, T * C);
    cache.residual_mid = make("residual-mid", dtype_, T * C);
    cache.norm = make("norm", dtype_, T * C);
    cache.rstd = make("rstd", DType::F32, T);
    cache.q = make("q", dtype_, T * HD);
    if (c.qk_norm) {
        cache.q_raw = make("q-raw", dtype_, T * HD);
        cache.k_raw = make("k-raw", dtype_, T * KD);
        cache.q_rstd = make("q-rstd", DType::F32, T * c.num_heads);
        cache.k_rstd = make("k-rstd", DType::F32, T * c.num_kv_heads);
    }
    cache.attention = make("attention", dtype_, T * HD);
    cache.lse = make("attention-lse", DType::F32, T * c.num_heads);
    cache.gate = make("gate", dtype_, T * I);
    cache.up = make("up", dtype_, T * I);
    cache.swiglu = make("swiglu", dtype_, T * I);
    cache.decode_workspace = make("decode-workspace", dtype_, 2 * T * HD);
    // As many rows of logits as the backend's least classifier chunk holds
    // (at least one): not the chunk training grew into the free memory, which
    // generation does not need (sampling reads one row; logits() takes all
    // rows a chunk at a time) and which made this cache gigabytes of fp32.
    cache.logit_rows = std::clamp(least_classifier_rows_, 1, T_);
    cache.logits = make("logits", DType::F32, std::int64_t(cache.logit_rows) * c.vocab_size);
    return cache;
}

void LlamaModel::layer_cached(int layer, const LayerWeights& w, KvCache& cache, int position, int count,
                              StackArena& stack) {
    const ModelConfig& c = config_;
    const int C = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
    const int HD = c.num_heads * D, KD = c.num_kv_heads * D;
    const std::int64_t n = count;
    Backend& be = backend_;
    auto rows = [&](const Tensor& t, std::int64_t width) { return t.slice(0, n * width); };
    const Tensor x = rows(cache.residual, C), mid = rows(cache.residual_mid, C), norm = rows(cache.norm, C);
    const Tensor rstd = rows(cache.rstd, 1), attention = rows(cache.attention, HD);
    const Tensor gate = rows(cache.gate, I), up = rows(cache.up, I), swiglu = rows(cache.swiglu, I);
    auto project = [&](int target, const Tensor& out, const Tensor& weight, const Tensor& bias, const Tensor& in,
                       int out_features, int in_features) {
        be.matmul_epilogue(out, in, weight, bias, count, out_features, in_features, false, true, false, 1.0f);
        adapter_forward(layer, target, w, out, in, out_features, in_features, stack, count);
    };

    // The new positions' keys and values go straight into the cache.
    // A bidirectional model's prompt pass attends both ways (its logits);
    // the trainer refuses decoding after it (Trainer::forward_cached).
    const AttentionShape shape{1, count, c.num_heads, c.num_kv_heads, D, c.causal};
    const QkvShape qkv_shape{shape, C, c.rms_norm_eps};
    const QkvActivations qkv_out{rows(cache.q, HD),
                                 cache.keys[layer].slice(position * std::int64_t(KD), n * KD),
                                 cache.values[layer].slice(position * std::int64_t(KD), n * KD),
                                 c.qk_norm ? rows(cache.q_raw, HD) : Tensor(),
                                 c.qk_norm ? rows(cache.k_raw, KD) : Tensor(),
                                 c.qk_norm ? rows(cache.q_rstd, c.num_heads) : Tensor(),
                                 c.qk_norm ? rows(cache.k_rstd, c.num_kv_heads) : Tensor()};
    const std::int64_t angles = D / 2 * 2;  // cos and sin per frequency
    const Tensor cos_sin = cos_sin_.slice(position * angles, n * angles);
    const QkvWeights qkv = qkv_weights(w);

    be.rmsnorm_forward(norm, rstd, x, w.input_norm, count, C, c.rms_norm_eps);
    if (has_adapter(w, {kLoraQ, kLoraK, kLoraV})) {
        be.qkv_projection(qkv_out, norm, qkv, qkv_shape);
        adapter_forward(layer, kLoraQ, w, c.qk_norm ? qkv_out.q_raw : qkv_out.q, norm, HD, C, stack, count);
        adapter_forward(layer, kLoraK, w, c.qk_norm ? qkv_out.k_raw : qkv_out.k, norm, KD, C, stack, count);
        adapter_forward(layer, kLoraV, w, qkv_out.v, norm, KD, C, stack, count);
        be.qk_norm_rope_forward(qkv_out, qkv, cos_sin, qkv_shape);
    } else {
        be.qkv_forward(qkv_out, norm, qkv, cos_sin, qkv_shape);
    }
    if (position == 0) {
        be.attention_forward(attention, rows(cache.lse, c.num_heads), qkv_out.q, qkv_out.k, qkv_out.v, Tensor(),
                             shape);
    } else {
        const std::int64_t cached = position + 1;
        const AttentionShape decode{1, position + 1, c.num_heads, c.num_kv_heads, D};
        be.attention_decode(attention, qkv_out.q, cache.keys[layer].slice(0, cached * KD),
                            cache.values[layer].slice(0, cached * KD), decode, cache.decode_workspace, cache.lse);
    }
    project(kLoraO, mid, w.o, w.o_bias, attention, C, HD);
    be.residual_rmsnorm_forward(mid, norm, rstd, x, mid, w.post_norm, count, C, c.rms_norm_eps);
    mlp_input_forward(layer, w, gate, up, swiglu, norm, count, true, true, stack);
    project(kLoraDown, x, w.down, w.down_bias, swiglu, C, I);  // the layer input is no longer needed
    be.accumulate(x, mid);
}

void LlamaModel::forward_cached(const ModelWeights& w, LayerSource& layers, KvCache& cache, int position, int count,
                                bool all_positions, StackArena& stack,
                                const std::function<void(const Tensor& logits, int first, int rows)>& emit) {
    // The trainer checks these for the caller; here they keep memory safe.
    if (count < 1 || position < 0 || position + count > cache.capacity || (position > 0 && count != 1))
        throw InternalError("forward_cached: " + std::to_string(count) + " tokens at position " +
                            std::to_string(position) + " do not fit a cache of " + std::to_string(cache.capacity));
    const ModelConfig& c = config_;
    const int C = c.hidden_size, V = c.vocab_size;
    dropout_active_ = model_dropout_active_ = false;  // inference: no dropout
    const Tensor x = cache.residual.slice(0, std::int64_t(count) * C);
    // position_ids_ starts with 0 .. T-1.
    embed(w, x, cache.tokens.slice(position, count), position_ids_.data ? position_ids_.slice(position, count) : Tensor(),
          count, stack);
    for (int l = 0; l < c.num_layers; ++l) layer_cached(l, layers.weights(l), cache, position, count, stack);
    const Tensor norm = cache.norm.slice(0, std::int64_t(count) * C);
    backend_.rmsnorm_forward(norm, cache.rstd.slice(0, count), x, w.final_norm, count, C, c.rms_norm_eps);
    const int first = all_positions ? 0 : count - 1;
    for (int row = first; row < count; row += cache.logit_rows) {
        const int rows = std::min(cache.logit_rows, count - row);
        const Tensor logits = cache.logits.slice(0, std::int64_t(rows) * V);
        backend_.matmul(logits, norm.slice(std::int64_t(row) * C, std::int64_t(rows) * C), w.lm_head, rows, V, C,
                        false, true, false);
        emit(logits, row, rows);
    }
}

}  // namespace nanoq
