#include "model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <string>

#include "dropout.h"
#include "nanoq/errors.h"

namespace nanoq {

namespace {

// cos/sin of position * inverse frequency, with Llama-3 scaling when asked.
// With learned positions the model has no RoPE: the table is the identity
// rotation (cos 1, sin 0), which leaves q and k bitwise as they are.
std::vector<float> rope_table(const ModelConfig& c, int time) {
    const int half = c.head_dim / 2;
    if (c.max_positions > 0) {
        std::vector<float> identity(static_cast<std::size_t>(time) * half * 2, 0.0f);
        for (std::size_t i = 0; i < identity.size(); i += 2) identity[i] = 1.0f;
        return identity;
    }
    std::vector<double> inv_freq(half);
    for (int i = 0; i < half; ++i) {
        double f = 1.0 / std::pow(c.rope_theta, (2.0 * i) / c.head_dim);
        if (c.rope_llama3) {
            const double two_pi = 2.0 * 3.14159265358979323846;
            const double old = c.rope_original_max_position;
            const double low_wavelen = old / c.rope_low_freq_factor;
            const double high_wavelen = old / c.rope_high_freq_factor;
            const double wavelen = two_pi / f;
            if (wavelen > low_wavelen) {
                f = f / c.rope_factor;
            } else if (wavelen >= high_wavelen) {
                const double smooth =
                    (old / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
                f = (1.0 - smooth) * f / c.rope_factor + smooth * f;
            }
        }
        inv_freq[i] = f;
    }
    std::vector<float> table(static_cast<std::size_t>(time) * half * 2);
    for (int t = 0; t < time; ++t)
        for (int i = 0; i < half; ++i) {
            const double angle = t * static_cast<double>(static_cast<float>(inv_freq[i]));
            table[(static_cast<std::size_t>(t) * half + i) * 2] = static_cast<float>(std::cos(angle));
            table[(static_cast<std::size_t>(t) * half + i) * 2 + 1] = static_cast<float>(std::sin(angle));
        }
    return table;
}


}  // namespace

Recompute Recompute::from(RecomputeSet chosen) {
    const RecomputeSet r = implied_recompute(chosen);
    Recompute out;
    out.swiglu = r.has(kRecomputeSwiglu);
    out.norms = r.has(kRecomputeNorms);
    out.qkv = r.has(kRecomputeQkv);
    out.ffn = r.has(kRecomputeFfn);
    out.block = r.has(kRecomputeBlock);
    return out;
}

ModelMemory::ModelMemory(const ModelConfig& config, int batch, int time, DType dtype, Recompute recompute,
                         const Lora& lora, std::int64_t classifier_chunk_elements, NamedAllocator& alloc)
    : config_(config),
      B_(batch),
      T_(time),
      rows_(batch * time),
      dtype_(dtype),
      classifier_rows_(static_cast<int>(std::clamp<std::int64_t>(classifier_chunk_elements / config.vocab_size, 1,
                                                                  std::int64_t(batch) * time))),
      least_classifier_rows_(classifier_rows_),
      lora_(lora) {
    const ModelConfig& c = config_;
    const std::int64_t rows = rows_, C = c.hidden_size, I = c.intermediate_size;
    const std::int64_t HD = std::int64_t(c.num_heads) * c.head_dim, KD = std::int64_t(c.num_kv_heads) * c.head_dim;
    attention_shape_ = AttentionShape{B_, T_, c.num_heads, c.num_kv_heads, c.head_dim, c.causal};
    qkv_shape_ = QkvShape{attention_shape_, c.hidden_size, c.rms_norm_eps};

    cos_sin_ = alloc.allocate(Context::Workspace, "rope-cos-sin", DType::F32, {T_, c.head_dim / 2, 2});
    if (c.max_positions > 0) position_ids_ = alloc.allocate(Context::Workspace, "position-ids", DType::I32, {rows});

    for (int l = 0; l <= c.num_layers; ++l)
        residual_.push_back(
            alloc.allocate(Context::Activations, "residual." + std::to_string(l), dtype_, {rows, C}));

    using A = LayerActivations;
    const Recompute& r = recompute;
    auto spec = [&](Tensor A::*member, const char* name, std::vector<std::int64_t> dims, DType type, bool again) {
        specs_.push_back(ActivationSpec{member, name, std::move(dims), type, again});
    };
    const DType act = dtype_, f32 = DType::F32;
    spec(&A::input_norm, "input-norm", {rows, C}, act, r.norms);
    spec(&A::input_rstd, "input-rstd", {rows}, f32, r.block);
    if (c.qk_norm) {
        spec(&A::q_raw, "q-raw", {rows, HD}, act, r.qkv);
        spec(&A::k_raw, "k-raw", {rows, KD}, act, r.qkv);
        spec(&A::q_rstd, "q-rstd", {rows * c.num_heads}, f32, r.qkv);
        spec(&A::k_rstd, "k-rstd", {rows * c.num_kv_heads}, f32, r.qkv);
    }
    spec(&A::q, "q", {rows, HD}, act, r.qkv);
    spec(&A::k, "k", {rows, KD}, act, r.qkv);
    spec(&A::v, "v", {rows, KD}, act, r.qkv);
    spec(&A::attention, "attention", {rows, HD}, act, r.block);
    spec(&A::lse, "attention-lse", {B_, c.num_heads, T_}, f32, r.block);
    spec(&A::residual_mid, "residual-mid", {rows, C}, act, r.block);
    spec(&A::post_norm, "post-norm", {rows, C}, act, r.norms);
    spec(&A::post_rstd, "post-rstd", {rows}, f32, r.block);
    spec(&A::gate, "gate", {rows, I}, act, r.ffn);
    spec(&A::up, "up", {rows, I}, act, r.ffn);
    spec(&A::swiglu, "swiglu", {rows, I}, act, r.swiglu);

    layers_.resize(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l)
        for (const ActivationSpec& s : specs_) {
            if (s.recomputed) continue;
            Tensor t = alloc.allocate(Context::Activations, "layer." + std::to_string(l) + "." + s.name, s.dtype,
                                      {std::accumulate(s.dims.begin(), s.dims.end(), std::int64_t(1),
                                                       std::multiplies<std::int64_t>())});
            layers_[l].*s.member = t;
        }
    final_norm_ = alloc.allocate(Context::Activations, "final-norm", dtype_, {rows, C});
    final_rstd_ = alloc.allocate(Context::Activations, "final-rstd", DType::F32, {rows});
    if (lora_.enabled())
        frozen_grad_sink_ = alloc.allocate(Context::Workspace, "frozen-norm-gradients", DType::F32,
                                           {std::max<std::int64_t>(C, c.head_dim)});
}

LlamaModel::LlamaModel(const ModelConfig& config, int batch, int time, DType dtype, Recompute recompute,
                       const Lora& lora, std::int64_t classifier_chunk_elements, Backend& backend,
                       NamedAllocator& alloc)
    : ModelMemory(config, batch, time, dtype, recompute, lora, classifier_chunk_elements, alloc), backend_(backend) {
    backend_.copy_from_host(cos_sin_, rope_table(config_, T_).data());
    if (position_ids_.data) {
        std::vector<std::int32_t> positions(rows_);
        for (int r = 0; r < rows_; ++r) positions[r] = r % T_;
        backend_.copy_from_host(position_ids_, positions.data());
    }
}

bool ModelMemory::recomputed(Tensor LayerActivations::*member) const {
    for (const ActivationSpec& s : specs_)
        if (s.member == member) return s.recomputed;
    return false;
}

LayerActivations ModelMemory::with_transients(const LayerActivations& stored, StackFrame& frame) const {
    LayerActivations a = stored;
    for (const ActivationSpec& s : specs_)
        if (s.recomputed)
            a.*s.member = frame.push(s.name, s.dtype, {std::accumulate(s.dims.begin(), s.dims.end(), std::int64_t(1),
                                                                       std::multiplies<std::int64_t>())});
    return a;
}

std::size_t ModelMemory::transient_bytes() const {
    std::size_t bytes = 0;
    for (const ActivationSpec& s : specs_)
        if (s.recomputed)
            bytes += StackArena::aligned(dtype_size(s.dtype) * std::accumulate(s.dims.begin(), s.dims.end(),
                                                                              std::int64_t(1),
                                                                              std::multiplies<std::int64_t>()));
    return bytes;
}

void ModelMemory::use_classifier_rows(int rows) {
    if (rows < 1 || rows > rows_)
        throw InternalError("classifier chunk of " + std::to_string(rows) + " rows, outside 1.." +
                            std::to_string(rows_));
    classifier_rows_ = rows;
}

std::size_t ModelMemory::stack_bytes() const {
    // Mirrors the pushes of forward_backward; the stack throws if this is short.
    const ModelConfig& c = config_;
    const std::int64_t rows = rows_, C = c.hidden_size, I = c.intermediate_size;
    const std::int64_t HD = std::int64_t(c.num_heads) * c.head_dim, KD = std::int64_t(c.num_kv_heads) * c.head_dim;
    auto bytes = [&](std::int64_t elements) { return StackArena::aligned(dtype_size(dtype_) * elements); };
    const std::size_t classifier = bytes(rows * C) + bytes(std::int64_t(classifier_chunk_rows()) * c.vocab_size);
    // Model dropout keeps the masked gradient of each block's output apart
    // from the residual stream's.
    const std::size_t dropped = c.dropout > 0.0f ? bytes(rows * C) : 0;
    const std::size_t mlp = 2 * bytes(rows * I) + bytes(rows * C) + dropped;
    const std::size_t attention = 2 * bytes(rows * HD) + 2 * bytes(rows * KD) + bytes(rows * C) + dropped;
    // The looked-up positions, before the layers run.
    const std::size_t positions = c.max_positions > 0 ? bytes(rows * C) : 0;
    const std::size_t forward = std::max(positions, transient_bytes() + adapter_bytes());
    const std::size_t backward =
        bytes(rows * C) + std::max(classifier, transient_bytes() + std::max(mlp, attention) + adapter_bytes());
    return std::max(forward, backward);
}

std::size_t ModelMemory::adapter_bytes() const {
    if (!lora_.enabled()) return 0;
    std::int64_t widest_input = 0;
    for (int t = 0; t < kLoraTargetCount; ++t)
        if (lora_.targets[t]) widest_input = std::max(widest_input, projection_shape(config_, t).second);
    const std::size_t dropped = lora_.dropout > 0.0f ? StackArena::aligned(dtype_size(dtype_) * rows_ * widest_input) : 0;
    return dropped + StackArena::aligned(dtype_size(dtype_) * rows_ * lora_.rank);
}

ScratchShapes ModelMemory::scratch_shapes() const {
    ScratchShapes shapes{attention_shape_, config_.hidden_size, config_.intermediate_size, config_.vocab_size,
                         classifier_chunk_rows(), 0};
    shapes.dtype = dtype_ == DType::BF16 ? Precision::BF16 : Precision::FP32;
    shapes.layers = config_.num_layers;
    return shapes;
}

void LlamaModel::forward(const ModelWeights& w, LayerSource& layers, const Tensor& tokens, StackArena& stack) {
    const ModelConfig& c = config_;
    embed(w, residual_[0], tokens, learned_position_ids(), rows_, stack);
    if (model_dropout_active_)
        backend_.scale_dropout(residual_[0], residual_[0], 1.0f, c.dropout, dropout_stream(c.num_layers, 0),
                               dropout_seed_);
    for (int l = 0; l < c.num_layers; ++l) {
        StackFrame frame(stack);
        LayerActivations a = with_transients(layers_[l], frame);
        layer_steps(l, layers.weights(l), a, residual_[l], &residual_[l + 1], stack);
    }
    backend_.rmsnorm_forward(final_norm_, final_rstd_, residual_[c.num_layers], w.final_norm, rows_, c.hidden_size,
                             c.rms_norm_eps);
}

QkvWeights LlamaModel::qkv_weights(const LayerWeights& w) const {
    return QkvWeights{w.qkv, w.qkv_bias, w.q_norm, w.k_norm};
}

QkvWeights LlamaModel::qkv_grads(const LayerWeights& g) const {
    if (!config_.qk_norm) return QkvWeights{g.qkv, g.qkv_bias, Tensor(), Tensor()};
    return QkvWeights{g.qkv, g.qkv_bias, or_sink(g.q_norm), or_sink(g.k_norm)};
}

void LlamaModel::embed(const ModelWeights& w, const Tensor& out, const Tensor& tokens, const Tensor& positions,
                       int rows, StackArena& stack) {
    const int C = config_.hidden_size;
    backend_.embedding_forward(out, tokens, w.embed, rows, C);
    if (!w.positions.data) return;
    StackFrame frame(stack);
    const Tensor looked_up = frame.push("position-embedding", dtype_, {rows, C});
    backend_.embedding_forward(looked_up, positions, w.positions, rows, C);
    backend_.accumulate(out, looked_up);
}

void LlamaModel::mlp_input_forward(int layer, const LayerWeights& w, const Tensor& gate, const Tensor& up,
                                   const Tensor& swiglu, const Tensor& x, int rows, bool gate_up_runs,
                                   bool swiglu_runs, StackArena& stack) {
    const int C = config_.hidden_size, I = config_.intermediate_size;
    Backend& be = backend_;
    if (gate_up_runs && swiglu_runs && !config_.mlp_bias && !has_adapter(w, {kLoraGate, kLoraUp}))
        return be.gate_up_swiglu_forward(swiglu, gate, up, x, w.gate_up, rows, I, C);
    if (gate_up_runs) {
        be.gate_up_projection(gate, up, x, w.gate_up, rows, I, C);
        if (config_.mlp_bias) {
            be.add_bias(gate, w.gate_bias, rows, I);
            be.add_bias(up, w.up_bias, rows, I);
        }
        adapter_forward(layer, kLoraGate, w, gate, x, I, C, stack, rows);
        adapter_forward(layer, kLoraUp, w, up, x, I, C, stack, rows);
    }
    if (swiglu_runs) be.swiglu_forward(swiglu, gate, up);
}

std::uint64_t LlamaModel::dropout_stream(int layer, int site) {
    // Past every adapter's stream (adapter_seed): 2^32 + two sites per layer.
    return (std::uint64_t(1) << 32) + std::uint64_t(layer) * 2 + site;
}

void LlamaModel::block_dropout(int layer, int site, const Tensor& out, const Tensor& in) {
    backend_.scale_dropout(out, in, 1.0f, config_.dropout, dropout_stream(layer, site), dropout_seed_);
}

bool LlamaModel::has_adapter(const LayerWeights& w, std::initializer_list<int> targets) {
    for (int t : targets)
        if (w.lora_a[t].data) return true;
    return false;
}

void LlamaModel::layer_steps(int layer, const LayerWeights& w, LayerActivations& a, const Tensor& input,
                             const Tensor* output, StackArena& stack) {
    const ModelConfig& c = config_;
    const int C = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
    const int HD = c.num_heads * D, KD = c.num_kv_heads * D;
    Backend& be = backend_;
    // A step runs in the forward pass, or in backward when its result is
    // recomputed; recomputing repeats the same ops on the same inputs, so
    // the values are bitwise those of the forward pass. (A composite that a
    // backend fuses must therefore give bitwise the results of its parts
    // where recompute runs a part alone: rmsnorm, swiglu.)
    auto runs = [&](Tensor LayerActivations::*result) { return output != nullptr || recomputed(result); };
    auto project = [&](int target, const Tensor& out, const Tensor& weight, const Tensor& bias, const Tensor& x, int n,
                       int k) {
        be.matmul_epilogue(out, x, weight, bias, rows_, n, k, false, true, false, 1.0f);
        adapter_forward(layer, target, w, out, x, n, k, stack);
    };
    const QkvWeights qkv = qkv_weights(w);
    const QkvActivations qkv_out{a.q, a.k, a.v, a.q_raw, a.k_raw, a.q_rstd, a.k_rstd};

    if (runs(&LayerActivations::input_norm))
        be.rmsnorm_forward(a.input_norm, a.input_rstd, input, w.input_norm, rows_, C, c.rms_norm_eps);
    if (runs(&LayerActivations::q)) {
        be.projection_input(projection_site(layer, kSiteQkv), true);
        if (has_adapter(w, {kLoraQ, kLoraK, kLoraV})) {  // the adapters add to the projections before RoPE
            be.qkv_projection(qkv_out, a.input_norm, qkv, qkv_shape_);
            adapter_forward(layer, kLoraQ, w, c.qk_norm ? a.q_raw : a.q, a.input_norm, HD, C, stack);
            adapter_forward(layer, kLoraK, w, c.qk_norm ? a.k_raw : a.k, a.input_norm, KD, C, stack);
            adapter_forward(layer, kLoraV, w, a.v, a.input_norm, KD, C, stack);
            be.qk_norm_rope_forward(qkv_out, qkv, rope_angles(), rope_shape());
        } else {
            be.qkv_forward(qkv_out, a.input_norm, qkv, rope_angles(), rope_shape());
        }
    }
    const bool attention_runs = runs(&LayerActivations::attention), post_norm_runs = runs(&LayerActivations::post_norm);
    if (attention_runs) {
        be.attention_forward(a.attention, a.lse, a.q, a.k, a.v, positions_, attention_shape_);
        be.projection_input(projection_site(layer, kSiteO), true);
        project(kLoraO, a.residual_mid, w.o, w.o_bias, a.attention, C, HD);
        if (model_dropout_active_) block_dropout(layer, 0, a.residual_mid, a.residual_mid);
    }
    // Recomputing the attention implies recomputing the norms (Recompute::parse).
    if (attention_runs && post_norm_runs)
        be.residual_rmsnorm_forward(a.residual_mid, a.post_norm, a.post_rstd, input, a.residual_mid, w.post_norm,
                                    rows_, C, c.rms_norm_eps);
    else if (attention_runs)
        be.accumulate(a.residual_mid, input);
    else if (post_norm_runs)
        be.rmsnorm_forward(a.post_norm, a.post_rstd, a.residual_mid, w.post_norm, rows_, C, c.rms_norm_eps);
    if (runs(&LayerActivations::gate)) be.projection_input(projection_site(layer, kSiteGateUp), true);
    mlp_input_forward(layer, w, a.gate, a.up, a.swiglu, a.post_norm, rows_, runs(&LayerActivations::gate),
                      runs(&LayerActivations::swiglu), stack);
    if (output) {
        be.projection_input(projection_site(layer, kSiteDown), true);
        project(kLoraDown, *output, w.down, w.down_bias, a.swiglu, C, I);
        if (model_dropout_active_) block_dropout(layer, 1, *output, *output);
        be.accumulate(*output, a.residual_mid);
    }
}

void LlamaModel::layer_backward(int layer, const LayerWeights& w, const LayerWeights& g,
                                const LayerActivations& stored, const Tensor& input, const Tensor& dresidual,
                                StackArena& stack) {
    // On entry dresidual is d(loss)/d(layer output); on exit d/d(layer input).
    StackFrame transients(stack);
    LayerActivations a = with_transients(stored, transients);
    layer_steps(layer, w, a, input, nullptr, stack);
    const ModelConfig& c = config_;
    const int C = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
    const int HD = c.num_heads * D, KD = c.num_kv_heads * D;
    Backend& be = backend_;
    // dx = dy @ W (overwrite or accumulate), dW += dy^T x, dbias += colsum(dy)
    // (frozen weights get no gradient); then the adapter's share.
    auto project_backward = [&](int target, const Tensor& dx, bool accumulate, const Tensor& dweight,
                                const Tensor& dbias, const Tensor& dy, const Tensor& weight, const Tensor& x, int n,
                                int k) {
        be.matmul_backward(dx, accumulate, dweight, dbias, dy, weight, x, rows_, n, k);
        adapter_backward(layer, target, w, g, dx, dy, x, n, k, stack);
    };
    // The gradient of a block's output before its dropout: the residual
    // stream's gradient through the same mask (itself without dropout).
    auto block_output_grad = [&](int site, StackFrame& frame) {
        if (!model_dropout_active_) return dresidual;
        Tensor d = frame.push("d-block-output", dtype_, {rows_, C});
        block_dropout(layer, site, d, dresidual);
        return d;
    };
    {
        StackFrame frame(stack);
        Tensor dgate = frame.push("d-gate", dtype_, {rows_, I});
        Tensor dup = frame.push("d-up", dtype_, {rows_, I});
        const Tensor dmlp = block_output_grad(1, frame);
        be.projection_input(projection_site(layer, kSiteDown), false);
        project_backward(kLoraDown, dgate, false, g.down, g.down_bias, dmlp, w.down, a.swiglu, C, I);
        Tensor dnorm = frame.push("d-post-norm", dtype_, {rows_, C});
        if (c.mlp_bias || has_adapter(w, {kLoraGate, kLoraUp})) {
            be.swiglu_backward(dgate, dup, dgate, a.gate, a.up);
            be.projection_input(projection_site(layer, kSiteGateUp), false);
            be.gate_up_projection_backward(dnorm, false, g.gate_up, dgate, dup, a.post_norm, w.gate_up, rows_, I, C);
            if (g.gate_bias.data) {
                be.bias_backward(g.gate_bias, dgate, rows_, I);
                be.bias_backward(g.up_bias, dup, rows_, I);
            }
            adapter_backward(layer, kLoraGate, w, g, dnorm, dgate, a.post_norm, I, C, stack);
            adapter_backward(layer, kLoraUp, w, g, dnorm, dup, a.post_norm, I, C, stack);
        } else {
            be.projection_input(projection_site(layer, kSiteGateUp), false);
            be.swiglu_gate_up_backward(dnorm, false, g.gate_up, dgate, dup, dgate, a.gate, a.up, a.post_norm,
                                       w.gate_up, rows_, I, C);
        }
        be.residual_rmsnorm_backward(dresidual, or_sink(g.post_norm), dnorm, a.residual_mid, w.post_norm, a.post_rstd,
                                     rows_, C);
    }
    {
        StackFrame frame(stack);
        Tensor datt = frame.push("d-attention", dtype_, {rows_, HD});
        const Tensor dattention_out = block_output_grad(0, frame);
        be.projection_input(projection_site(layer, kSiteO), false);
        project_backward(kLoraO, datt, false, g.o, g.o_bias, dattention_out, w.o, a.attention, C, HD);
        Tensor dq = frame.push("d-q", dtype_, {rows_, HD});
        Tensor dk = frame.push("d-k", dtype_, {rows_, KD});
        Tensor dv = frame.push("d-v", dtype_, {rows_, KD});
        be.attention_backward(dq, dk, dv, datt, a.attention, a.lse, a.q, a.k, a.v, positions_, attention_shape_);
        Tensor dnorm = frame.push("d-input-norm", dtype_, {rows_, C});
        const QkvActivations qkv_in{a.q, a.k, a.v, a.q_raw, a.k_raw, a.q_rstd, a.k_rstd};
        const QkvWeights qkv = qkv_weights(w), dqkv = qkv_grads(g);
        if (has_adapter(w, {kLoraQ, kLoraK, kLoraV})) {
            be.qk_norm_rope_backward(dq, dk, qkv_in, qkv, dqkv, rope_angles(), rope_shape());
            be.projection_input(projection_site(layer, kSiteQkv), false);
            be.qkv_projection_backward(dnorm, false, dqkv, dq, dk, dv, a.input_norm, qkv, qkv_shape_);
            adapter_backward(layer, kLoraQ, w, g, dnorm, dq, a.input_norm, HD, C, stack);
            adapter_backward(layer, kLoraK, w, g, dnorm, dk, a.input_norm, KD, C, stack);
            adapter_backward(layer, kLoraV, w, g, dnorm, dv, a.input_norm, KD, C, stack);
        } else {
            be.projection_input(projection_site(layer, kSiteQkv), false);
            be.qkv_backward(dnorm, false, dqkv, dq, dk, dv, qkv_in, a.input_norm, qkv, rope_angles(), rope_shape());
        }
        be.residual_rmsnorm_backward(dresidual, or_sink(g.input_norm), dnorm, input, w.input_norm, a.input_rstd,
                                     rows_, C);
    }
}

std::pair<Tensor, Tensor> LlamaModel::adapter_hidden(int layer, int target, const LayerWeights& w, const Tensor& x,
                                                     int k, int rows, StackFrame& frame) {
    Backend& be = backend_;
    Tensor input = x;
    if (dropout_active_) {
        input = frame.push("lora-dropout", dtype_, {rows, k});
        be.scale_dropout(input, x, 1.0f, lora_.dropout, adapter_seed(layer, target), dropout_seed_);
    }
    Tensor h = frame.push("lora-h", dtype_, {rows, lora_.rank});
    be.matmul_epilogue(h, input, w.lora_a[target], Tensor(), rows, lora_.rank, k, false, true, false,
                       lora_.scale);  // h = scale * x A^T
    return {input, h};
}

std::uint64_t LlamaModel::adapter_seed(int layer, int target) {
    return std::uint64_t(layer) * kLoraTargetCount + target;
}

void LlamaModel::adapter_forward(int layer, int target, const LayerWeights& w, const Tensor& out, const Tensor& x,
                                 int n, int k, StackArena& stack, int rows) {
    if (!w.lora_a[target].data) return;
    if (rows < 0) rows = rows_;
    StackFrame frame(stack);
    const Tensor h = adapter_hidden(layer, target, w, x, k, rows, frame).second;
    backend_.matmul(out, h, w.lora_b[target], rows, n, lora_.rank, false, true, true);  // out += h B^T
}

void LlamaModel::adapter_backward(int layer, int target, const LayerWeights& w, const LayerWeights& g,
                                  const Tensor& dx, const Tensor& dy, const Tensor& x, int n, int k,
                                  StackArena& stack) {
    if (!w.lora_a[target].data) return;
    Backend& be = backend_;
    const int r = lora_.rank;
    StackFrame frame(stack);
    const auto [input, h] = adapter_hidden(layer, target, w, x, k, rows_, frame);  // as in forward
    be.matmul(g.lora_b[target], dy, h, n, r, rows_, true, false, true);  // dB += dy^T h
    const Tensor dh = h;                                                  // h is no longer needed
    be.matmul_epilogue(dh, dy, w.lora_b[target], Tensor(), rows_, r, n, false, false, false,
                       lora_.scale);  // dh = scale * dy B
    be.matmul(g.lora_a[target], dh, input, r, k, rows_, true, false, true);  // dA += dh^T dropout(x)
    if (!dropout_active_) return be.matmul(dx, dh, w.lora_a[target], rows_, k, r, false, false, true);  // dx += dh A
    be.matmul(input, dh, w.lora_a[target], rows_, k, r, false, false, false);  // the same mask on the way back
    be.scale_dropout(input, input, 1.0f, lora_.dropout, adapter_seed(layer, target), dropout_seed_);
    be.accumulate(dx, input);
}

void LlamaModel::classifier(const ModelWeights& w, const ModelWeights* g, const Tensor& targets,
                            const Tensor& stats, float z_loss, const Tensor* dhidden, StackArena& stack) {
    const int C = config_.hidden_size, V = config_.vocab_size;
    StackFrame frame(stack);
    Tensor workspace = frame.push("logits", dtype_, {classifier_chunk_rows(), V});
    backend_.classifier(final_norm_, w.lm_head, targets, stats, dhidden ? *dhidden : Tensor(),
                        dhidden ? g->lm_head : Tensor(), workspace, rows_, C, V, T_, z_loss);
}

void LlamaModel::forward_backward(const ModelWeights& w, const ModelWeights& g, LayerSource& layers,
                                  const Tensor& tokens, const Tensor& targets, const Tensor& stats, float z_loss,
                                  StackArena& stack, const Tensor& dropout_seed) {
    const ModelConfig& c = config_;
    dropout_active_ = lora_.dropout > 0.0f;
    model_dropout_active_ = c.dropout > 0.0f;
    if ((dropout_active_ || model_dropout_active_) && !dropout_seed.data)
        throw InternalError("dropout needs the micro-batch's seed");
    dropout_seed_ = dropout_seed;
    forward(w, layers, tokens, stack);
    StackFrame frame(stack);
    Tensor dresidual = frame.push("d-residual", dtype_, {rows_, c.hidden_size});
    {
        StackFrame head(stack);
        Tensor dhidden = head.push("d-final-norm", dtype_, {rows_, c.hidden_size});
        classifier(w, &g, targets, stats, z_loss, &dhidden, stack);
        backend_.rmsnorm_backward(dresidual, or_sink(g.final_norm), dhidden, residual_[c.num_layers], w.final_norm,
                                  final_rstd_, rows_, c.hidden_size, false);
    }
    for (int l = c.num_layers - 1; l >= 0; --l) {
        // Weights first: a source that gathers them may reuse a buffer.
        const LayerWeights& weights = layers.weights(l);
        layer_backward(l, weights, layers.grads(l), layers_[l], residual_[l], dresidual, stack);
        layers.grads_done(l);
    }
    if (model_dropout_active_)
        backend_.scale_dropout(dresidual, dresidual, 1.0f, c.dropout, dropout_stream(c.num_layers, 0), dropout_seed_);
    if (g.embed.data) backend_.embedding_backward(g.embed, dresidual, tokens, rows_, c.hidden_size);
    if (g.positions.data)
        backend_.embedding_backward(g.positions, dresidual, learned_position_ids(), rows_, c.hidden_size);
    dropout_active_ = model_dropout_active_ = false;
}

void LlamaModel::use_positions(const Tensor& positions, NamedAllocator& allocator) {
    if (positions.data && !config_.causal)
        throw InvalidArgument("positions (packed documents) need a causal model (model.causal)");
    positions_ = positions;
    backend_.positions_changed(positions, attention_shape_);
    if (!positions.data) return;
    if (config_.max_positions > 0) return;  // learned positions read positions_ (learned_position_ids); no RoPE
    const int half = config_.head_dim / 2;
    if (!rope_rows_.data) {
        rope_rows_ = allocator.allocate(Context::Workspace, "rope-cos-sin-per-token", DType::F32, {rows_, half, 2});
        rope_rows_shape_ = qkv_shape_;
        rope_rows_shape_.attention.batch = 1;
        rope_rows_shape_.attention.time = rows_;
    }
    // Row r of the table is the angles of position positions[r]: a lookup
    // of the per-time table, as an embedding of width D/2 * 2.
    backend_.embedding_forward(rope_rows_, positions, cos_sin_, rows_, half * 2);
}

void LlamaModel::forward_loss(const ModelWeights& w, LayerSource& layers, const Tensor& tokens,
                              const Tensor& targets, const Tensor& stats, float z_loss, StackArena& stack) {
    dropout_active_ = model_dropout_active_ = false;  // evaluation: no dropout
    forward(w, layers, tokens, stack);
    classifier(w, nullptr, targets, stats, z_loss, nullptr, stack);
}

}  // namespace nanoq
