// cuDNN's fused attention (SDPA) through the cuDNN frontend's graph API
// (fused_attention.h): one graph per shape, dtype and pass, built when a
// shape is first asked for and kept by FusedAttention.
//
// Our q/out [B,T,H,D] and k/v [B,T,K,D] are row-major; cuDNN's logical dims
// are [B,H,T,D], which our layout gives with strides (T*H*D, D, H*D, 1): no
// transposes. Grouped kv heads are cuDNN's own (K of H heads in k/v).
// Stats are [B,H,T,1] fp32, natural-log log-sum-exp of the scaled scores:
// our lse. The causal mask is the top-left diagonal (query i sees keys <= i);
// a bidirectional shape (AttentionShape::causal false) has none.
// The backward asks for cuDNN's deterministic algorithm unless the run says
// otherwise (TrainOptions::attention_deterministic): nanoq's steps are
// reproducible run to run, and its tests check that bitwise. On Hopper the
// frontend then takes its dP-workspace route (a bf16 dP of every query-key
// pair in the workspace); without it dq is accumulated with fp32 atomics
// (a B*H*T*D fp32 accumulator), as flash attention does.
// Packed documents: a plan built with a bias adds a bf16 [B,1,T,T] tensor to
// the scaled scores (cuDNN's SDPA bias input, in both passes, no bias
// gradient), 0 where a query sees a key of its own document and a large
// finite negative elsewhere (document_mask_bias in kernels.h), on top of
// the causal mask, which still lets cuDNN skip the tiles above the diagonal.
// A forward the library refuses in the implementation the frontend chose
// (its newer "unified" node) is built again as the composite node.
#include <cudnn_frontend.h>

#include <cmath>
#include <string>
#include <unordered_map>

#include "cuda/fused_attention.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

namespace fe = cudnn_frontend;

enum Uid : fe::graph::Tensor_attributes::uid_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kBias };

// By value: error_t::get_message() is not const.
void check(fe::error_t status, const char* what) {
    if (!status.is_good()) throw NanoqError(std::string(what) + ": " + status.get_message());
}

void check(cudnnStatus_t status, const char* what) {
    if (status != CUDNN_STATUS_SUCCESS) throw NanoqError(std::string(what) + ": " + cudnnGetErrorString(status));
}

class CudnnPlan final : public AttentionPlan {
public:
    std::shared_ptr<fe::graph::Graph> graph;
    AttentionPass pass = AttentionPass::Forward;
    bool bias = false;
};

class CudnnEngine final : public AttentionEngine {
public:
    CudnnEngine() { check(cudnnCreate(&handle_), "cudnnCreate"); }
    ~CudnnEngine() override {
        if (handle_) cudnnDestroy(handle_);
    }

    std::string library() const override { return attention_engine_library(); }

    std::unique_ptr<AttentionPlan> build(const AttentionShape& s, DType dtype, AttentionPass pass, bool with_bias,
                                         bool deterministic) override {
        if (dtype != DType::BF16) throw NanoqError("bf16 only");
        if (pass == AttentionPass::Backward) return build_graph(s, pass, with_bias, deterministic, false);
        // The frontend picks the forward's implementation from its own
        // support table before cuDNN is asked (the "unified" SDPA node
        // where the library is new enough): where the library then refuses
        // that one, the composite node is tried before the shape is refused.
        try {
            return build_graph(s, pass, with_bias, deterministic, false);
        } catch (const std::exception& first) {
            try {
                return build_graph(s, pass, with_bias, deterministic, true);
            } catch (const std::exception& second) {
                throw NanoqError(std::string(first.what()) + "; with the composite implementation: " + second.what());
            }
        }
    }

