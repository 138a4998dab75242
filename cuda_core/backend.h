// The op interface: everything the model and the trainer ask of a device.
//
// The model and trainer are written once against this interface; a backend
// (cpu/, cuda/) implements it. Ops are issued in order on the device's queue
// and may run asynchronously: results meant for the host (loss sums, norms)
// are written into device tensors and read only after synchronize().
// Shapes are row-major; "rows" is always batch*time unless said otherwise.
// Tensors carry their dtype: activations and weights are float32 or bf16,
// gradients, rstd and lse are float32, statistics float64 (stat_slots.h),
// tokens int32. A backend dispatches on dtype in one place and throws for
// combinations it lacks.
// Weight gradients are accumulated (+=) because they sum over micro-batches;
// activation gradients are overwritten unless `accumulate` says otherwise.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "adamw_slots.h"
#include "allocator.h"
#include "comm.h"
#include "nanoq/config.h"
#include "nanoq/errors.h"
#include "stat_slots.h"
#include "tensor.h"

namespace nanoq {

constexpr DType kStatDType = DType::F64;  // of the statistics (StatValue, stat_slots.h)

// The shapes of the packed q/k/v projection: rows = batch * time of
// `attention`, `hidden` input channels; eps of the q/k norms.
struct QkvShape {
    AttentionShape attention;
    int hidden;
    float eps;
};

// The parameters (or their gradients) of the packed q/k/v projection:
// views into the flat layout (layout.h), empty where absent or frozen.
struct QkvWeights {
    Tensor qkv;             // [(H + 2K) * D, C]: q rows, then k, then v
    Tensor qkv_bias;        // [(H + 2K) * D] or empty
    Tensor q_norm, k_norm;  // [D] each, with the q/k norms (Qwen3) only
};

// The activations of the packed q/k/v projection. q, k, v: [rows, H*D],
// [rows, K*D], [rows, K*D] after norms and RoPE; with the q/k norms, q_raw
// and k_raw hold the projections before them and q_rstd [rows*H], k_rstd
// [rows*K] their saved rstd (all empty without q/k norms).
struct QkvActivations {
    Tensor q, k, v;
    Tensor q_raw, k_raw;
    Tensor q_rstd, k_rstd;
};

// The uint64 a scale_dropout seed_base holds (an int32 tensor of 2).
inline const std::uint64_t* seed_base_value(const Tensor& seed_base) {
    if (seed_base.dtype != DType::I32 || seed_base.numel() != 2)
        throw InternalError("a dropout seed base is one uint64, stored as an int32 tensor of 2");
    return static_cast<const std::uint64_t*>(seed_base.data);
}

struct AdamWStep {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    int step;            // 1-based, for bias correction
    std::uint64_t seed;  // for stochastic rounding of bf16 outputs
};

// The whole-shard AdamW update (Backend::adamw_shard); its tables' layout
// is in adamw_slots.h.
struct AdamWSegment {
    std::int64_t begin;  // first element, relative to the shard
    std::int64_t count;
    bool decay;
};

// The values of step_values for one step (float32 expressions as adamw() uses them).
std::vector<double> adamw_step_values(const AdamWStep& step, std::uint64_t seed);
// The table of `segments` as adamw_shard reads it.
std::vector<double> adamw_segment_table(const std::vector<AdamWSegment>& segments);

// The tensors of one shard: master (float32 or bf16), weights (the copy
// the model reads, written from the updated master; empty when master is
// it), grad (float32), m and v (one dtype), all [n] but the tables.
struct AdamWShard {
    Tensor master, weights, grad, m, v;
    Tensor scale;        // [3] as optimizer_scale writes it
    Tensor step_values;  // [kAdamWStepSlots] float64
    Tensor segments;     // [segments, kAdamWSegmentSlots] float64
    // Elements of the rounding chunk: a segment is updated as adamw() calls
    // on successive chunks of this many elements from its start.
    std::int64_t chunk;
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual std::string name() const = 0;
    // The run's options, given once right after the backend is made, before
    // anything is allocated: a backend keeps the choices meant for it
    // (attention, cuda_graphs, matmul_dtype) and throws InvalidArgument for
    // one it cannot honour. The default keeps nothing: a backend without a
    // fast path computes the same without one.
    virtual void configure(const TrainOptions& options) { (void)options; }
    // Called (outside any captured work, on this device's queue) after
    // something wrote this device's weights: update() and set_parameter().
    // A backend that keeps copies derived from the weights (cuda's fp8
    // weight cache) drops them here; the default keeps none.
    virtual void weights_changed() {}
    // A hint for fp8's current scaling across the passes (the default takes
    // none): the next op's projection input x (the activation the op
    // multiplies by a weight, or by whose transpose it forms the weight
    // gradient) holds `site`'s value of this micro-batch. `defines` in the
    // forward: the op may keep what it learns of x (cuda: its largest
    // magnitude); not in the backward: the op may use what was kept. The
    // model calls it right before the op, and guarantees that the backward's
    // x is bitwise the forward's (kept, or recomputed by the same ops).
    // Sites: kProjectionSites per layer, layer * kProjectionSites + which
    // (LlamaModel::projection_site).
    static constexpr int kProjectionSites = 4;  // q|k|v, o, gate|up, down
    virtual void projection_input(int site, bool defines) {
        (void)site;
        (void)defines;
    }

