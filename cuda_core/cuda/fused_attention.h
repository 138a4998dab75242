// Attention through a library's fused kernels (cuDNN's SDPA), beside the
// native kernels of kernels_attention.cu.
//
// An AttentionEngine is the library: it compiles a plan for one shape, dtype
// and pass and runs it on a stream. The real one is cuDNN's frontend graph API
// (cudnn_attention.cpp, in a cuda build that found cuDNN); the emulated build
// links a stand-in with the same contract (emulator/emu_attention.cpp: a
// float64 reference queued on the stream), because the emulator cannot run
// cuDNN. Everything around the engine is shared and so runs under the
// emulator in CI: which attention a run uses (choose_attention), the plans
// built once per shape and cached (FusedAttention), and the workspace, which
// the backend's scratch plan reserves through the named allocator.
//
// Tensors as in Backend::attention_forward: q/out [B,T,H,D], k/v [B,T,K,D]
// row-major (the engine sees them as [B,H,T,D] with strides, no transposes),
// lse [B,H,T] fp32, the natural-log log-sum-exp of the scaled scores, which
// is what cuDNN's "stats" output is. So either attention's forward can feed
// the other's backward.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "nanoq/config.h"
#include "tensor.h"

namespace nanoq {
namespace cuda {

enum class AttentionPass { Forward, Backward };

class FusedAttention;

// What an engine compiled for one shape, dtype and pass.
class AttentionPlan {
public:
    virtual ~AttentionPlan() = default;
    std::size_t workspace_bytes = 0;
};

// The device tensors of one call; the backward's outputs are dq, dk, dv
// (overwritten), the forward's out and lse. `bias`, in a plan built with
// one: bf16 [B, 1, T, T] added to the scaled scores (the mask of packed
// documents, document_mask_bias in kernels.h), the same in both passes.
// `deterministic`: the backward's plan is the library's deterministic
// algorithm (TrainOptions::attention_deterministic); part of the plan.
struct AttentionTensors {
    Tensor out, lse, q, k, v;
    Tensor dout, dq, dk, dv;
    Tensor bias;
    bool deterministic = true;
};

class AttentionEngine {
public:
    virtual ~AttentionEngine() = default;
    // The library and its version, e.g. "cuDNN 9.28.1".
    virtual std::string library() const = 0;
    // Compiles the plan (with `bias`: one that adds AttentionTensors::bias
    // to the scores; a backward with `deterministic` in the library's
    // deterministic algorithm, else the one that accumulates dq with
    // atomics; a forward is the same either way); throws NanoqError with
    // the library's reason when it cannot run this shape.
    virtual std::unique_ptr<AttentionPlan> build(const AttentionShape& shape, DType dtype, AttentionPass pass,
                                                 bool bias, bool deterministic) = 0;
    virtual void run(const AttentionPlan& plan, const AttentionTensors& tensors, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream) = 0;
};

// The engine of this build on the current device, or nullptr when the build
// has none (a cuda build without cuDNN). Defined by the engine's source file.
std::unique_ptr<AttentionEngine> make_attention_engine();
// The engine's library in words ("cuDNN 9.28.1"), or "" when the build has
// none; without creating one (no device needed).
std::string attention_engine_library();
// Whether "auto" picks the engine where it can run the shape: true for
// cuDNN, false for the emulator's stand-in (a test double, slower than the
// native kernels it would replace, so only attention="cudnn" selects it,
// unless NANOQ_EMU_ATTENTION_PREFERRED=1 asks it to play cuDNN's part).
bool attention_engine_preferred();

// Why an engine cannot run this shape and dtype by the documented limits
// that both engines share ("" when it can): bf16, head_dim a multiple of 8
// up to 256. The library may still refuse a shape when it builds the plan.
std::string attention_engine_limits(const AttentionShape& shape, DType dtype);

// Which attention a backend runs for shapes.attention, shapes.dtype and
// the option shapes.attention_impl ("auto", "cudnn" or "native"): true for
// the engine. "auto" takes the engine when the build has one that is
// preferred and can run the shape, else the native kernels; "cudnn" where
// the build has no engine or it cannot run the shape throws InvalidArgument
// naming why, never falling back. `engine`, when given, builds the plans
// (so that a shape the library refuses counts as unsupported); null with
// `why_none` set: no engine could be made (the reason); null with it empty:
// none was asked (a plan without libraries), so the documented limits decide.
// Where "auto" falls back because the library could not start or refused
// to build the plans (not for the documented limits, which the options
// chose), *refused, when given, says why.
bool choose_attention(const ScratchShapes& shapes, FusedAttention* engine, const std::string& why_none,
                      std::string* refused = nullptr);

// The dtype of the shapes' activations (ScratchShapes::dtype).
DType attention_dtype(const ScratchShapes& shapes);

// Whether the shapes may run in the engine, so that a backend should take
// the device's (device_fused_attention) before choose_attention: attention not
// "native", an attention shape, an engine in the build, and either
// "cudnn" or an engine that "auto" prefers.
bool attention_engine_wanted(const ScratchShapes& shapes);

// A device's fused attention: the engine and its plans, built on first use
// of a shape, dtype and pass and kept. One per device for the process
// (device_fused_attention in cuda_backend.cpp), shared by the memory
// planning and every backend of the device, so that each plan, compiled at
// run time on Hopper, is built once however many trainers and plans ask for
// it. Thread-safe: one mutex guards the plans and each run (the engine's
// one library handle takes the caller's stream for the call).
class FusedAttention {
public:
    explicit FusedAttention(std::unique_ptr<AttentionEngine> engine);
    ~FusedAttention();
    FusedAttention(const FusedAttention&) = delete;
    FusedAttention& operator=(const FusedAttention&) = delete;

