// The cuda backend: one GPU per device worker, one compute stream each.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend.h"

// The name the backend registers under: "cuda", or "cuda_emulated" when the
// same sources are built for the CPU emulator (cmake/cuda_emulator.cmake).
#ifndef NANOQ_CUDA_BACKEND_NAME
#define NANOQ_CUDA_BACKEND_NAME "cuda"
#endif

namespace nanoq {
namespace cuda {

class LtMatmul;
class FusedAttention;
enum class Fp8Format;  // kernels.h

class CudaBackend final : public Backend {
public:
    explicit CudaBackend(int device);
    ~CudaBackend() override;

    int device() const { return device_; }
    // How many passes over a source tensor the fp8 path has made to
    // quantize operands into its buffer (both forms at once count one; the
    // weight cache's do not count). The emulator's probes read it.
    std::uint64_t fp8_quantizations() const { return fp8_quantizations_; }
    // How many of those took their maximum from a producing kernel instead
    // of a pass of their own (producer maxima, cuda_backend.cpp).
    std::uint64_t fp8_producer_maxima_taken() const { return fp8_producer_maxima_taken_; }
    // How many took the forward's maximum of the same values (forward maxima, cuda_backend.cpp).
    std::uint64_t fp8_forward_maxima_taken() const { return fp8_forward_maxima_taken_; }
    cudaStream_t stream() const { return stream_; }
    // Waits on the host until `stream` has run everything queued on it. It
    // polls rather than blocking in the runtime, calling the check set by
    // set_host_wait_check meanwhile, so that a wait on a collective that a
    // failed peer will never join ends (the check throws) instead of hanging.
    void host_wait(cudaStream_t stream);
    // The same wait for an event to complete.
    void host_wait(cudaEvent_t event);
    // The check host waits call as they begin (with 0) and while they poll,
    // with the seconds the wait has lasted (the communicator's: its group's
    // abort flag, NCCL's asynchronous errors and the collective time
    // limit); empty for none.
    void set_host_wait_check(std::function<void(double)> check) { host_wait_check_ = std::move(check); }

    std::string name() const override { return NANOQ_CUDA_BACKEND_NAME; }
    void configure(const TrainOptions& options) override { options_ = options; }
    // Every slot of the fp8 weight cache is stale from here on the stream.
    void weights_changed() override;
    // fp8 forward maxima (cuda_backend.cpp): the next op's projection input is `site`'s value.
    void projection_input(int site, bool defines) override;
    // The options configure() kept (the defaults until it is called, as in the op harness).
    const TrainOptions& options() const { return options_; }
    // With options().cuda_graphs: the first call with `key` runs the body
    // as it is (a warm-up: libraries may allocate or build plans on first
    // use, which a capture forbids), the second captures its work on this
    // device's streams as a CUDA graph, and that and every later call
    // launch the graph (see Backend::run_captured).
    void run_captured(const std::string& key, const std::function<void()>& body) override;
    void release_captured() override;
    // What reserve_scratch allocates (BackendPlugin::scratch_plan): the op
    // scratch of scratch_bytes(), the cuBLASLt workspace, pinned staging, with
    // matmul_dtype fp8 the fp8 operands (fp8_operand_bytes) and, when
    // attention runs fused (choose_attention, fused_attention.h), the
    // fused attention's workspace, asked of `attention` where given (else
    // its upper bound, inexact) and, with packed_documents, the mask of
    // packed documents (attention-document-mask) where the library takes
    // their plans; and for shapes with a q|k|v projection its packed output
    // (qkv-packed). *chosen (may be null) says which attention runs.
    struct AttentionChoice {
        bool fused = false;           // attention runs in the fused library
        bool documents = false;       // and so do packed documents (a mask is planned)
        std::string documents_refused;  // why not: the library refused their plans, or seq_len % 8
        std::string refused;  // why "auto" runs native where the library failed (not its limits)
    };
    static std::vector<ScratchBuffer> scratch_plan(const ScratchShapes& shapes, bool ask_libraries,
                                                   FusedAttention* attention = nullptr,
                                                   const std::string& why_none = "",
                                                   AttentionChoice* chosen = nullptr);
    // One op scratch for the largest op's need (ops run in order on the
    // stream); *exact as ScratchBuffer::exact.
    static std::size_t scratch_bytes(const ScratchShapes& shapes, bool ask_libraries, bool* exact);
    // The fp8 projections' quantized input and weight and their scales: room
    // for the largest projection of the shapes.
    static std::size_t fp8_operand_bytes(const ScratchShapes& shapes);
    // The fp8 weight cache (cuda_backend.cpp): the e4m3 copies of every
    // layer's projection weights, as stored and transposed; 0 where there is
    // none (matmul_dtype auto, weights not in place, or NANOQ_FP8_WEIGHT_CACHE=0).
    static std::size_t fp8_weight_cache_bytes(const ScratchShapes& shapes);
    void* raw_alloc(std::size_t bytes, MemoryKind kind) override;
    void raw_free(void* data, MemoryKind kind) override;
    void reserve_scratch(NamedAllocator& allocator, const ScratchShapes& shapes) override;
    void copy_from_host(const Tensor& dst, const void* src) override;
    void copy_from_device(const Tensor& dst, const void* src, int source_device) override;
    void copy_to_host(void* dst, const Tensor& src) override;
    void copy(const Tensor& dst, const Tensor& src) override;
    void fill(const Tensor& t, float value) override;
    void synchronize() override;
    void record_batch_ready(const std::uintptr_t* streams, int count) override;
    void wait_batch_ready(Backend& source) override;
    void copy_from_staging(const Tensor& dst, const void* src) override;
    void mark_batch_read() override;
    void wait_batch_read() override;
    bool memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override;

