// The Llama-family transformer, written once against the op interface.
//
// Shape legend: B batch (per device), T time, C hidden, H heads, K kv heads,
// D head dim, I intermediate, V vocab; "rows" = B*T.
// The model owns its activations (saved for backward) and the RoPE table; the
// parameters and their gradients are views into flat buffers owned by the
// trainer (layout.h).
// Backward computes gradients of the SUM of per-token losses; the trainer
// divides by the number of counted tokens of the whole optimizer step.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "allocator.h"
#include "backend.h"
#include "layout.h"
#include "nanoq/config.h"

namespace nanoq {

// Where the model finds each layer's weights and puts its gradients. The
// trainer's sharding stages plug in here: weights may be gathered on demand
// and gradients reduced as soon as a layer's backward is done. Forward asks
// for layers in ascending order, backward in descending order.
class LayerSource {
public:
    virtual ~LayerSource() = default;
    virtual const LayerWeights& weights(int layer) = 0;
    virtual const LayerWeights& grads(int layer) = 0;  // before the layer's backward
    virtual void grads_done(int layer) = 0;            // after it
};

struct LayerActivations {
    Tensor input_norm, input_rstd;   // [rows, C], [rows]
    Tensor q_raw, k_raw;             // before q/k norm (qk_norm only)
    Tensor q_rstd, k_rstd;           // [rows*H], [rows*K] (qk_norm only)
    Tensor q, k, v;                  // after RoPE: [rows, H*D], [rows, K*D], [rows, K*D]
    Tensor attention, lse;           // [rows, H*D], [B, H, T]
    Tensor residual_mid;             // residual after attention [rows, C]
    Tensor post_norm, post_rstd;
    Tensor gate, up, swiglu;         // [rows, I]
};

// Which per-layer activations backward recomputes instead of keeping.
// Implications: "ffn" recomputes the swiglu output too; "block" keeps only
// each layer's input (the residual stream) and recomputes everything else.
struct Recompute {
    bool swiglu = false;  // silu(gate) * up
    bool norms = false;   // the two RMSNorm outputs (their rstd is kept)
    bool qkv = false;     // the attention inputs: q, k, v (and q/k norm inputs)
    bool ffn = false;     // gate, up and swiglu
    bool block = false;   // everything but the layer input

    // The chosen activations and those they imply (implied_recompute).
    static Recompute from(RecomputeSet chosen);
};

// What generation keeps for one sequence of up to `capacity` positions
// (context KvCache): every layer's keys and values after RoPE, the tokens,
// and one layer's activations for up to `capacity` rows, reused layer by
// layer (generation keeps nothing for a backward).
struct KvCache {
    int capacity = 0;
    std::vector<Tensor> keys, values;  // per layer [capacity, K*D]
    Tensor tokens;                     // int32 [capacity]
    Tensor residual, residual_mid;     // [capacity, C]
    Tensor norm, rstd;                 // [capacity, C], [capacity]: the layer's two norms in turn, then the final
    Tensor q, q_raw, k_raw;            // [capacity, H*D], with q/k norms [capacity, H*D], [capacity, K*D]
    Tensor q_rstd, k_rstd;             // [capacity*H], [capacity*K] (q/k norms only)
    Tensor attention, lse;             // [capacity, H*D], [H, capacity]
    Tensor gate, up, swiglu;           // [capacity, I]
    Tensor decode_workspace;           // [2 * capacity * H*D]: Backend::attention_decode's
    Tensor logits;                     // float32 [logit_rows, V]
    int logit_rows = 0;
};

// What a LlamaModel allocates (the RoPE table, the residual stream, each
// layer's kept activations, the final norm, the LoRA gradient sink) and the
// sizes derived from its shapes (the activation stack, the backend's op
// scratch). It needs no backend: the memory plan (plan_memory in
// nanoq/trainer.h) builds one against a planning allocator, running the same
// code that a LlamaModel runs when it is built.
class ModelMemory {
public:
    // Activations (and the stack's tensors) are `dtype`; statistics float32.
    // classifier_chunk_elements: the backend's (BackendPlugin).
    ModelMemory(const ModelConfig& config, int batch, int time, DType dtype, Recompute recompute, const Lora& lora,
                std::int64_t classifier_chunk_elements, NamedAllocator& allocator);

