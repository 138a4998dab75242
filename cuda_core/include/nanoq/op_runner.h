// Single backend ops on host arrays: the test surface for backend parity.
//
// An OpRunner owns one device's backend (cpu, cuda, ...) and runs one op per
// call, so that tests can feed every backend the same inputs and compare the
// outputs op by op. Each call stages its own device memory and scratch, sized
// for that call, and frees them before returning: calls are independent and
// slow, which is what a test wants.
//
// Host arrays are float32 (tokens and targets int32; the loss statistics
// and sums of squares float64, as in the backends). `dtype` is the device
// dtype of the op's activation/weight tensors, as in the backend interface:
// F32 or BF16 (host values are cast to bf16 on the device and back). The
// tensors the interface keeps in float32 whatever the dtype (gradients of
// weights, biases and norms; rstd; lse; cos/sin; the AdamW gradient and
// scale) stay float32; the statistics are float64.
//
// Argument roles, as in the backend interface:
//   const float* x       input, uploaded;
//   float* x (in/out)    uploaded, updated by the op, copied back (+= ops);
//   float* x (output)    overwritten by the op: the device tensor is first
//                        filled with NaN, so an element the op fails to write
//                        comes back as NaN.
// Every call blocks until the device has finished. Calls from several threads
// run one at a time; a cuda runner for a device other than 0 must be called
// from the thread that created it (the backend selects its GPU there).
// Errors: InvalidArgument for a bad call, NanoqError for a failure inside the
// backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nanoq/errors.h"

namespace nanoq {

enum class OpDType : int { F32 = 0, BF16 = 1 };

class OpRunner {
public:
    // `threads`: OpenMP threads of the cpu backend (0 = all cores); ignored by others.
    OpRunner(const std::string& backend, int device, int threads = 0);
    ~OpRunner();
    OpRunner(const OpRunner&) = delete;
    OpRunner& operator=(const OpRunner&) = delete;

    const std::string& backend_name() const;
    int device() const;

    // Names of the slots of the cross_entropy statistics, in order (the
    // StatSlots of stat_slots.h), and the width of a row of optimizer_scale's
    // `gathered` (the slots, then the rank's sum of squared gradients).
    static std::vector<std::string> stat_slots();
    static int gather_stride();

    // Elementwise dtype conversion: host values uploaded as `src`, copied on
    // the device into a `dst` tensor, read back. fill: out[n] (output) = value.
    void copy(float* out, const float* x, std::int64_t n, OpDType src, OpDType dst);
    void fill(float* out, std::int64_t n, float value, OpDType dtype);

    // out[M,N] (+)= op(a) @ op(b); a is [M,K] ([K,M] when trans_a), b is
    // [K,N] ([N,K] when trans_b). out is in/out when `accumulate`, else an
    // output; its dtype `out_dtype` may be F32 with BF16 operands (weight gradients).
    void matmul(float* out, const float* a, const float* b, int M, int N, int K, bool trans_a, bool trans_b,
                bool accumulate, OpDType dtype, OpDType out_dtype);
    // out[rows,cols] (in/out) += bias[cols].
    void add_bias(float* out, const float* bias, int rows, int cols, OpDType dtype);
    // dbias[cols] (in/out, float32) += column sums of dout[rows,cols].
    void bias_backward(float* dbias, const float* dout, int rows, int cols, OpDType dtype);
    // out[n] (output) = a + b.   accumulate: out[n] (in/out) += a.
    void add(float* out, const float* a, const float* b, std::int64_t n, OpDType dtype);
    void accumulate(float* out, const float* a, std::int64_t n, OpDType dtype);
    // out[n] (output) = in * scale with dropout (Backend::scale_dropout).
    void scale_dropout(float* out, const float* in, std::int64_t n, float scale, float drop, std::uint64_t seed,
                       OpDType dtype);

    // out[rows,C] (output) = table[tokens[r]]; table is [vocab, C].
    void embedding_forward(float* out, const std::int32_t* tokens, const float* table, int rows, int channels,
                           int vocab, OpDType dtype);
    // table_grad[vocab,C] (in/out, float32) += scatter of dout[rows,C] by tokens.
    void embedding_backward(float* table_grad, const float* dout, const std::int32_t* tokens, int rows,
                            int channels, int vocab, OpDType dtype);

    // out[rows,C] and rstd[rows] (float32) are outputs.
    void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int rows, int channels,
                         float eps, OpDType dtype);
    // dinp[rows,C] (in/out when `accumulate`, else output), dweight[C] (in/out,
    // float32). With `dinp_aliases_dout` (needs !accumulate) the op is given
    // one device tensor, holding dout, as both dinp and dout.
    void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                          const float* rstd, int rows, int channels, bool accumulate, bool dinp_aliases_dout,
                          OpDType dtype);

    // x[B,T,H,D] (in/out) rotated in place; cos_sin [T, D/2, 2] float32.
    void rope_forward(float* x, const float* cos_sin, int batch, int time, int heads, int head_dim, OpDType dtype);
    void rope_backward(float* dx, const float* cos_sin, int batch, int time, int heads, int head_dim,
                       OpDType dtype);

    // Causal GQA attention. q, out: [B,T,H,D]; k, v: [B,T,Hkv,D]; lse [B,H,T]
    // float32. Forward: out and lse are outputs. Backward: dq, dk, dv are outputs.
    void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int batch,
                           int time, int heads, int kv_heads, int head_dim, OpDType dtype);
    void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                            const float* q, const float* k, const float* v, int batch, int time, int heads,
                            int kv_heads, int head_dim, OpDType dtype);

    // out[n] (output) = silu(gate) * up. Backward: dgate, dup outputs; with
    // `dgate_aliases_dout` one device tensor, holding dout, serves as both.
    void swiglu_forward(float* out, const float* gate, const float* up, std::int64_t n, OpDType dtype);
    void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                         std::int64_t n, bool dgate_aliases_dout, OpDType dtype);

    // logits[rows,vocab] (in/out: gradients when `with_grad`); targets[rows]
    // int32 in [0, vocab) or -100; stats[stat_slots().size()] (in/out, float64).
    void cross_entropy(float* logits, const std::int32_t* targets, double* stats, int rows, int vocab,
                       int first_position, int time, float z_loss, bool with_grad, OpDType dtype);

    // out[0] (in/out, float64) += sum of x[n]^2; x float32 only.
    void sum_squares(double* out, const float* x, std::int64_t n);
    // out[3] (output: scale, norm, skip flag; float32) from the float64
    // gathered[ranks, gather_stride()].
    void optimizer_scale(float* out, const double* gathered, int ranks, float grad_clip);
    // param[n] (dtype) and m, v[n] (state_dtype) in/out; grad[n] float32;
    // `scale` the factor applied to grad (a device value in the backend).
    void adamw(float* param, const float* grad, float* m, float* v, std::int64_t n, float scale, float lr,
               float beta1, float beta2, float eps, float weight_decay, int step, std::uint64_t seed, OpDType dtype,
               OpDType state_dtype);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace nanoq