    std::unique_ptr<AttentionPlan> build_graph(const AttentionShape& s, AttentionPass pass, bool with_bias,
                                               bool deterministic, bool composite) {
        const std::int64_t B = s.batch, T = s.time, H = s.heads, K = s.kv_heads, D = s.head_dim;
        const std::vector<std::int64_t> q_dims{B, H, T, D}, q_strides{T * H * D, D, H * D, 1};
        const std::vector<std::int64_t> kv_dims{B, K, T, D}, kv_strides{T * K * D, D, K * D, 1};
        const std::vector<std::int64_t> stats_dims{B, H, T, 1}, stats_strides{H * T, T, 1, 1};
        const std::vector<std::int64_t> bias_dims{B, 1, T, T}, bias_strides{T * T, T * T, T, 1};
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));

        auto graph = std::make_shared<fe::graph::Graph>();
        graph->set_io_data_type(fe::DataType_t::BFLOAT16)
            .set_intermediate_data_type(fe::DataType_t::FLOAT)
            .set_compute_data_type(fe::DataType_t::FLOAT);
        auto tensor = [&](const char* name, Uid uid, const std::vector<std::int64_t>& dims,
                          const std::vector<std::int64_t>& strides) {
            return graph->tensor(
                fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
        };
        auto q = tensor("q", kQ, q_dims, q_strides);
        auto k = tensor("k", kK, kv_dims, kv_strides);
        auto v = tensor("v", kV, kv_dims, kv_strides);
        auto bias = with_bias ? tensor("bias", kBias, bias_dims, bias_strides) : nullptr;
        if (pass == AttentionPass::Forward) {
            auto options = fe::graph::SDPA_attributes()
                               .set_name("nanoq_attention_forward")
                               .set_generate_stats(true)
                               .set_causal_mask(s.causal)
                               .set_attn_scale(scale);
            if (bias) options.set_bias(bias);
            if (composite) options.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
            auto [o, stats] = graph->sdpa(q, k, v, options);
            o->set_output(true).set_dim(q_dims).set_stride(q_strides).set_uid(kO);
            stats->set_output(true)
                .set_data_type(fe::DataType_t::FLOAT)
                .set_dim(stats_dims)
                .set_stride(stats_strides)
                .set_uid(kStats);
        } else {
            auto o = tensor("o", kO, q_dims, q_strides);
            auto dout = tensor("dout", kDO, q_dims, q_strides);
            auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                           .set_name("stats")
                                           .set_uid(kStats)
                                           .set_dim(stats_dims)
                                           .set_stride(stats_strides)
                                           .set_data_type(fe::DataType_t::FLOAT));
            auto options = fe::graph::SDPA_backward_attributes()
                               .set_name("nanoq_attention_backward")
                               .set_causal_mask(s.causal)
                               .set_attn_scale(scale)
                               .set_deterministic_algorithm(deterministic);
            if (bias) options.set_bias(bias);
            auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, dout, stats, options);
            dq->set_output(true).set_dim(q_dims).set_stride(q_strides).set_uid(kDQ);
            dk->set_output(true).set_dim(kv_dims).set_stride(kv_strides).set_uid(kDK);
            dv->set_output(true).set_dim(kv_dims).set_stride(kv_strides).set_uid(kDV);
        }
        check(graph->validate(), "validate");
        check(graph->build_operation_graph(handle_), "build_operation_graph");
        // Heuristic A's candidates first, then the library's fallback engines:
        // check_support and build_plans keep the first candidate that builds,
        // so the fallbacks are tried only where none of A's does (an engine
        // whose run-time compile fails, say) instead of refusing the shape.
        check(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
        check(graph->check_support(handle_), "check_support");
        check(graph->build_plans(handle_), "build_plans");
        std::int64_t workspace = 0;
        check(graph->get_workspace_size(workspace), "get_workspace_size");
        auto plan = std::make_unique<CudnnPlan>();
        plan->graph = std::move(graph);
        plan->pass = pass;
        plan->bias = with_bias;
        plan->workspace_bytes = static_cast<std::size_t>(workspace);
        return plan;
    }

    void run(const AttentionPlan& base, const AttentionTensors& t, void* workspace, std::size_t /*workspace_bytes*/,
             cudaStream_t stream) override {
        const auto& plan = static_cast<const CudnnPlan&>(base);
        check(cudnnSetStream(handle_, stream), "cudnnSetStream");
        std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack{
            {kQ, t.q.data}, {kK, t.k.data}, {kV, t.v.data}, {kO, t.out.data}, {kStats, t.lse.data}};
        if (plan.bias) pack[kBias] = t.bias.data;
        if (plan.pass == AttentionPass::Backward) {
            pack[kDO] = t.dout.data;
            pack[kDQ] = t.dq.data;
            pack[kDK] = t.dk.data;
            pack[kDV] = t.dv.data;
        }
        check(plan.graph->execute(handle_, pack, workspace), "cuDNN attention execute");
    }

private:
    cudnnHandle_t handle_ = nullptr;
};

}  // namespace

std::unique_ptr<AttentionEngine> make_attention_engine() { return std::make_unique<CudnnEngine>(); }

std::string attention_engine_library() {
    const std::size_t version = cudnnGetVersion();  // major * 10000 + minor * 100 + patch (cuDNN 9)
    return "cuDNN " + std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
           std::to_string(version % 100);
}

bool attention_engine_preferred() { return true; }

}  // namespace cuda
}  // namespace nanoq
