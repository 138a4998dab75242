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

bool choose_attention(const ScratchShapes& s, FusedAttention* engine, const std::string& why_none,
                      std::string* refused) {
    if (s.attention_impl == AttentionImpl::Native || s.attention.batch <= 0) return false;
    const bool required = s.attention_impl == AttentionImpl::Cudnn;
    auto refuse = [&](const std::string& why) {
        if (required) throw InvalidArgument("attention=\"cudnn\" cannot be used: " + why);
        return false;
    };
    // The library itself failed: "auto" says so (a fallback by the limits
    // follows from the options and is not news).
    auto library_refuses = [&](const std::string& why) {
        if (refused && !required) *refused = why;
        return refuse(why);
    };
    const std::string library = attention_engine_library();
    if (library.empty())
        return refuse("this build of the cuda backend has no cuDNN (build it with the nvidia-cudnn-cu13 and "
                      "nvidia-cudnn-frontend wheels installed), or use attention=\"native\"");
    if (!required && !attention_engine_preferred()) return false;
    const DType dtype = attention_dtype(s);
    const std::string limits = attention_engine_limits(s.attention, dtype);
    if (!limits.empty()) return refuse(limits);
    if (!engine) return why_none.empty() || library_refuses(library + " could not be started: " + why_none);
    try {
        engine->prepare(s.attention, dtype, false, s.attention_deterministic, s.backward);
    } catch (const NanoqError& e) {
        return library_refuses(e.what());
    } catch (const InvalidArgument& e) {
        return library_refuses(e.what());
    }
    return true;
}

std::size_t attention_workspace_bound(const AttentionShape& s, bool deterministic, bool backward) {
    // fp32 copies of dq and of dk, dv widened to every query head, and two
    // fp32 row statistics, plus a fixed margin: meant to exceed what cuDNN's
    // flash attention backward asks for (its fp32 dq accumulator and row
    // sums); test_fused_attention.py checks it against cuDNN's own size on a GPU.
    const std::size_t rows = static_cast<std::size_t>(s.batch) * s.time * s.heads;
    const std::size_t flash = sizeof(float) * rows * (3 * static_cast<std::size_t>(s.head_dim) + 2);
    // The deterministic backward (cudnn_attention.cpp asks for it unless
    // TrainOptions::attention_deterministic is false) takes
    // the cuDNN frontend's dP-workspace route instead (1.32, the SDPA
    // backward node: deterministic on Hopper without the opt-in ordered dQ),
    // whose engine keeps dP in bf16 for every query-key pair: the
    // frontend's own estimate of it is B * H * T * T * 2 bytes, T padded to
    // 64 for queries and 128 for keys. Both routes are counted, padded to
    // 128: a bound, not the size (cuDNN is asked where a device is).
    // A forward alone (an inference trainer) is counted at the margin.
    const std::size_t margin = std::size_t(4) << 20;
    if (!backward) return margin;
    const std::size_t padded = (static_cast<std::size_t>(s.time) + 127) / 128 * 128;
    const std::size_t dp = deterministic ? 2 * static_cast<std::size_t>(s.batch) * s.heads * padded * padded : 0;
    return flash + dp + margin;
}

FusedAttention::FusedAttention(std::unique_ptr<AttentionEngine> engine) : engine_(std::move(engine)) {
    if (!engine_) throw InternalError("FusedAttention without an engine");
}

FusedAttention::~FusedAttention() = default;

std::int64_t attention_bias_elements(const AttentionShape& s) { return std::int64_t(s.batch) * s.time * s.time; }

namespace {

// The algorithm a plan is built with: a forward's does not depend on the
// option (one plan serves both settings), a backward's does.
bool built_deterministic(AttentionPass pass, bool deterministic) {
    return pass == AttentionPass::Forward || deterministic;
}

}  // namespace

FusedAttention::Key FusedAttention::key(const AttentionShape& s, DType dtype, AttentionPass pass, bool bias,
                                        bool deterministic) {
    return Key{s.batch, s.time, s.heads, s.kv_heads, s.head_dim, s.causal, static_cast<int>(dtype),
               static_cast<int>(pass), bias, built_deterministic(pass, deterministic)};
}

const AttentionPlan& FusedAttention::plan(const AttentionShape& s, DType dtype, AttentionPass pass, bool bias,
                                          bool deterministic) {
    deterministic = built_deterministic(pass, deterministic);
    const Key k = key(s, dtype, pass, bias, deterministic);
    auto it = plans_.find(k);
    if (it != plans_.end()) return *it->second;
    const std::string limits = attention_engine_limits(s, dtype);
    if (!limits.empty()) throw InvalidArgument(limits);
    std::unique_ptr<AttentionPlan> built;
    auto refused = [&](const char* what) {
        return NanoqError(engine_->library() + " cannot run the attention " +
                          (pass == AttentionPass::Forward ? "forward" : "backward") + " of " + describe(s, dtype) +
                          (bias ? " with a document mask" : "") +
                          (deterministic ? "" : " (not deterministic)") + ": " + what);
    };
    try {
        built = engine_->build(s, dtype, pass, bias, deterministic);
    } catch (const InvalidArgument&) {
        throw;
    } catch (const std::exception& e) {
        // NanoqError, and what the library's own code throws (the cuDNN
        // frontend throws std::runtime_error where no engine fits the
        // attributes; an allocation may throw bad_alloc): all are the
        // library refusing the plan, which "auto" answers with the native
        // kernels.
        throw refused(e.what());
    }
    return *plans_.emplace(k, std::move(built)).first->second;
}

std::size_t FusedAttention::prepare(const AttentionShape& s, DType dtype, bool bias, bool deterministic,
                                    bool backward) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t forward = plan(s, dtype, AttentionPass::Forward, bias, deterministic).workspace_bytes;
    return backward ? std::max(forward, plan(s, dtype, AttentionPass::Backward, bias, deterministic).workspace_bytes)
                    : forward;
}

void FusedAttention::run(AttentionPass pass, const AttentionTensors& t, const AttentionShape& s,
                         const Tensor& workspace, cudaStream_t stream) {
    const bool bias = t.bias.data != nullptr;
    if (bias && (t.bias.dtype != DType::BF16 || t.bias.numel() < attention_bias_elements(s)))
        throw InternalError("fused attention's bias must be bf16 [B, 1, T, T] (" +
                            std::to_string(attention_bias_elements(s)) + " elements), got " +
                            std::to_string(t.bias.numel()));
    const std::lock_guard<std::mutex> lock(mutex_);
    const AttentionPlan& p = plan(s, t.q.dtype, pass, bias, t.deterministic);
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