    // Bytes of activation stack that forward_backward needs at most.
    std::size_t stack_bytes() const;
    // The shapes the backend's ops will see (max_reduce left for the caller).
    ScratchShapes scratch_shapes() const;
    // Rows per classifier chunk: at first the backend's chunk
    // (classifier_chunk_elements / vocab, at least 1), then what the caller
    // chooses (at least 1, at most batch * time) before it sizes the stack
    // and the scratch from stack_bytes() and scratch_shapes().
    int classifier_chunk_rows() const { return classifier_rows_; }
    void use_classifier_rows(int rows);
    // Generation's cache for sequences of up to seq_len positions, allocated
    // in context KvCache (by LlamaModel::forward_cached's caller, and by the
    // memory plan against its planning allocator).
    KvCache allocate_kv_cache(NamedAllocator& allocator) const;

protected:
    // One activation of a layer: where it lives in LayerActivations, and
    // whether it is recomputed (then it exists only on the stack, while its
    // layer's forward or backward runs).
    struct ActivationSpec {
        Tensor LayerActivations::*member;
        std::string name;
        std::vector<std::int64_t> dims;
        DType dtype;
        bool recomputed;
    };
    bool recomputed(Tensor LayerActivations::*member) const;
    // The layer's stored activations plus stack tensors for the recomputed ones.
    LayerActivations with_transients(const LayerActivations& stored, StackFrame& frame) const;
    std::size_t transient_bytes() const;
    // Stack bytes an adapter needs while it runs (0 without LoRA).
    std::size_t adapter_bytes() const;

    ModelConfig config_;
    int B_, T_, rows_;
    DType dtype_;
    int classifier_rows_;
    int least_classifier_rows_;  // the backend's chunk, before use_classifier_rows
    AttentionShape attention_shape_;
    QkvShape qkv_shape_;
    Tensor cos_sin_;                   // [T, D/2, 2] (the identity with learned positions)
    Tensor position_ids_;              // int32 [rows]: r % T, learned positions only
    std::vector<Tensor> residual_;     // L+1 tensors [rows, C]: residual stream before each layer, and after the last
    std::vector<ActivationSpec> specs_;
    std::vector<LayerActivations> layers_;  // stored activations; recomputed ones are empty
    Tensor final_norm_, final_rstd_;
    Lora lora_;
    Tensor frozen_grad_sink_;        // [max(C, D)] float32, with LoRA only
};

class LlamaModel : public ModelMemory {
public:
    // Allocates as ModelMemory does, then fills the RoPE table on `backend`.
    // With `lora` enabled, layers carry adapters and the weights are frozen.
    LlamaModel(const ModelConfig& config, int batch, int time, DType dtype, Recompute recompute, const Lora& lora,
               std::int64_t classifier_chunk_elements, Backend& backend, NamedAllocator& allocator);

    // Forward, fused classifier and backward of one micro-batch: adds the
    // gradients of the summed loss into `grads` and the loss statistics into
    // `stats`. tokens/targets: int32 [B, T] on the device.
    // `weights`/`grads` give the embedding, final norm and head; `layers`
    // the transformer layers. An empty gradient tensor is a frozen
    // parameter: its gradient is not computed. `dropout_seed` (one uint64
    // on the device, as Backend::scale_dropout's seed_base; empty without
    // LoRA or model dropout) keys the dropout masks of this micro-batch:
    // read by the kernels, so that a captured step draws new masks.
    void forward_backward(const ModelWeights& weights, const ModelWeights& grads, LayerSource& layers,
                          const Tensor& tokens, const Tensor& targets, const Tensor& stats, float z_loss,
                          StackArena& stack, const Tensor& dropout_seed);
    // Whether the micro-batches that follow carry per-token positions
    // (packed documents): `positions` int32 [B, T] on the device, each
    // token's position in its document (Backend::attention_forward), or
    // empty for none (positions 0 .. T-1 in every row, the default). With
    // positions, issues the gather of their RoPE angles (a [B*T, D/2, 2]
    // table allocated in `allocator` on first use), and the backend derives
    // what its attention needs from them (Backend::positions_changed); the
    // tensor must keep its values while the micro-batches run.
    void use_positions(const Tensor& positions, NamedAllocator& allocator);
    // Forward and loss statistics only.
    void forward_loss(const ModelWeights& weights, LayerSource& layers, const Tensor& tokens, const Tensor& targets,
                      const Tensor& stats, float z_loss, StackArena& stack);

