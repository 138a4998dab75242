// A view of a backend that runs every op with a default body (the
// composites, adamw_shard) as that default body, down to the primitives:
// each primitive goes to the wrapped backend, and no op with a default body
// is overridden here. The op harness's use_default runs an op on it, so
// that a composite whose default body calls another composite (qkv_forward
// calls qk_norm_rope_forward, which calls matmul_epilogue) compares the
// backend's fused ops with the plain composition of its primitives, not
// with its own fused parts.
#pragma once

#include <string>

#include "backend.h"

namespace nanoq::ops {

class DefaultComposites final : public Backend {
public:
    explicit DefaultComposites(Backend& primitives) : be_(primitives) {}

    std::string name() const override { return be_.name(); }
    void* raw_alloc(std::size_t bytes, MemoryKind kind) override { return be_.raw_alloc(bytes, kind); }
    void raw_free(void* data, MemoryKind kind) override { be_.raw_free(data, kind); }
    void reserve_scratch(NamedAllocator& allocator, const ScratchShapes& shapes) override {
        be_.reserve_scratch(allocator, shapes);
    }
    void copy_from_host(const Tensor& dst, const void* src) override { be_.copy_from_host(dst, src); }
    void copy_from_device(const Tensor& dst, const void* src, int source_device) override {
        be_.copy_from_device(dst, src, source_device);
    }
    void copy_to_host(void* dst, const Tensor& src) override { be_.copy_to_host(dst, src); }
    void copy(const Tensor& dst, const Tensor& src) override { be_.copy(dst, src); }
    void fill(const Tensor& t, float value) override { be_.fill(t, value); }
    void synchronize() override { be_.synchronize(); }
    void record_batch_ready(const std::uintptr_t* streams, int count) override {
        be_.record_batch_ready(streams, count);
    }
    void wait_batch_ready(Backend& source) override { be_.wait_batch_ready(source); }
    void copy_from_staging(const Tensor& dst, const void* src) override { be_.copy_from_staging(dst, src); }
    void mark_batch_read() override { be_.mark_batch_read(); }
    void wait_batch_read() override { be_.wait_batch_read(); }
    bool memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
        return be_.memory_info(free_bytes, total_bytes);
    }

    void matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a, bool trans_b,
                bool accumulate) override {
        be_.matmul(out, a, b, M, N, K, trans_a, trans_b, accumulate);
    }
    void add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) override {
        be_.add_bias(out, bias, rows, cols);
    }
    void bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) override {
        be_.bias_backward(dbias, dout, rows, cols);
    }
    void add(const Tensor& out, const Tensor& a, const Tensor& b) override { be_.add(out, a, b); }
    void accumulate(const Tensor& out, const Tensor& a) override { be_.accumulate(out, a); }
    void scale_dropout(const Tensor& out, const Tensor& in, float scale, float drop, std::uint64_t seed,
                       const Tensor& seed_base) override {
        be_.scale_dropout(out, in, scale, drop, seed, seed_base);
    }
    void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int rows,
                           int channels) override {
        be_.embedding_forward(out, tokens, table, rows, channels);
    }
    void embedding_backward(const Tensor& table_grad, const Tensor& dout, const Tensor& tokens, int rows,
                            int channels) override {
        be_.embedding_backward(table_grad, dout, tokens, rows, channels);
    }
    void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, int rows,
                         int channels, float eps) override {
        be_.rmsnorm_forward(out, rstd, inp, weight, rows, channels, eps);
    }
    void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                          const Tensor& weight, const Tensor& rstd, int rows, int channels, bool accumulate) override {
        be_.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, rows, channels, accumulate);
    }
    void rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads, int head_dim) override {
        be_.rope_forward(x, cos_sin, batch, time, heads, head_dim);
    }
    void rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                       int head_dim) override {
        be_.rope_backward(dx, cos_sin, batch, time, heads, head_dim);
    }
    void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& positions, const AttentionShape& shape) override {
        be_.attention_forward(out, lse, q, k, v, positions, shape);
    }
    AttentionInfo attention_info() const override { return be_.attention_info(); }
    void positions_changed(const Tensor& positions, const AttentionShape& shape) override {
        be_.positions_changed(positions, shape);
    }
    void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& positions, const AttentionShape& shape) override {
        be_.attention_backward(dq, dk, dv, dout, out, lse, q, k, v, positions, shape);
    }
    void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionShape& shape, const Tensor& workspace, const Tensor& lse_workspace) override {
        be_.attention_decode(out, q, k, v, shape, workspace, lse_workspace);
    }
    void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override {
        be_.swiglu_forward(out, gate, up);
    }
    void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                         const Tensor& up) override {
        be_.swiglu_backward(dgate, dup, dout, gate, up);
    }
    void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows, int vocab,
                       int first_position, int time, float z_loss, bool with_grad) override {
        be_.cross_entropy(logits, targets, stats, rows, vocab, first_position, time, z_loss, with_grad);
    }
    void sum_squares(const Tensor& out, const Tensor& x) override { be_.sum_squares(out, x); }
    void optimizer_scale(const Tensor& out, const Tensor& gathered, int ranks, const Tensor& grad_clip) override {
        be_.optimizer_scale(out, gathered, ranks, grad_clip);
    }
    void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& scale,
               const AdamWStep& step) override {
        be_.adamw(param, grad, m, v, scale, step);
    }

private:
    Backend& be_;
};

}  // namespace nanoq::ops
