// The default bodies of the composite ops (backend.h): each issues the
// primitives in the order the model issued them before composites existed,
// so that a backend without overrides computes bitwise the same. The packed
// weights are used through their q/k/v (gate/up) row blocks: a matmul over
// the whole block would be one kernel, but a different one (other blocking,
// other rounding), which is an override's business, not the default's.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend.h"
#include "nanoq/errors.h"

namespace nanoq {

namespace {

// Rows [first, first + count) of a [rows, cols] matrix stored row-major.
Tensor row_block(const Tensor& matrix, std::int64_t first, std::int64_t count, std::int64_t cols) {
    Tensor t = matrix.slice(first * cols, count * cols);
    t.ndim = 2;
    t.shape[0] = count;
    t.shape[1] = cols;
    return t;
}

struct QkvWidths {
    int rows, q, kv;  // rows of x; output features of q and of k (= of v)
};

QkvWidths widths(const QkvShape& s) {
    const AttentionShape& a = s.attention;
    return {a.batch * a.time, a.heads * a.head_dim, a.kv_heads * a.head_dim};
}

// The q, k and v row blocks of a packed [q + 2 kv, cols] matrix (or of a
// packed bias, cols = 1); all empty when `packed` is.
struct Blocks {
    Tensor q, k, v;
};
Blocks split_qkv(const Tensor& packed, const QkvWidths& w, std::int64_t cols) {
    if (!packed.data) return {};
    if (packed.numel() != (std::int64_t(w.q) + 2 * w.kv) * cols)
        throw InternalError("packed q/k/v tensor of " + std::to_string(packed.numel()) + " elements, expected " +
                            std::to_string((std::int64_t(w.q) + 2 * w.kv) * cols));
    return {row_block(packed, 0, w.q, cols), row_block(packed, w.q, w.kv, cols),
            row_block(packed, std::int64_t(w.q) + w.kv, w.kv, cols)};
}

bool qk_norms(const QkvWeights& w) { return w.q_norm.data != nullptr; }

}  // namespace

void Backend::matmul_epilogue(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M, int N,
                              int K, bool trans_a, bool trans_b, bool accumulate, float scale) {
    if (accumulate && scale != 1.0f)
        throw InvalidArgument("matmul_epilogue: a scale applies to a fresh product only (accumulate with scale 1)");
    matmul(out, a, b, M, N, K, trans_a, trans_b, accumulate);
    if (scale != 1.0f) scale_dropout(out, out, scale, 0.0f, 0, Tensor());
    if (bias.data) add_bias(out, bias, M, N);
}

void Backend::matmul_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                                bool accumulate) {
    matmul(dx, dy, weight, rows, k, n, false, false, accumulate);
}

void Backend::matmul_weight_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                 int rows, int n, int k) {
    matmul(dweight, dy, x, n, k, rows, true, false, true);
    if (dbias.data) bias_backward(dbias, dy, rows, n);
}

void Backend::matmul_backward(const Tensor& dx, bool accumulate, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& weight, const Tensor& x, int rows, int n, int k) {
    matmul_input_grad(dx, dy, weight, rows, n, k, accumulate);
    if (dweight.data) matmul_weight_grad(dweight, dbias, dy, x, rows, n, k);
}

void Backend::residual_rmsnorm_forward(const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                                       const Tensor& residual, const Tensor& delta, const Tensor& weight, int rows,
                                       int channels, float eps) {
    if (residual_out.data == delta.data) accumulate(residual_out, residual);
    else if (residual_out.data == residual.data) accumulate(residual_out, delta);
    else add(residual_out, residual, delta);
    rmsnorm_forward(out, rstd, residual_out, weight, rows, channels, eps);
}

void Backend::residual_rmsnorm_backward(const Tensor& dresidual, const Tensor& dweight, const Tensor& dout,
                                        const Tensor& residual_out, const Tensor& weight, const Tensor& rstd,
                                        int rows, int channels) {
    rmsnorm_backward(dresidual, dweight, dout, residual_out, weight, rstd, rows, channels, true);
}