    const AttentionEngine& engine() const { return *engine_; }
    // Builds (or finds) the forward and, with `backward`, the backward plans
    // of the shape (with `bias`: those that take a bias; the backward
    // deterministic or not, as AttentionTensors::deterministic) and returns
    // the workspace the larger one needs.
    std::size_t prepare(const AttentionShape& shape, DType dtype, bool bias = false, bool deterministic = true,
                        bool backward = true);
    // The plan of the call has a bias where tensors.bias is given.
    void forward(const AttentionTensors& tensors, const AttentionShape& shape, const Tensor& workspace,
                 cudaStream_t stream);
    void backward(const AttentionTensors& tensors, const AttentionShape& shape, const Tensor& workspace,
                  cudaStream_t stream);

private:
    // B, T, H, K, D, causal, dtype, pass, bias, deterministic (always true
    // for a forward: its plan does not depend on it)
    using Key = std::tuple<int, int, int, int, int, bool, int, int, bool, bool>;
    static Key key(const AttentionShape& shape, DType dtype, AttentionPass pass, bool bias, bool deterministic);
    const AttentionPlan& plan(const AttentionShape& shape, DType dtype, AttentionPass pass, bool bias,
                              bool deterministic);
    void run(AttentionPass pass, const AttentionTensors& tensors, const AttentionShape& shape,
             const Tensor& workspace, cudaStream_t stream);

    std::mutex mutex_;
    std::unique_ptr<AttentionEngine> engine_;
    std::map<Key, std::unique_ptr<AttentionPlan>> plans_;
};

// An upper bound on the workspace of the plans of `shape`, for a scratch
// plan made where no engine can be asked (no device): with `deterministic`
// it includes the deterministic backward's dP buffer, which grows with T^2.
std::size_t attention_workspace_bound(const AttentionShape& shape, bool deterministic = true, bool backward = true);

// The elements of the document mask of `shape` (AttentionTensors::bias):
// B * T * T.
std::int64_t attention_bias_elements(const AttentionShape& shape);

}  // namespace cuda
}  // namespace nanoq