    void matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a, bool trans_b,
                bool accumulate) override;
    void matmul_epilogue(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M, int N, int K,
                         bool trans_a, bool trans_b, bool accumulate, float scale) override;
    // With matmul_dtype fp8 the projections' backward runs in fp8 too
    // (fp8_input_grad, fp8_weight_grad in cuda_backend.cpp).
    void matmul_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                           bool accumulate) override;
    void matmul_weight_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x, int rows,
                            int n, int k) override;
    // With matmul_dtype fp8 dy is quantized once for both products (both forms in one pass).
    void matmul_backward(const Tensor& dx, bool accumulate, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& weight, const Tensor& x, int rows, int n, int k) override;
    // With matmul_dtype fp8, the classifier's matmuls stay in the activations' dtype.
    void classifier(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, const Tensor& stats,
                    const Tensor& dhidden, const Tensor& dlm_head, const Tensor& workspace, int rows, int channels,
                    int vocab, int time, float z_loss) override;
    void add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) override;
    void bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) override;
    void add(const Tensor& out, const Tensor& a, const Tensor& b) override;
    void accumulate(const Tensor& out, const Tensor& a) override;
    void scale_dropout(const Tensor& out, const Tensor& in, float scale, float drop, std::uint64_t seed,
                       const Tensor& seed_base) override;
    void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int rows,
                           int channels) override;
    void embedding_backward(const Tensor& table_grad, const Tensor& dout, const Tensor& tokens, int rows,
                            int channels) override;
    void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, int rows,
                         int channels, float eps) override;
    void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                          const Tensor& weight, const Tensor& rstd, int rows, int channels, bool accumulate) override;
    void rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads, int head_dim) override;
    void rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                       int head_dim) override;
    void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& positions, const AttentionShape& shape) override;
    AttentionInfo attention_info() const override;
    void positions_changed(const Tensor& positions, const AttentionShape& shape) override;
    void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& positions, const AttentionShape& shape) override;
    void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionShape& shape, const Tensor& workspace, const Tensor& lse_workspace) override;
    void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override;
    void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                         const Tensor& up) override;
    void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows, int vocab,
                       int first_position, int time, float z_loss, bool with_grad) override;
    void sum_squares(const Tensor& out, const Tensor& x) override;
    void optimizer_scale(const Tensor& out, const Tensor& gathered, int ranks, const Tensor& grad_clip) override;
    void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& scale,
               const AdamWStep& step) override;
    void adamw_shard(const AdamWShard& shard) override;

    // Fused composites (the rest keep their default bodies).
    void residual_rmsnorm_forward(const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                                  const Tensor& residual, const Tensor& delta, const Tensor& weight, int rows,
                                  int channels, float eps) override;
    void qk_norm_rope_forward(const QkvActivations& a, const QkvWeights& weights, const Tensor& cos_sin,
                              const QkvShape& shape) override;
    void qk_norm_rope_backward(const Tensor& dq, const Tensor& dk, const QkvActivations& a, const QkvWeights& weights,
                               const QkvWeights& grads, const Tensor& cos_sin, const QkvShape& shape) override;
    // One matmul for each packed projection (cuda_backend.cpp, "Packed projections").
    void qkv_projection(const QkvActivations& a, const Tensor& x, const QkvWeights& weights,
                        const QkvShape& shape) override;
    void qkv_forward(const QkvActivations& a, const Tensor& x, const QkvWeights& weights, const Tensor& cos_sin,
                     const QkvShape& shape) override;
    void qkv_projection_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads, const Tensor& dq,
                                 const Tensor& dk, const Tensor& dv, const Tensor& x, const QkvWeights& weights,
                                 const QkvShape& shape) override;
    void qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads, const Tensor& dq, const Tensor& dk,
                      const Tensor& dv, const QkvActivations& a, const Tensor& x, const QkvWeights& weights,
                      const Tensor& cos_sin, const QkvShape& shape) override;
    void gate_up_projection(const Tensor& gate, const Tensor& up, const Tensor& x, const Tensor& gate_up, int rows,
                            int intermediate, int channels) override;
    void gate_up_projection_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up, const Tensor& dgate,
                                     const Tensor& dup, const Tensor& x, const Tensor& gate_up, int rows,
                                     int intermediate, int channels) override;

