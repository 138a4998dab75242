// The emulator's stand-in for cuDNN's fused attention (fused_attention.h).
// It keeps the library's contract, so that the host path around it (choice,
// plan cache, workspace) runs in CI: plans are built per shape and pass,
// the backward needs a workspace (its dq accumulator in float64, where
// cuDNN keeps one in fp32) that must be the one reserved and large enough,
// operands must be 16-byte aligned as cuDNN requires, and the work is a
// float64 reference queued on the stream. Inputs are read as stored (bf16),
// outputs rounded to bf16 once; lse is written and read in fp32. A plan
// with a bias adds it (bf16 [B,1,T,T], as stored) to the scaled scores, as
// cuDNN's bias input does, and must be given one (a plan without, none).
// The backward's algorithm (deterministic or with atomics, as cuDNN offers)
// is part of the plan and must be the one the call asks for; the stand-in
// computes alike either way.
// NANOQ_EMU_ATTENTION_NO_BIAS=1 plays a library that refuses plans with a
// bias (read at each build); NANOQ_EMU_ATTENTION_THROW=1 plays the cuDNN
// frontend refusing every plan with a std::runtime_error, as it does where
// no engine fits the attributes (not a NanoqError: the host path must take
// it as a refusal all the same); NANOQ_EMU_ATTENTION_PREFERRED=1 lets "auto"
// take the stand-in, as it takes cuDNN on a GPU (read at each choice).
// A device's plans are kept for the process (fused_attention.h), so a test
// that sets the first two plans a shape no other test plans.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cuda/fused_attention.h"
#include "cuda_bf16.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

// Plans built by every engine of the process (nanoq_emu_attention_plans_built).
std::atomic<long long> built_plans{0};

class EmulatedPlan final : public AttentionPlan {
public:
    AttentionShape shape{};
    AttentionPass pass = AttentionPass::Forward;
    bool bias = false;
    bool deterministic = true;
};

double load(const void* p, std::int64_t i) { return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]); }
void store(void* p, std::int64_t i, double v) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
}

// Index of [b, t, head, d] in a [B, T, heads, D] tensor.
struct Rows {
    int time, heads, head_dim;
    std::int64_t at(int b, int t, int head, int d) const {
        return ((static_cast<std::int64_t>(b) * time + t) * heads + head) * head_dim + d;
    }
};

// The last key query i sees: itself when causal, else the row's last.
int last_key(const AttentionShape& s, int i) { return s.causal ? i : s.time - 1; }

// The bias of query i and key j of batch row b (0 without one).
double bias_at(const AttentionShape& s, const AttentionTensors& t, int b, int i, int j) {
    if (!t.bias.data) return 0.0;
    return load(t.bias.data, (static_cast<std::int64_t>(b) * s.time + i) * s.time + j);
}

void forward(const AttentionShape& s, const AttentionTensors& t) {
    const Rows qo{s.time, s.heads, s.head_dim}, kv{s.time, s.kv_heads, s.head_dim};
    const int group = s.heads / s.kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    float* lse = static_cast<float*>(t.lse.data);
    std::vector<double> score(s.time), out(s.head_dim);
    for (int b = 0; b < s.batch; ++b)
        for (int h = 0; h < s.heads; ++h)
            for (int i = 0; i < s.time; ++i) {
                double max = -std::numeric_limits<double>::infinity();
                for (int j = 0; j <= last_key(s, i); ++j) {
                    double dot = 0.0;
                    for (int d = 0; d < s.head_dim; ++d)
                        dot += load(t.q.data, qo.at(b, i, h, d)) * load(t.k.data, kv.at(b, j, h / group, d));
                    score[j] = dot * scale + bias_at(s, t, b, i, j);
                    max = std::max(max, score[j]);
                }
                double sum = 0.0;
                std::fill(out.begin(), out.end(), 0.0);
                for (int j = 0; j <= last_key(s, i); ++j) {
                    const double p = std::exp(score[j] - max);
                    sum += p;
                    for (int d = 0; d < s.head_dim; ++d) out[d] += p * load(t.v.data, kv.at(b, j, h / group, d));
                }
                for (int d = 0; d < s.head_dim; ++d) store(t.out.data, qo.at(b, i, h, d), out[d] / sum);
                lse[(static_cast<std::int64_t>(b) * s.heads + h) * s.time + i] = static_cast<float>(max + std::log(sum));
            }
}