    // Runs `body`, which issues this device's work for a piece of a step
    // that repeats: the same ops on the same buffers whenever `key` repeats.
    // A backend with CUDA graphs (cuda, unless cuda_graphs is off) captures
    // the body's stream work when it sees `key` again (the first call is a
    // warm-up, run as it is) and launches that graph instead of running the
    // body from then on. So the body must
    // leave no host-side effect that later work relies on, `key` must name
    // everything that changes the issued work (which ops, shapes, pointers,
    // kernel arguments, collectives), and values that change between runs
    // (seeds, learning rate, step) must reach the kernels through device
    // memory written before the call. The body may not wait for the device
    // or read results back. The default runs the body.
    virtual void run_captured(const std::string& key, const std::function<void()>& body) {
        (void)key;
        body();
    }
    // Drops what run_captured keeps (its graphs; a launch in flight still
    // completes). Called on this device's queue before its communicator is
    // released: NCCL's finalize waits until every graph holding one of its
    // collectives is destroyed, so a graph kept past it hangs the close.
    virtual void release_captured() {}

    // Memory. raw_alloc returns nullptr when the memory is not available;
    // refusal() then says why where the backend knows more than that.
    virtual void* raw_alloc(std::size_t bytes, MemoryKind kind) = 0;
    virtual void raw_free(void* data, MemoryKind kind) = 0;
    virtual std::string refusal() const { return ""; }
    // What an out-of-memory error advises when the model state (not the
    // activations) does not fit: by default, for devices with memory of
    // their own.
    virtual std::string state_memory_advice() const { return device_state_memory_advice(); }
    static std::string device_state_memory_advice() {
        return "use more devices (ZeRO-1 shards master weights and AdamW state across them), a smaller model, or "
               "bf16 master/optimizer state";
    }
    virtual void reserve_scratch(NamedAllocator& allocator, const ScratchShapes& shapes) = 0;
    virtual void copy_from_host(const Tensor& dst, const void* src) = 0;
    // From memory of device `source_device` of this backend (a peer copy).
    virtual void copy_from_device(const Tensor& dst, const void* src, int source_device) = 0;
    virtual void copy_to_host(void* dst, const Tensor& src) = 0;
    // Elementwise copy of equal element counts, converting the dtype.
    virtual void copy(const Tensor& dst, const Tensor& src) = 0;
    virtual void fill(const Tensor& t, float value) = 0;
    virtual void synchronize() = 0;
    // A batch in this backend's device memory that the caller wrote on
    // streams of its own (handles as the CUDA Array Interface v3 gives them:
    // 1 the legacy default stream, 2 the per-thread default stream, else a
    // cudaStream_t; 0 entries are skipped). record_batch_ready runs on the
    // caller's thread (the one that names its per-thread stream), on the
    // backend of the batch's device: it marks what those streams have queued
    // so far. Then each rank's wait_batch_ready(that backend), on the rank's
    // thread, orders the rank's later work after the marks.
    virtual void record_batch_ready(const std::uintptr_t* streams, int count) {
        for (int i = 0; i < count; ++i)
            if (streams[i]) throw InvalidArgument("the " + name() + " backend has no streams to wait for");
    }
    virtual void wait_batch_ready(Backend& /*source*/) {}
    // Micro-batch uploads: a copy from the trainer's host staging (memory
    // of the plugin's staging_kind) whose source stays unchanged until
    // wait_batch_read(). mark_batch_read marks the batch copies issued so far
    // (from staging or from device memory); wait_batch_read blocks the
    // calling thread until they have completed, so that their sources may
    // be overwritten.
    virtual void copy_from_staging(const Tensor& dst, const void* src) { copy_from_host(dst, src); }
    virtual void mark_batch_read() {}
    virtual void wait_batch_read() {}
    // Free and total bytes of the device, when the backend can tell.
    virtual bool memory_info(std::size_t* free_bytes, std::size_t* total_bytes) = 0;