private:
    void* scratch(std::size_t bytes) const;
    // Every op that queues work opens one, first thing (cuda_backend.cpp,
    // producer maxima): the outermost one of a call is the start of an op.
    class OpScope {
    public:
        explicit OpScope(CudaBackend& backend) : backend_(backend) {
            if (backend_.op_depth_++ == 0) backend_.next_op();
        }
        ~OpScope() { --backend_.op_depth_; }
        OpScope(const OpScope&) = delete;
        OpScope& operator=(const OpScope&) = delete;

    private:
        CudaBackend& backend_;
    };
    void next_op();
    void fp8_forget_produced() {
        fp8_produced_.clear();
        fp8_produced_before_.clear();
    }
    // A device float for the largest magnitude of `out` (bf16, as stored)
    // that the producing kernel about to be launched takes, zeroed on the
    // stream and recorded for out; null when fp8 is off, out is not bf16,
    // the kernel writes less than all of out (`written` elements) or
    // producer maxima are off (NANOQ_FP8_PRODUCER_MAXIMA=0).
    float* fp8_produce_max(const Tensor& out, std::int64_t written);
    // The recorded maximum of x[numel] (this op's or the previous op's), or null.
    float* fp8_produced_max(const Tensor& x, std::int64_t numel) const;
    // The fp8 path of a projection out = a @ b^T (+ bias): true when it ran,
    // false when the call is not one (see cuda_backend.cpp) or fp8 is off.
    bool fp8_projection(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M, int N, int K,
                        bool trans_a, bool trans_b, bool accumulate, float scale);
    // The fp8 paths of the backward's products (true when they ran): dgrad
    // dx (+)= dy W, wgrad dweight += dy^T x (see cuda_backend.cpp).
    bool fp8_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                        bool accumulate);
    bool fp8_weight_grad(const Tensor& dweight, const Tensor& dy, const Tensor& x, int rows, int n, int k);
    // Whether a product of this shape may run in fp8 (matmul_dtype fp8, the
    // operand buffer reserved, not in the classifier, M, N, K multiples of 16).
    bool fp8_applies(int M, int N, int K) const;
    // Whether fp8_input_grad / fp8_weight_grad take these operands.
    bool fp8_input_grad_runs(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k) const;
    bool fp8_weight_grad_runs(const Tensor& dweight, const Tensor& dy, const Tensor& x, int rows, int n, int k) const;
    // One quantized operand: its codes and the inverse scale cuBLASLt reads.
    struct Fp8Operand {
        const std::uint8_t* codes;
        const float* inverse_scale;
    };
    // The operand buffer (fp8_operands_): a header of (maximum, inverse
    // scale) pairs, then the operands' codes, each 256-byte aligned, taken in
    // order from the start. Each product outside an Fp8Reuse starts it
    // afresh (fp8_begin). While an Fp8Reuse lives (a composite's call), its
    // products' operands stay and a later product of the same tensor in the
    // same form and format takes them again (fp8_reused_): the composites'
    // inputs do not change during the call.
    class Fp8Reuse {
    public:
        explicit Fp8Reuse(CudaBackend& backend) : backend_(backend) { ++backend_.fp8_reuse_depth_; }
        ~Fp8Reuse();
        Fp8Reuse(const Fp8Reuse&) = delete;
        Fp8Reuse& operator=(const Fp8Reuse&) = delete;

    private:
        CudaBackend& backend_;
    };
    void fp8_begin();
    // x[rows, cols] (bf16) quantized as stored or transposed ([cols, rows]),
    // or its earlier quantization. `keep_max` (as stored only; null: none)
    // also gets its maximum; with `known_max` (null: none) that float holds
    // the maximum already and no pass computes it.
    Fp8Operand fp8_operand(const Tensor& x, int rows, int cols, bool transposed, Fp8Format format,
                           float* keep_max = nullptr, float* known_max = nullptr);
    // Forward maxima: the slot of the current op's projection input where
    // it may keep (`defining`) or take (not) that input's maximum; null when
    // it may not.
    float* fp8_site_slot(bool defining) const;
    // Both forms of x at once (one maximum, one pass), for the products of
    // the current Fp8Reuse to take; nothing when they are there already.
    void fp8_both_forms(const Tensor& x, int rows, int cols, Fp8Format format);
    // A weight's e4m3 copy from the weight cache where it has one, else fp8_operand's.
    Fp8Operand fp8_weight(const Tensor& weight, int rows, int cols, bool transposed);
    // The next `bytes` of the buffer (256-byte aligned) and the next header pair.
    std::uint8_t* fp8_take(std::size_t bytes, int rows, int cols);
    float* fp8_take_scales();
    // The e4m3 copy of weight[rows, cols] (as stored, or transposed: [cols,
    // rows]) from the weight cache, quantized now unless current, with its
    // inverse scale at *inverse_scale; null when the cache has no room for
    // it (or there is no cache): fp8_weight quantizes into the buffer then.
    const std::uint8_t* fp8_cached_weight(const Tensor& weight, int rows, int cols, bool transposed,
                                          const float** inverse_scale);
    // The qkv-packed scratch as [rows, (H + 2 Hkv) * D] of the activations'
    // dtype, or empty where the packed path cannot take the call.
    Tensor packed_qkv(const QkvShape& shape, std::initializer_list<const Tensor*> activations) const;
    // The fused q/k norm and RoPE backward of dq, dk in place, and with
    // `packed` (then dv too) dq|dk|dv stored into it: one launch.
    void norm_rope_backward(const Tensor& packed, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const QkvActivations& a, const QkvWeights& weights, const QkvWeights& grads,
                            const Tensor& cos_sin, const QkvShape& shape);
    // dx (+)= dqkv Wqkv and, unless frozen, the weight and bias gradients of
    // the packed gradient dqkv: one dgrad and one wgrad matmul.
    void packed_qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& grads, const Tensor& dqkv,
                             const Tensor& x, const QkvWeights& weights, const QkvShape& shape);

    int device_;
    TrainOptions options_;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<LtMatmul> matmul_;
    Tensor scratch_;          // shared by all ops: they run in order on one stream
    Tensor matmul_workspace_;
    Tensor fp8_operands_;     // empty unless matmul_dtype is fp8
    // Where the buffer stands (see Fp8Reuse): bytes and header pairs taken,
    // the operands there, the open Fp8Reuses and whether theirs has begun.
    struct Fp8Key {
        const void* data;
        int rows, cols;
        bool transposed;
        Fp8Format format;
        bool operator==(const Fp8Key& o) const {
            return data == o.data && rows == o.rows && cols == o.cols && transposed == o.transposed &&
                   format == o.format;
        }
    };
    std::size_t fp8_used_ = 0;
    int fp8_scales_used_ = 0;
    std::vector<std::pair<Fp8Key, Fp8Operand>> fp8_reused_;
    int fp8_reuse_depth_ = 0;
    bool fp8_reuse_begun_ = false;
    std::uint64_t fp8_quantizations_ = 0;
    std::uint64_t fp8_producer_maxima_taken_ = 0;
    // Producer maxima (cuda_backend.cpp): the records of this op and of the
    // previous one, the next slot of the ring (in fp8_operands_, after the
    // header) and whether they are on.
    struct ProducedMax {
        const void* data;
        std::int64_t numel;
        float* amax;
    };
    std::vector<ProducedMax> fp8_produced_, fp8_produced_before_;
    int fp8_produced_next_ = 0;
    bool fp8_producer_maxima_ = true;
    // Whether forward products run in cuBLASLt's fp8 fast accumulation mode
    // (cuda_backend.cpp; NANOQ_FP8_FAST_ACCUM=0 turns it off).
    bool fp8_fast_forward_ = true;
    // Forward maxima: the site the next op's projection input holds (-1:
    // none) and whether the op defines it, the current op's, which sites'
    // slots hold this micro-batch's maximum, where the slots start in
    // fp8_operands_ (after the producer maxima), and whether they are on.
    int fp8_site_pending_ = -1, fp8_site_ = -1;
    bool fp8_site_pending_defines_ = false, fp8_site_defines_ = false;
    std::vector<char> fp8_site_known_;
    bool fp8_forward_maxima_ = true;
    std::uint64_t fp8_forward_maxima_taken_ = 0;
    int op_depth_ = 0;
    // The fp8 weight cache: a generation word, then one slot per (weight,
    // shape, layout) in first-use order: its header (amax, inverse scale,
    // stamp) and its bytes. Empty where there is no cache.
    Tensor fp8_weight_cache_;
    std::map<std::tuple<const void*, int, int, bool>, std::size_t> fp8_cache_slots_;  // -> slot offset
    std::size_t fp8_cache_used_ = 0;
    Tensor qkv_packed_;       // the packed q|k|v projection (or its gradient) between its matmul and its pass
    bool in_classifier_ = false;
    Tensor pinned_;           // host staging for copy_from_host
    // Fused attention (cuDNN): the device's (shared by the process's
    // backends, fused_attention.h), taken by reserve_scratch when the shapes
    // may use it; attention_fused_ says whether attention runs there, for
    // the shape and dtype that reserve_scratch prepared (fused_documents_:
    // with the documents' mask too).
    FusedAttention* fused_attention_ = nullptr;
    bool attention_fused_ = false;
    AttentionShape fused_shape_{};
    DType fused_dtype_ = DType::BF16;
    bool fused_documents_ = false;
    bool attention_deterministic_ = true;  // ScratchShapes::attention_deterministic of the fused plans
    bool fused_backward_ = true;           // ScratchShapes::backward: the backward plans were prepared too
    Tensor attention_workspace_;
    // Packed documents in the fused library: their mask (bf16 [B,1,T,T],
    // written from the positions once per batch, positions_changed, or by
    // each call with positions not announced), null when they run native.
    Tensor attention_mask_;
    const void* mask_positions_ = nullptr;  // the positions the mask holds (positions_changed)
    int mask_batch_ = 0, mask_time_ = 0;
    std::int64_t document_masks_ = 0;     // masks written (AttentionInfo::document_masks)
    bool said_documents_native_ = false;  // the one note that packed rows run native
    // Whether the fused library runs packed documents of `shape` (the mask reserved and large enough).
    bool documents_fused(const AttentionShape& shape) const;
    void write_document_mask(const Tensor& positions, const AttentionShape& shape);
    // Whether an attention call of `shape` (prepared by reserve_scratch) with
    // `positions` runs fused; where packed documents do, writes their mask
    // first unless positions_changed did.
    bool fused_attention_runs(const Tensor& positions, const AttentionShape& shape, DType dtype);
    std::size_t pinned_used_ = 0;
    // Recorded after the latest copy out of pinned_: once it has completed,
    // no staged copy is in flight and pinned_ may be reused from the start.
    cudaEvent_t staged_ = nullptr;
    std::function<void(double)> host_wait_check_;
    // record_batch_ready's marks on the caller's streams (inputs, targets).
    cudaEvent_t batch_ready_[2] = {nullptr, nullptr};
    int batch_ready_count_ = 0;
    // mark_batch_read's mark: recorded after the latest micro-batch copies.
    cudaEvent_t batch_read_ = nullptr;
    // run_captured's graphs by key (null after the warm-up, until captured).
    std::map<std::string, cudaGraphExec_t> graphs_;
};

}  // namespace cuda
}  // namespace nanoq