void Backend::qkv_projection(const QkvActivations& a, const Tensor& x, const QkvWeights& w, const QkvShape& s) {
    const QkvWidths n = widths(s);
    const Blocks weight = split_qkv(w.qkv, n, s.hidden), bias = split_qkv(w.qkv_bias, n, 1);
    const bool norms = qk_norms(w);
    matmul_epilogue(norms ? a.q_raw : a.q, x, weight.q, bias.q, n.rows, n.q, s.hidden, false, true, false, 1.0f);
    matmul_epilogue(norms ? a.k_raw : a.k, x, weight.k, bias.k, n.rows, n.kv, s.hidden, false, true, false, 1.0f);
    matmul_epilogue(a.v, x, weight.v, bias.v, n.rows, n.kv, s.hidden, false, true, false, 1.0f);
}

void Backend::qk_norm_rope_forward(const QkvActivations& a, const QkvWeights& w, const Tensor& cos_sin,
                                   const QkvShape& s) {
    const AttentionShape& t = s.attention;
    const int rows = t.batch * t.time;
    if (qk_norms(w)) {
        rmsnorm_forward(a.q, a.q_rstd, a.q_raw, w.q_norm, rows * t.heads, t.head_dim, s.eps);
        rmsnorm_forward(a.k, a.k_rstd, a.k_raw, w.k_norm, rows * t.kv_heads, t.head_dim, s.eps);
    }
    rope_forward(a.q, cos_sin, t.batch, t.time, t.heads, t.head_dim);
    rope_forward(a.k, cos_sin, t.batch, t.time, t.kv_heads, t.head_dim);
}

void Backend::qkv_forward(const QkvActivations& a, const Tensor& x, const QkvWeights& w, const Tensor& cos_sin,
                          const QkvShape& s) {
    qkv_projection(a, x, w, s);
    qk_norm_rope_forward(a, w, cos_sin, s);
}

void Backend::qk_norm_rope_backward(const Tensor& dq, const Tensor& dk, const QkvActivations& a,
                                    const QkvWeights& w, const QkvWeights& g, const Tensor& cos_sin,
                                    const QkvShape& s) {
    const AttentionShape& t = s.attention;
    const int rows = t.batch * t.time;
    rope_backward(dq, cos_sin, t.batch, t.time, t.heads, t.head_dim);
    rope_backward(dk, cos_sin, t.batch, t.time, t.kv_heads, t.head_dim);
    if (qk_norms(w)) {
        if (!g.q_norm.data || !g.k_norm.data)
            throw InternalError("qk_norm_rope_backward needs q/k norm gradient tensors (a sink when frozen)");
        rmsnorm_backward(dq, g.q_norm, dq, a.q_raw, w.q_norm, a.q_rstd, rows * t.heads, t.head_dim, false);
        rmsnorm_backward(dk, g.k_norm, dk, a.k_raw, w.k_norm, a.k_rstd, rows * t.kv_heads, t.head_dim, false);
    }
}

void Backend::qkv_projection_backward(const Tensor& dx, bool accumulate, const QkvWeights& g, const Tensor& dq,
                                      const Tensor& dk, const Tensor& dv, const Tensor& x, const QkvWeights& w,
                                      const QkvShape& s) {
    const QkvWidths n = widths(s);
    const Blocks weight = split_qkv(w.qkv, n, s.hidden);
    const Blocks dweight = split_qkv(g.qkv, n, s.hidden), dbias = split_qkv(g.qkv_bias, n, 1);
    const Tensor* dys[3] = {&dq, &dk, &dv};
    const Tensor* weights[3] = {&weight.q, &weight.k, &weight.v};
    const Tensor* dweights[3] = {&dweight.q, &dweight.k, &dweight.v};
    const Tensor* dbiases[3] = {&dbias.q, &dbias.k, &dbias.v};
    for (int i = 0; i < 3; ++i) {
        const int width = i == 0 ? n.q : n.kv;
        matmul_backward(dx, accumulate || i > 0, *dweights[i], *dbiases[i], *dys[i], *weights[i], x, n.rows, width,
                        s.hidden);
    }
}