    // out[M,N] (+)= op(a) @ op(b), op(a) is [M,K], op(b) is [K,N];
    // trans_a means a is stored [K,M], trans_b means b is stored [N,K].
    virtual void matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                        bool trans_b, bool accumulate) = 0;
    virtual void add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) = 0;
    virtual void bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) = 0;  // dbias += colsum
    virtual void add(const Tensor& out, const Tensor& a, const Tensor& b) = 0;   // out = a + b
    virtual void accumulate(const Tensor& out, const Tensor& a) = 0;             // out += a
    // out = in * scale, with dropout when drop > 0: element i is zeroed
    // unless dropout_keep(s, i, drop) (dropout.h), and kept ones are
    // scaled by 1 / (1 - drop). out may alias in. The mask's seed s is
    // `seed`, or, when `seed_base` is given (one uint64 in this device's
    // memory, as an int32 tensor of 2), dropout_mask_seed(seed, seed_base):
    // read when the op runs, so that a replayed graph draws new masks.
    virtual void scale_dropout(const Tensor& out, const Tensor& in, float scale, float drop, std::uint64_t seed,
                               const Tensor& seed_base) = 0;

    virtual void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int rows,
                                   int channels) = 0;
    // table_grad += scatter(dout); deterministic order.
    virtual void embedding_backward(const Tensor& table_grad, const Tensor& dout, const Tensor& tokens, int rows,
                                    int channels) = 0;

    // out = inp * rstd * weight per row of `channels`; rstd[rows] is saved for backward.
    virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight,
                                 int rows, int channels, float eps) = 0;
    // dinp (+)= d/dinp; dweight += d/dweight. dinp may alias dout when !accumulate.
    virtual void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                  const Tensor& weight, const Tensor& rstd, int rows, int channels,
                                  bool accumulate) = 0;

    // In-place rotary embedding of x[batch, time, heads, head_dim] with the
    // half-split convention; cos_sin is [time, head_dim/2, 2] (cos, sin).
    // Tokens at positions of their own (packed documents) are rotated as
    // batch 1, time batch * time, with a table of one row per token.
    virtual void rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads,
                              int head_dim) = 0;
    virtual void rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                               int head_dim) = 0;

    // Attention with grouped kv heads. q/out: [B,T,H,D]; k/v: [B,T,Hkv,D];
    // lse: [B,H,T] saved for backward. shape.causal false: every query
    // attends every key of its row. `positions` is empty, or (causal only)
    // int32 [B,T]: each token's position in its document, 0 where a
    // document starts, so that query t attends keys t - positions[t] .. t
    // (packed documents do not see each other). Empty costs nothing.
    virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& positions, const AttentionShape& shape) = 0;
    // Which attention this backend runs, as chosen by reserve_scratch (from
    // ScratchShapes::attention_impl): "native" for its own kernels, else
    // the fused library's name ("cuDNN 9.28.1"); `plans` counts the fused
    // library's plans built so far (one per shape, dtype and pass).
    virtual AttentionInfo attention_info() const { return AttentionInfo{}; }
    // `positions` (as in attention_forward; empty: none) holds a new batch's
    // positions: a backend that derives state from them for its attention
    // calls (cuda: the documents' mask of its fused attention) derives it
    // here, once, for the calls that pass this tensor until the next
    // positions_changed. A call whose positions were not so announced
    // derives it itself.
    virtual void positions_changed(const Tensor& positions, const AttentionShape& shape) {
        (void)positions;
        (void)shape;
    }
    // dq, dk, dv are overwritten; positions and shape as in attention_forward.
    virtual void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                    const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& positions, const AttentionShape& shape) = 0;

    // Generation's attention (batch 1): the query of position time-1,
    // q/out [H*D], over the cached keys and values k/v [time, Hkv*D] of
    // positions 0 .. time-1 (shape.batch 1, shape.time the cached length);
    // the same as attention_forward's last row. `workspace` (q's dtype,
    // 2 * time * H * D elements) and `lse_workspace` (float32, H * time)
    // are the caller's, for a backend that computes it as a causal attention
    // over `time` positions (cuda); the cpu attends with the one query alone.
    virtual void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionShape& shape, const Tensor& workspace,
                                  const Tensor& lse_workspace) = 0;

    // out = silu(gate) * up, elementwise. dgate may alias dout.
    virtual void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) = 0;
    virtual void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                                 const Tensor& up) = 0;

    // Fused classifier on a chunk of rows: reads logits[rows, vocab], adds the
    // loss statistics of the counted rows into stats[kStatCount] (float64) and, when
    // `with_grad`, overwrites logits with d(sum of (CE + z_loss*lse^2))/dlogits
    // (zero rows for ignored targets). `first_position` is the time index of
    // row 0 and `time` the sequence length (for the first-1024-positions loss).
    virtual void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows,
                               int vocab, int first_position, int time, float z_loss, bool with_grad) = 0;

    // out[0] (float64) += sum(x^2) of a float32 tensor, in a fixed order.
    virtual void sum_squares(const Tensor& out, const Tensor& x) = 0;
    // From the gathered float64 rows [ranks, kGatherStride]: out[0] = clip / tokens,
    // the factor applied to the stored (summed-loss) gradients, and out[1] =
    // the mean-loss gradient norm, where norm = sqrt(sum squares) / tokens and
    // clip = grad_clip / norm when 0 < grad_clip < norm, else 1; out[2] = 1
    // (skip the update) when the loss or the gradient is not finite or when
    // no token counted (then out[0] = out[1] = 0: there is nothing to learn
    // from, and a zero-gradient AdamW step would still move the weights
    // through weight decay and momentum), else 0.
    // Stays on the device so that update() needs no host round trip;
    // grad_clip is a float64 [1] device tensor (the step table's
    // kAdamWGradClip slot), so that a captured launch replays with new values.
    virtual void optimizer_scale(const Tensor& out, const Tensor& gathered, int ranks, const Tensor& grad_clip) = 0;
    // AdamW on a contiguous range of the master copy `param`; the gradient
    // used is grad * scale[0]; nothing changes when scale[2] != 0.
    virtual void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const Tensor& scale, const AdamWStep& step) = 0;
    // AdamW over a whole shard (AdamWShard above), each segment with its
    // own weight decay, then the weights written from the updated master.
    // The default body reads the two tables back to the host and calls
    // adamw() and copy() per segment and chunk; an override does it in one
    // launch, bitwise equal (the same per-element rounding noise).
    virtual void adamw_shard(const AdamWShard& shard);

    // ---- Composite ops ----------------------------------------------------
    // Each has a default body (composites.cpp) that issues the primitives
    // above in the order the model issued them before composites existed, so
    // a backend that overrides nothing computes bitwise what it computed
    // then. A backend overrides a composite where a fused kernel pays; the
    // op tests compare every override with the default (Backend::op called
    // explicitly) on the same inputs.

    // out[M,N] = scale * op(a) @ op(b) + bias[N], or with `accumulate`
    // out += op(a) @ op(b) + bias (scale must be 1 then). `bias` may be
    // empty (none); out's dtype may differ from a and b as in matmul (the
    // bias has out's dtype).
    virtual void matmul_epilogue(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M,
                                 int N, int K, bool trans_a, bool trans_b, bool accumulate, float scale);
    // The input gradient of y[rows,n] = x[rows,k] W^T (W stored [n,k]):
    // dx[rows,k] = dy W, or dx += dy W with `accumulate`. The projections'
    // backward calls this (an override may change its precision, as cuda's
    // fp8 does), never the adapters' small products, which call matmul.
    virtual void matmul_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                                   bool accumulate);
    // The weight gradient of y[rows,n] = x[rows,k] W^T + bias:
    // dweight[n,k] += dy^T x and, when dbias is not empty, dbias[n] += the
    // column sums of dy.
    virtual void matmul_weight_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                    int rows, int n, int k);
    // The backward of a projection y[rows,n] = x[rows,k] W^T + bias: dx
    // (+)= dy W as matmul_input_grad, then, unless dweight is empty (frozen),
    // dweight and dbias as matmul_weight_grad. One op so that an override
    // may share work between the two products (cuda's fp8 quantizes dy once
    // for both).
    virtual void matmul_backward(const Tensor& dx, bool accumulate, const Tensor& dweight, const Tensor& dbias,
                                 const Tensor& dy, const Tensor& weight, const Tensor& x, int rows, int n, int k);

    // residual_out = residual + delta, out = rmsnorm(residual_out) * weight
    // with rstd[rows] saved. residual_out may alias residual or delta.
    virtual void residual_rmsnorm_forward(const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                                          const Tensor& residual, const Tensor& delta, const Tensor& weight, int rows,
                                          int channels, float eps);
    // Backward of the above: dresidual (in/out) holds d/d(residual_out) and
    // gets the norm's input gradient added, which makes it the gradient of
    // both residual and delta; dweight += d/dweight.
    virtual void residual_rmsnorm_backward(const Tensor& dresidual, const Tensor& dweight, const Tensor& dout,
                                           const Tensor& residual_out, const Tensor& weight, const Tensor& rstd,
                                           int rows, int channels);

    // The packed q/k/v projection of x[rows, C] (rows = batch * time):
    // `weights.qkv` is [(H + 2K) * D, C], the q rows, then k, then v;
    // `weights.qkv_bias` [(H + 2K) * D] or empty. qkv_projection writes
    // x W^T + bias into q, k, v (into q_raw, k_raw instead of q, k when
    // the q/k norms are on); qk_norm_rope_forward applies the q/k norms
    // (q_raw -> q, rstd saved) and RoPE on q and k in place; qkv_forward
    // is both. Between the two halves the caller may add to the projections
    // (LoRA adapters).
    virtual void qkv_projection(const QkvActivations& a, const Tensor& x, const QkvWeights& weights,
                                const QkvShape& shape);
    virtual void qk_norm_rope_forward(const QkvActivations& a, const QkvWeights& weights, const Tensor& cos_sin,
                                      const QkvShape& shape);
    virtual void qkv_forward(const QkvActivations& a, const Tensor& x, const QkvWeights& weights,
                             const Tensor& cos_sin, const QkvShape& shape);
    // Backward, in place on dq, dk (and dv): qk_norm_rope_backward turns the
    // gradients of the rotated q, k into those of the projections (adding
    // the q/k norm weight gradients into grads.q_norm, grads.k_norm);
    // qkv_projection_backward writes dx[rows, C] (or adds into it with
    // `accumulate`) and adds the packed weight and bias gradients into
    // grads.qkv, grads.qkv_bias (skipped where those are empty: frozen);
    // qkv_backward is both.
    virtual void qk_norm_rope_backward(const Tensor& dq, const Tensor& dk, const QkvActivations& a,
                                       const QkvWeights& weights, const QkvWeights& grads, const Tensor& cos_sin,
                                       const QkvShape& shape);
    virtual void qkv_projection_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads,
                                         const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& x,
                                         const QkvWeights& weights, const QkvShape& shape);
    virtual void qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, const QkvActivations& a, const Tensor& x,
                              const QkvWeights& weights, const Tensor& cos_sin, const QkvShape& shape);

    // The packed gate|up projection of x[rows, C] by gate_up [2I, C] (the
    // gate rows, then up): gate, up [rows, I] = x W^T. gate_up_swiglu_forward
    // also writes out = silu(gate) * up.
    virtual void gate_up_projection(const Tensor& gate, const Tensor& up, const Tensor& x, const Tensor& gate_up,
                                    int rows, int intermediate, int channels);
    virtual void gate_up_swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const Tensor& x,
                                        const Tensor& gate_up, int rows, int intermediate, int channels);
    // Backward of the projection: dx[rows, C] = dgate Wg + dup Wu (added
    // into dx with `accumulate`), dgate_up [2I, C] += the weight gradient
    // (skipped when empty: frozen). swiglu_gate_up_backward first runs the
    // SwiGLU backward from dout (which may alias dgate) into dgate and dup.
    virtual void gate_up_projection_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up,
                                             const Tensor& dgate, const Tensor& dup, const Tensor& x,
                                             const Tensor& gate_up, int rows, int intermediate, int channels);
    virtual void swiglu_gate_up_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up,
                                         const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                                         const Tensor& gate, const Tensor& up, const Tensor& x,
                                         const Tensor& gate_up, int rows, int intermediate, int channels);

    // The classifier: logits = hidden[rows, C] lm_head[V, C]^T, the
    // cross-entropy statistics of the counted rows added into stats (see
    // cross_entropy; row r is at time index r % time) and, when dhidden is
    // not empty, dhidden[rows, C] = dlogits lm_head (overwritten) and, when
    // dlm_head is not empty, dlm_head += dlogits^T hidden. `workspace`
    // (hidden's dtype) holds the logits of a chunk of rows (at least one row
    // of V): the caller sizes it (ModelMemory::classifier_chunk_rows, from
    // BackendPlugin::classifier_chunk_elements and the memory budget), so
    // that a memory plan knows it without a backend; the default body works
    // through the rows a workspace-full at a time (one matmul for dlm_head
    // when the workspace holds all rows).
    virtual void classifier(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, const Tensor& stats,
                            const Tensor& dhidden, const Tensor& dlm_head, const Tensor& workspace, int rows,
                            int channels, int vocab, int time, float z_loss);
};