// dq accumulates in the workspace: [B, T, H, D] float64.
void backward(const AttentionShape& s, const AttentionTensors& t, double* dq) {
    const Rows qo{s.time, s.heads, s.head_dim}, kv{s.time, s.kv_heads, s.head_dim};
    const int group = s.heads / s.kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    const float* lse = static_cast<const float*>(t.lse.data);
    const std::int64_t kv_elements = static_cast<std::int64_t>(s.batch) * s.time * s.kv_heads * s.head_dim;
    std::vector<double> dk(kv_elements, 0.0), dv(kv_elements, 0.0);
    std::fill(dq, dq + static_cast<std::int64_t>(s.batch) * s.time * s.heads * s.head_dim, 0.0);
    for (int b = 0; b < s.batch; ++b)
        for (int h = 0; h < s.heads; ++h)
            for (int i = 0; i < s.time; ++i) {
                const double row_lse = lse[(static_cast<std::int64_t>(b) * s.heads + h) * s.time + i];
                double delta = 0.0;
                for (int d = 0; d < s.head_dim; ++d)
                    delta += load(t.dout.data, qo.at(b, i, h, d)) * load(t.out.data, qo.at(b, i, h, d));
                for (int j = 0; j <= last_key(s, i); ++j) {
                    const int g = h / group;
                    double dot = 0.0, dp = 0.0;
                    for (int d = 0; d < s.head_dim; ++d) {
                        dot += load(t.q.data, qo.at(b, i, h, d)) * load(t.k.data, kv.at(b, j, g, d));
                        dp += load(t.dout.data, qo.at(b, i, h, d)) * load(t.v.data, kv.at(b, j, g, d));
                    }
                    const double p = std::exp(dot * scale + bias_at(s, t, b, i, j) - row_lse);
                    const double dscore = p * (dp - delta) * scale;
                    for (int d = 0; d < s.head_dim; ++d) {
                        dq[qo.at(b, i, h, d)] += dscore * load(t.k.data, kv.at(b, j, g, d));
                        dk[kv.at(b, j, g, d)] += dscore * load(t.q.data, qo.at(b, i, h, d));
                        dv[kv.at(b, j, g, d)] += p * load(t.dout.data, qo.at(b, i, h, d));
                    }
                }
            }
    const std::int64_t q_elements = static_cast<std::int64_t>(s.batch) * s.time * s.heads * s.head_dim;
    for (std::int64_t i = 0; i < q_elements; ++i) store(t.dq.data, i, dq[i]);
    for (std::int64_t i = 0; i < kv_elements; ++i) {
        store(t.dk.data, i, dk[i]);
        store(t.dv.data, i, dv[i]);
    }
}

void require_aligned(const Tensor& tensor, const char* name) {
    if (reinterpret_cast<std::uintptr_t>(tensor.data) % 16 != 0)
        throw NanoqError(std::string("emulated cuDNN: ") + name + " is not 16-byte aligned");
}

class EmulatedEngine final : public AttentionEngine {
public:
    std::string library() const override { return attention_engine_library(); }

    std::unique_ptr<AttentionPlan> build(const AttentionShape& shape, DType dtype, AttentionPass pass, bool bias,
                                         bool deterministic) override {
        if (dtype != DType::BF16) throw NanoqError("emulated cuDNN: bf16 only");
        const char* throws = std::getenv("NANOQ_EMU_ATTENTION_THROW");
        if (throws && !std::strcmp(throws, "1"))
            throw std::runtime_error("No suitable implementation for given SDPA_attributes "
                                     "(NANOQ_EMU_ATTENTION_THROW=1)");
        const char* no_bias = std::getenv("NANOQ_EMU_ATTENTION_NO_BIAS");
        if (bias && no_bias && !std::strcmp(no_bias, "1"))
            throw NanoqError("emulated cuDNN: no plan with a bias (NANOQ_EMU_ATTENTION_NO_BIAS=1)");
        ++built_plans;
        auto plan = std::make_unique<EmulatedPlan>();
        plan->shape = shape;
        plan->pass = pass;
        plan->bias = bias;
        plan->deterministic = deterministic;
        if (pass == AttentionPass::Backward)
            plan->workspace_bytes = sizeof(double) * static_cast<std::size_t>(shape.batch) * shape.time *
                                    shape.heads * shape.head_dim;
        return plan;
    }

    void run(const AttentionPlan& base, const AttentionTensors& t, void* workspace, std::size_t workspace_bytes,
             cudaStream_t stream) override {
        const auto& plan = static_cast<const EmulatedPlan&>(base);
        if (plan.workspace_bytes > workspace_bytes || (plan.workspace_bytes && !workspace))
            throw NanoqError("emulated cuDNN: the workspace is smaller than the plan asks for");
        const AttentionShape s = plan.shape;
        const bool is_forward = plan.pass == AttentionPass::Forward;
        for (const Tensor* tensor : {&t.q, &t.k, &t.v, is_forward ? &t.out : &t.dout}) require_aligned(*tensor, "an operand");
        if (!is_forward)
            for (const Tensor* tensor : {&t.out, &t.dq, &t.dk, &t.dv}) require_aligned(*tensor, "an operand");
        if (plan.bias != (t.bias.data != nullptr))
            throw NanoqError(plan.bias ? "emulated cuDNN: a plan with a bias was run without one"
                                       : "emulated cuDNN: a bias was given to a plan without one");
        if (plan.bias) require_aligned(t.bias, "the bias");
        if (!is_forward && plan.deterministic != t.deterministic)
            throw NanoqError("emulated cuDNN: a backward asked for another algorithm (deterministic or not) than "
                             "its plan was built with");
        const AttentionTensors tensors = t;
        double* dq = static_cast<double*>(workspace);
        nanoq_emu::enqueue(
            stream, [=] { is_forward ? forward(s, tensors) : backward(s, tensors, dq); },
            is_forward ? "cudnn sdpa forward" : "cudnn sdpa backward");
    }
};

}  // namespace

std::unique_ptr<AttentionEngine> make_attention_engine() { return std::make_unique<EmulatedEngine>(); }

std::string attention_engine_library() { return "cuDNN stand-in (CPU emulator, float64 reference)"; }

bool attention_engine_preferred() {
    const char* preferred = std::getenv("NANOQ_EMU_ATTENTION_PREFERRED");
    return preferred && !std::strcmp(preferred, "1");
}

}  // namespace cuda
}  // namespace nanoq

// The plans the stand-in has built in this process, by every engine (the
// backends' and the memory planning's): tests/test_fused_attention.py.
extern "C" __attribute__((visibility("default"))) long long nanoq_emu_attention_plans_built() {
    return nanoq::cuda::built_plans.load();
}