void Backend::qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads, const Tensor& dq,
                           const Tensor& dk, const Tensor& dv, const QkvActivations& a, const Tensor& x,
                           const QkvWeights& weights, const Tensor& cos_sin, const QkvShape& shape) {
    qk_norm_rope_backward(dq, dk, a, weights, grads, cos_sin, shape);
    qkv_projection_backward(dx, accumulate, grads, dq, dk, dv, x, weights, shape);
}

void Backend::gate_up_projection(const Tensor& gate, const Tensor& up, const Tensor& x, const Tensor& gate_up,
                                 int rows, int intermediate, int channels) {
    matmul(gate, x, row_block(gate_up, 0, intermediate, channels), rows, intermediate, channels, false, true, false);
    matmul(up, x, row_block(gate_up, intermediate, intermediate, channels), rows, intermediate, channels, false, true,
           false);
}

void Backend::gate_up_swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const Tensor& x,
                                     const Tensor& gate_up, int rows, int intermediate, int channels) {
    gate_up_projection(gate, up, x, gate_up, rows, intermediate, channels);
    swiglu_forward(out, gate, up);
}

void Backend::gate_up_projection_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up,
                                          const Tensor& dgate, const Tensor& dup, const Tensor& x,
                                          const Tensor& gate_up, int rows, int intermediate, int channels) {
    const Tensor* dys[2] = {&dgate, &dup};
    for (int i = 0; i < 2; ++i) {
        const std::int64_t first = std::int64_t(i) * intermediate;
        const Tensor dweight = dgate_up.data ? row_block(dgate_up, first, intermediate, channels) : Tensor();
        matmul_backward(dx, accumulate || i > 0, dweight, Tensor(), *dys[i],
                        row_block(gate_up, first, intermediate, channels), x, rows, intermediate, channels);
    }
}

void Backend::swiglu_gate_up_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up, const Tensor& dgate,
                                      const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                                      const Tensor& x, const Tensor& gate_up, int rows, int intermediate,
                                      int channels) {
    swiglu_backward(dgate, dup, dout, gate, up);
    gate_up_projection_backward(dx, accumulate, dgate_up, dgate, dup, x, gate_up, rows, intermediate, channels);
}

std::vector<double> adamw_step_values(const AdamWStep& s, std::uint64_t seed) {
    std::vector<double> v(kAdamWStepSlots);
    v[kAdamWLr] = s.lr;
    v[kAdamWBeta1] = s.beta1;
    v[kAdamWBeta2] = s.beta2;
    v[kAdamWEps] = s.eps;
    v[kAdamWWeightDecay] = s.weight_decay;
    v[kAdamWStepNumber] = s.step;
    v[kAdamWSeedLow] = static_cast<double>(seed & 0xffffffffu);
    v[kAdamWSeedHigh] = static_cast<double>(seed >> 32);
    const float bias1 = 1.0f - std::pow(s.beta1, static_cast<float>(s.step));
    v[kAdamWStepSize] = s.lr / bias1;
    v[kAdamWBias2Sqrt] = std::sqrt(1.0f - std::pow(s.beta2, static_cast<float>(s.step)));
    v[kAdamWDecay] = 1.0f - s.lr * s.weight_decay;
    v[kAdamWNoDecay] = 1.0f - s.lr * 0.0f;
    return v;
}