// One buffer that a backend's reserve_scratch allocates (context Workspace),
// planned from the ScratchShapes alone; `exact` as in AllocationInfo.
struct ScratchBuffer {
    std::string name;
    DType dtype;
    std::int64_t elements;
    MemoryKind kind;
    bool exact;
};
// Allocates the planned buffers, in order.
std::vector<Tensor> allocate_scratch(NamedAllocator& allocator, const std::vector<ScratchBuffer>& plan);

// A backend implementation: how to make a device's backend and a group of
// communicators for N devices. Optional backends live in their own shared
// library, loaded on first use, which registers itself when loaded.
struct BackendPlugin {
    std::unique_ptr<Backend> (*create_backend)(int device, int threads);
    std::shared_ptr<CommGroup> (*create_group)(const Topology& topology);
    int (*device_count)();  // devices usable now (0 when none or no driver)
    // What reserve_scratch allocates for `shapes` on a backend of `threads`
    // threads per device, in order, computed without allocating: the one
    // definition that reserve_scratch and the memory estimator share. Sizes
    // that a library reports at run time (CUB's temporary storage) are asked
    // of it when `ask_libraries`; when it cannot answer (no device) or is not
    // asked, an upper bound stands in and the buffer is marked inexact.
    std::vector<ScratchBuffer> (*scratch_plan)(const ScratchShapes& shapes, int threads, bool ask_libraries);
    // Elements of the smallest logits chunk the fused classifier works on:
    // large enough to keep the device busy, small enough to bound its
    // memory. A property of the backend, not of a device, so that a run's
    // memory can be planned without creating one. The trainer's chunk grows
    // from there (up to all rows) into the memory budget: the memory limit,
    // or without one the device's memory (device_memory below).
    std::int64_t classifier_chunk_elements;
    // The host-writable memory that the trainer stages host batches in:
    // pinned where that makes the copies out of it asynchronous (cuda), the
    // device's own where that is host memory (cpu).
    MemoryKind staging_kind;
    // A fresh communicator id (Topology::id) for a world of several trainers
    // or processes: bytes to hand to every member.
    std::string (*new_comm_id)();
    // The fused attention library built into the backend, in words
    // ("cuDNN 9.28.1"), or "" for none; null: the backend has no such notion.
    std::string (*attention_library)() = nullptr;
    // Total bytes of memory of device `device`, asked of the driver (the
    // calling thread's current device is left as it was); 0 when unknown
    // (no driver, no such device). Null: the backend's devices have no
    // memory of their own to budget (cpu).
    std::size_t (*device_memory)(int device) = nullptr;
};
void register_backend(const std::string& name, const BackendPlugin& plugin);
// Loads the backend's library if needed; throws InvalidArgument when it is
// not built into this install and NanoqError when it cannot be loaded.
const BackendPlugin& find_backend(const std::string& name);
// Whether the backend is compiled into this install (without loading it).
bool backend_built(const std::string& name);

}  // namespace nanoq
