// The host path of fused attention shared by cuDNN and the emulator's
// stand-in (fused_attention.h): the choice between engine and native
// kernels, the per-shape plan cache and the workspace checks.
#include "cuda/fused_attention.h"

#include <algorithm>

#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

std::string describe(const AttentionShape& s, DType dtype) {
    return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.time) + " H=" + std::to_string(s.heads) +
           " K=" + std::to_string(s.kv_heads) + " D=" + std::to_string(s.head_dim) + " " + dtype_name(dtype);
}

}  // namespace

std::string attention_engine_limits(const AttentionShape& s, DType dtype) {
    if (dtype != DType::BF16)
        return std::string("fused attention runs in bf16 only, not ") + dtype_name(dtype) + " (use dtype bf16)";
    if (s.head_dim % 8 != 0 || s.head_dim > 256)
        return "fused attention needs head_dim a multiple of 8 up to 256, got " + std::to_string(s.head_dim);
    if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0)
        return "heads (" + std::to_string(s.heads) + ") must be a multiple of kv_heads (" +
               std::to_string(s.kv_heads) + ")";
    return "";
}

DType attention_dtype(const ScratchShapes& s) { return s.dtype == Precision::BF16 ? DType::BF16 : DType::F32; }

bool attention_engine_wanted(const ScratchShapes& s) {
    if (s.attention_impl == AttentionImpl::Native || s.attention.batch <= 0 || attention_engine_library().empty())
        return false;
    return s.attention_impl == AttentionImpl::Cudnn || attention_engine_preferred();
}

bool choose_attention(const ScratchShapes& s, FusedAttention* engine, const std::string& why_none) {
    if (s.attention_impl == AttentionImpl::Native || s.attention.batch <= 0) return false;
    const bool required = s.attention_impl == AttentionImpl::Cudnn;
    auto refuse = [&](const std::string& why) {
        if (required) throw InvalidArgument("attention=\"cudnn\" cannot be used: " + why);
        return false;
    };
    const std::string library = attention_engine_library();
    if (library.empty())
        return refuse("this build of the cuda backend has no cuDNN (build it with the nvidia-cudnn-cu13 and "
                      "nvidia-cudnn-frontend wheels installed), or use attention=\"native\"");
    if (!required && !attention_engine_preferred()) return false;
    const DType dtype = attention_dtype(s);
    const std::string limits = attention_engine_limits(s.attention, dtype);
    if (!limits.empty()) return refuse(limits);
    if (!engine) return why_none.empty() || refuse(library + " could not be started: " + why_none);
    try {
        engine->prepare(s.attention, dtype);
    } catch (const NanoqError& e) {
        return refuse(e.what());
    } catch (const InvalidArgument& e) {
        return refuse(e.what());
    }
    return true;
}

std::size_t attention_workspace_bound(const AttentionShape& s) {
    // fp32 copies of dq and of dk, dv widened to every query head, and two
    // fp32 row statistics, plus a fixed margin: meant to exceed what cuDNN's
    // flash attention backward asks for (its fp32 dq accumulator and row
    // sums); test_fused_attention.py checks it against cuDNN's own size on a GPU.
    const std::size_t rows = static_cast<std::size_t>(s.batch) * s.time * s.heads;
    return sizeof(float) * rows * (3 * static_cast<std::size_t>(s.head_dim) + 2) + (std::size_t(4) << 20);
}

FusedAttention::FusedAttention(std::unique_ptr<AttentionEngine> engine) : engine_(std::move(engine)) {
    if (!engine_) throw InternalError("FusedAttention without an engine");
}

FusedAttention::~FusedAttention() = default;

std::int64_t attention_bias_elements(const AttentionShape& s) { return std::int64_t(s.batch) * s.time * s.time; }

const AttentionPlan& FusedAttention::plan(const AttentionShape& s, DType dtype, AttentionPass pass, bool bias) {
    const Key key{s.batch, s.time, s.heads, s.kv_heads, s.head_dim, s.causal, static_cast<int>(dtype),
                  static_cast<int>(pass), bias};
    auto it = plans_.find(key);
    if (it != plans_.end()) return *it->second;
    const std::string limits = attention_engine_limits(s, dtype);
    if (!limits.empty()) throw InvalidArgument(limits);
    std::unique_ptr<AttentionPlan> built;
    try {
        built = engine_->build(s, dtype, pass, bias);
    } catch (const NanoqError& e) {
        throw NanoqError(engine_->library() + " cannot run the attention " +
                         (pass == AttentionPass::Forward ? "forward" : "backward") + " of " + describe(s, dtype) +
                         (bias ? " with a document mask" : "") + ": " + e.what());
    }
    return *plans_.emplace(key, std::move(built)).first->second;
}

std::size_t FusedAttention::prepare(const AttentionShape& s, DType dtype, bool bias) {
    return std::max(plan(s, dtype, AttentionPass::Forward, bias).workspace_bytes,
                    plan(s, dtype, AttentionPass::Backward, bias).workspace_bytes);
}

void FusedAttention::run(AttentionPass pass, const AttentionTensors& t, const AttentionShape& s,
                         const Tensor& workspace, cudaStream_t stream) {
    const bool bias = t.bias.data != nullptr;
    if (bias && (t.bias.dtype != DType::BF16 || t.bias.numel() < attention_bias_elements(s)))
        throw InternalError("fused attention's bias must be bf16 [B, 1, T, T] (" +
                            std::to_string(attention_bias_elements(s)) + " elements), got " +
                            std::to_string(t.bias.numel()));
    const AttentionPlan& p = plan(s, t.q.dtype, pass, bias);
    if (p.workspace_bytes > workspace.bytes())
        throw InternalError("fused attention of " + describe(s, t.q.dtype) + " needs " +
                            std::to_string(p.workspace_bytes) + " bytes of workspace, " +
                            std::to_string(workspace.bytes()) + " were reserved");
    engine_->run(p, t, workspace.data, workspace.bytes(), stream);
}

void FusedAttention::forward(const AttentionTensors& t, const AttentionShape& s, const Tensor& workspace,
                             cudaStream_t stream) {
    run(AttentionPass::Forward, t, s, workspace, stream);
}

void FusedAttention::backward(const AttentionTensors& t, const AttentionShape& s, const Tensor& workspace,
                              cudaStream_t stream) {
    run(AttentionPass::Backward, t, s, workspace, stream);
}

}  // namespace cuda
}  // namespace nanoq