    // Runs the `count` tokens at cache.tokens[position, position + count)
    // through the model, keeping their keys and values in the cache: a whole
    // prompt (position 0), or one token after the `position` cached ones
    // (count 1). Then `emit(logits, first, rows)` receives float32 logits
    // [rows, V] of positions position + first ..: of every new position when
    // `all_positions` (in chunks of cache.logit_rows), else of the last.
    void forward_cached(const ModelWeights& weights, LayerSource& layers, KvCache& cache, int position, int count,
                        bool all_positions, StackArena& stack,
                        const std::function<void(const Tensor& logits, int first, int rows)>& emit);

private:
    void forward(const ModelWeights& w, LayerSource& layers, const Tensor& tokens, StackArena& stack);
    // out[rows, C] = the tokens' embeddings (plus those of `positions`, with
    // learned positions).
    void embed(const ModelWeights& w, const Tensor& out, const Tensor& tokens, const Tensor& positions, int rows,
               StackArena& stack);
    // gate, up (with their biases and adapters) and swiglu of x[rows, C],
    // each when asked to run: the packed composite where nothing comes
    // between the projection and SwiGLU.
    void mlp_input_forward(int layer, const LayerWeights& w, const Tensor& gate, const Tensor& up,
                           const Tensor& swiglu, const Tensor& x, int rows, bool gate_up_runs, bool swiglu_runs,
                           StackArena& stack);
    // Model dropout: site 0 is the attention output, 1 the MLP output of
    // `layer`; layer num_layers, site 0 the embedding. Each its own stream of
    // the micro-batch's seed, so backward and recompute redraw the mask.
    static std::uint64_t dropout_stream(int layer, int site);
    void block_dropout(int layer, int site, const Tensor& out, const Tensor& in);
    // One layer of forward_cached, in place on cache.residual.
    void layer_cached(int layer, const LayerWeights& w, KvCache& cache, int position, int count, StackArena& stack);
    // The layer's forward steps. With `output`, all of them (the forward
    // pass); without, only those whose results are recomputed (backward).
    void layer_steps(int layer, const LayerWeights& w, LayerActivations& a, const Tensor& input,
                     const Tensor* output, StackArena& stack);
    void layer_backward(int layer, const LayerWeights& w, const LayerWeights& g, const LayerActivations& stored,
                        const Tensor& input, const Tensor& dresidual, StackArena& stack);
    // The adapter of projection `target` (if any): out[rows, n] += scale *
    // dropout(x[rows, k]) A^T B^T. Backward: adapter gradients, dx += d/dx.
    // `rows` defaults to the micro-batch's (generation passes its own).
    void adapter_forward(int layer, int target, const LayerWeights& w, const Tensor& out, const Tensor& x, int n,
                         int k, StackArena& stack, int rows = -1);
    void adapter_backward(int layer, int target, const LayerWeights& w, const LayerWeights& g, const Tensor& dx,
                          const Tensor& dy, const Tensor& x, int n, int k, StackArena& stack);
    // On `frame`: the adapter's input (x after dropout; x itself without)
    // and h = scale * input A^T.
    std::pair<Tensor, Tensor> adapter_hidden(int layer, int target, const LayerWeights& w, const Tensor& x, int k,
                                             int rows, StackFrame& frame);
    // The packed q/k/v projection's parameters and gradients of a layer (the
    // q/k norm gradients a sink when frozen).
    QkvWeights qkv_weights(const LayerWeights& w) const;
    QkvWeights qkv_grads(const LayerWeights& g) const;
    // Whether any of `targets` has an adapter in this layer: then the packed
    // composites run in their halves, with the adapters in between.
    static bool has_adapter(const LayerWeights& w, std::initializer_list<int> targets);
    // The projection inputs a layer's forward defines and its backward takes
    // again (Backend::projection_input): which of the kProjectionSites.
    enum ProjectionSite { kSiteQkv, kSiteO, kSiteGateUp, kSiteDown };
    static int projection_site(int layer, ProjectionSite which) { return layer * Backend::kProjectionSites + which; }
    // The dropout mask of one adapter: its stream of the micro-batch's seed.
    static std::uint64_t adapter_seed(int layer, int target);
    // Where a gradient goes: `grad`, or a scratch sink when it is frozen
    // (an empty tensor); for the norms, whose backward always writes one.
    const Tensor& or_sink(const Tensor& grad) const { return grad.data ? grad : frozen_grad_sink_; }
    // Loss over row chunks; with `dhidden` also its gradient (and lm_head's).
    void classifier(const ModelWeights& w, const ModelWeights* g, const Tensor& targets, const Tensor& stats,
                    float z_loss, const Tensor* dhidden, StackArena& stack);

    // The RoPE table and shape the layers rotate q, k with: per row of the
    // micro-batch (batch 1, time B*T) with positions, else per time index.
    const Tensor& rope_angles() const { return positions_.data && rope_rows_.data ? rope_rows_ : cos_sin_; }
    const QkvShape& rope_shape() const { return positions_.data && rope_rows_.data ? rope_rows_shape_ : qkv_shape_; }
    // The rows' indices into a learned position table: their positions in
    // their documents with use_positions, else r % T.
    const Tensor& learned_position_ids() const { return positions_.data ? positions_ : position_ids_; }

    Backend& backend_;
    Tensor positions_;               // use_positions'
    Tensor rope_rows_;               // [B*T, D/2, 2] float32, with positions
    QkvShape rope_rows_shape_;
    bool dropout_active_ = false;    // in forward_backward, when lora_.dropout > 0
    bool model_dropout_active_ = false;  // in forward_backward, when config_.dropout > 0
    Tensor dropout_seed_;            // forward_backward's

};

}  // namespace nanoq