std::vector<double> adamw_segment_table(const std::vector<AdamWSegment>& segments) {
    std::vector<double> table;
    table.reserve(segments.size() * kAdamWSegmentSlots);
    for (const AdamWSegment& s : segments) {
        if (s.begin < 0 || s.count < 0 || s.begin + s.count > (std::int64_t(1) << 53))
            throw InternalError("adamw segment [" + std::to_string(s.begin) + ", +" + std::to_string(s.count) +
                                ") out of range");
        table.push_back(static_cast<double>(s.begin));
        table.push_back(static_cast<double>(s.count));
        table.push_back(s.decay ? 1.0 : 0.0);
    }
    return table;
}

void Backend::adamw_shard(const AdamWShard& a) {
    if (a.chunk < 1) throw InternalError("adamw_shard: chunk must be at least one element");
    if (a.step_values.numel() != kAdamWStepSlots || a.segments.numel() % kAdamWSegmentSlots != 0)
        throw InternalError("adamw_shard: malformed step values or segment table");
    std::vector<double> v(kAdamWStepSlots), table(static_cast<std::size_t>(a.segments.numel()));
    copy_to_host(v.data(), a.step_values);
    if (!table.empty()) copy_to_host(table.data(), a.segments);
    synchronize();
    const std::uint64_t seed = static_cast<std::uint64_t>(v[kAdamWSeedLow]) |
                               (static_cast<std::uint64_t>(v[kAdamWSeedHigh]) << 32);
    AdamWStep step{static_cast<float>(v[kAdamWLr]), static_cast<float>(v[kAdamWBeta1]),
                   static_cast<float>(v[kAdamWBeta2]), static_cast<float>(v[kAdamWEps]), 0.0f,
                   static_cast<int>(v[kAdamWStepNumber]), 0};
    const float weight_decay = static_cast<float>(v[kAdamWWeightDecay]);
    for (std::size_t i = 0; i < table.size(); i += kAdamWSegmentSlots) {
        const auto begin = static_cast<std::int64_t>(table[i + kAdamWSegmentBegin]);
        const auto end = begin + static_cast<std::int64_t>(table[i + kAdamWSegmentCount]);
        if (end > a.master.numel()) throw InternalError("adamw_shard: a segment ends past the shard");
        step.weight_decay = table[i + kAdamWSegmentDecay] != 0.0 ? weight_decay : 0.0f;
        for (std::int64_t at = begin; at < end; at += a.chunk) {
            const std::int64_t count = std::min(a.chunk, end - at);
            step.seed = seed + static_cast<std::uint64_t>(at);
            const Tensor master = a.master.slice(at, count);
            adamw(master, a.grad.slice(at, count), a.m.slice(at, count), a.v.slice(at, count), a.scale, step);
            if (a.weights.data) copy(a.weights.slice(at, count), master);
        }
    }
}

void Backend::classifier(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, const Tensor& stats,
                         const Tensor& dhidden, const Tensor& dlm_head, const Tensor& workspace, int rows,
                         int channels, int vocab, int time, float z_loss) {
    const int chunk = static_cast<int>(std::min<std::int64_t>(rows, workspace.numel() / vocab));
    if (chunk < 1)
        throw InternalError("classifier workspace of " + std::to_string(workspace.numel()) +
                            " elements holds no row of " + std::to_string(vocab) + " logits");
    const bool with_grad = dhidden.data != nullptr;
    for (int r0 = 0; r0 < rows; r0 += chunk) {
        const int n = std::min(chunk, rows - r0);
        const Tensor logits = workspace.slice(0, std::int64_t(n) * vocab);
        const Tensor x = hidden.slice(std::int64_t(r0) * channels, std::int64_t(n) * channels);
        matmul(logits, x, lm_head, n, vocab, channels, false, true, false);
        cross_entropy(logits, targets.slice(r0, n), stats, n, vocab, r0 % time, time, z_loss, with_grad);
        if (!with_grad) continue;
        matmul(dhidden.slice(std::int64_t(r0) * channels, std::int64_t(n) * channels), logits, lm_head, n, channels,
               vocab, false, false, false);
        if (dlm_head.data) matmul(dlm_head, logits, x, vocab, channels, n, true, false, true);
    }
}

}  // namespace nanoq
