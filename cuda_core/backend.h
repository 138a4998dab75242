// The op interface: everything the model and the trainer ask of a device.
//
// The model and trainer are written once against this interface; a backend
// (cpu/, later cuda/) implements it. Ops are issued in order on the device's
// queue and may run asynchronously: results meant for the host (loss sums,
// norms) are written into device tensors and read only after synchronize().
// Shapes are row-major; "rows" is always batch*time unless said otherwise.
// Weight gradients are accumulated (+=) because they sum over micro-batches;
// activation gradients are overwritten unless `accumulate` says otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "allocator.h"
#include "tensor.h"

namespace nanoq {

// Layout of the per-device statistics buffer filled by cross_entropy().
enum StatSlot : int {
    kLossSum = 0,   // sum of cross-entropy over counted tokens
    kTokens,        // number of counted tokens (target != -100)
    kLoss1kSum,     // the same, restricted to positions < 1024
    kTokens1k,
    kLseSum,        // sum of log-sum-exp over counted tokens
    kLseMax,        // max of log-sum-exp over counted tokens
    kZLossSum,      // sum of z_loss * lse^2 over counted tokens
    kStatCount
};

struct AdamWStep {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    int step;           // 1-based, for bias correction
    float grad_scale;   // multiplies the stored gradient (mean normalisation and clipping)
};

struct AttentionShape {
    int batch, time, heads, kv_heads, head_dim;
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual std::string name() const = 0;

    // Memory. raw_alloc returns nullptr when the memory is not available.
    virtual void* raw_alloc(std::size_t bytes, MemoryKind kind) = 0;
    virtual void raw_free(void* data, MemoryKind kind) = 0;
    virtual void copy_from_host(const Tensor& dst, const void* src) = 0;
    virtual void copy_to_host(void* dst, const Tensor& src) = 0;
    virtual void copy(const Tensor& dst, const Tensor& src) = 0;
    virtual void fill(const Tensor& t, float value) = 0;
    virtual void synchronize() = 0;

    // out[M,N] (+)= alpha * op(a) @ op(b), op(a) is [M,K], op(b) is [K,N];
    // trans_a means a is stored [K,M], trans_b means b is stored [N,K].
    virtual void matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                        bool trans_b, bool accumulate) = 0;
    virtual void add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) = 0;
    virtual void bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) = 0;  // dbias += colsum
    virtual void add(const Tensor& out, const Tensor& a, const Tensor& b) = 0;   // out = a + b
    virtual void accumulate(const Tensor& out, const Tensor& a) = 0;             // out += a

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
    virtual void rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads,
                              int head_dim) = 0;
    virtual void rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                               int head_dim) = 0;

    // Causal attention with grouped kv heads. q/out: [B,T,H,D]; k/v: [B,T,Hkv,D];
    // lse: [B,H,T] saved for backward. Scratch comes from `stack`.
    virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const AttentionShape& shape, StackArena& stack) = 0;
    // Stack bytes attention_forward/backward push at most (on top of the caller's).
    virtual std::size_t attention_stack_bytes(const AttentionShape& shape) const = 0;
    // dq, dk, dv are overwritten.
    virtual void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                    const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const AttentionShape& shape, StackArena& stack) = 0;

    // out = silu(gate) * up, elementwise. dgate may alias dout.
    virtual void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) = 0;
    virtual void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                                 const Tensor& up) = 0;

    // Fused classifier on a chunk of rows: reads logits[rows, vocab], adds the
    // loss statistics of the counted rows into stats[kStatCount] and, when
    // `with_grad`, overwrites logits with d(sum of (CE + z_loss*lse^2))/dlogits
    // (zero rows for ignored targets). `first_position` is the time index of
    // row 0 and `time` the sequence length (for the first-1024-positions loss).
    virtual void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows,
                               int vocab, int first_position, int time, float z_loss, bool with_grad) = 0;

    // AdamW on a contiguous range; param is the master copy.
    virtual void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const AdamWStep& step) = 0;
    // out[0] += sum(x^2)
    virtual void sum_squares(const Tensor& out, const Tensor& x) = 0;
};

// Registry of backends; the cpu backend is always there, others register
// themselves when their library is built in.
using BackendFactory = std::unique_ptr<Backend> (*)(int device, int threads);
void register_backend(const std::string& name, BackendFactory factory);
bool backend_available(const std::string& name);
std::unique_ptr<Backend> create_backend(const std::string& name, int device, int threads);

}  // namespace nanoq
