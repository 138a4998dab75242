// The cuda backend: Backend ops as kernel launches on one stream per GPU.
//
// dtype dispatch lives here, in `with_dtype`: kernels are templates over
// float/bf16 and know nothing of tensors. All ops share one scratch buffer,
// sized once for the largest op (reserve_scratch), which is safe because they
// run in order on the device's stream. This library registers itself as the
// "cuda" backend when the core loads it.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "cuda/cublaslt_matmul.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_attention.h"
#include "cuda/host_wait.h"
#include "cuda/kernels.h"

namespace nanoq {
namespace cuda {

std::shared_ptr<CommGroup> make_nccl_group(const Topology& topology);
std::string new_nccl_id();

namespace {

constexpr std::size_t kMatmulWorkspaceBytes = std::size_t(32) << 20;
// The fused attention's workspace in the scratch plan (when attention runs fused).
constexpr const char* kAttentionWorkspaceName = "cudnn-attention-workspace";
// The mask of packed documents (TrainOptions::packed_documents) where the
// fused attention runs them.
constexpr const char* kAttentionMaskName = "attention-document-mask";
// The fp8 operands buffer (one product at a time: they run in order on the
// stream): a header of scale floats (each operand's maximum and inverse
// scale), then the ring of producer maxima (kFp8ProducedSlots floats), then
// the forward maxima's slots (Backend::kProjectionSites floats per layer),
// then the operands' codes, each 256-byte aligned as cuBLASLt prefers.
constexpr std::size_t kFp8Align = 256;
constexpr int kFp8ProducedSlots = static_cast<int>(kFp8Align / sizeof(float));
constexpr std::size_t kFp8CodesStart = 2 * kFp8Align;
constexpr const char* kFp8OperandsName = "fp8-operands";
constexpr const char* kFp8WeightCacheName = "fp8-weight-cache";
// The packed q|k|v projection's output (forward) or gradient (backward),
// [rows, (H + 2 Hkv) * D] in the activations' dtype (Packed projections, below).
constexpr const char* kQkvPackedName = "qkv-packed";
std::int64_t qkv_packed_elements(const AttentionShape& a) {
    return std::int64_t(a.batch) * a.time * (a.heads + 2 * a.kv_heads) * a.head_dim;
}
std::size_t fp8_aligned(std::size_t bytes) { return (bytes + kFp8Align - 1) / kFp8Align * kFp8Align; }
// The forward maxima's slots of `sites` sites.
std::size_t fp8_site_bytes(std::size_t sites) { return fp8_aligned(sizeof(float) * sites); }

// An on/off environment switch: true unless it is "0"; InvalidArgument for
// anything but "", "0" and "1".
bool env_switch(const char* name) {
    const char* env = std::getenv(name);
    if (env && *env && std::strcmp(env, "0") && std::strcmp(env, "1"))
        throw InvalidArgument(std::string(name) + " must be 0 or 1, got \"" + env + "\"");
    return !(env && !std::strcmp(env, "0"));
}

// Calls fn(T{}) with T the C++ type of an activation/weight dtype.
template <class Fn>
void with_dtype(DType dtype, Fn&& fn) {
    switch (dtype) {
        case DType::F32: fn(float{}); return;
        case DType::BF16: fn(bf16{}); return;
        default: throw InternalError(std::string("cuda op on ") + dtype_name(dtype));
    }
}

template <class T>
T* ptr(const Tensor& t) {
    return static_cast<T*>(t.data);
}

void require_same_dtype(const Tensor& a, const Tensor& b, const char* op) {
    if (a.dtype != b.dtype)
        throw InternalError(std::string(op) + ": " + dtype_name(a.dtype) + " and " + dtype_name(b.dtype) + " mixed");
}

int visible_devices() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();  // no driver or no device: clear the sticky error
        return 0;
    }
    return count;
}

std::unique_ptr<Backend> create(int device, int /*threads*/) { return std::make_unique<CudaBackend>(device); }

// The fused attention of this build on the current device, or null: none
// in the build, or it could not start (*why_none says why). One per device
// for the process, shared by the memory planning and every backend of the
// device, so that each shape's plans, each compiled at run time on Hopper,
// are built once: a Trainer's classifier-chunk search plans its shapes once
// per candidate, its backend reserves them, estimate_memory and every
// further Trainer of the shape ask again. Never destroyed: its library
// handle must not outlive the CUDA runtime at exit.
FusedAttention* device_fused_attention(std::string* why_none) {
    static std::mutex mutex;
    static auto* started = new std::map<int, std::unique_ptr<FusedAttention>>();
    int device = 0;
    NANOQ_CUDA_CHECK(cudaGetDevice(&device));
    const std::lock_guard<std::mutex> lock(mutex);
    std::unique_ptr<FusedAttention>& attention = (*started)[device];
    why_none->clear();
    // Only an engine that started is kept: one that failed (the device out
    // of memory for a moment, say) is tried again by the next caller.
    if (!attention) {
        try {
            std::unique_ptr<AttentionEngine> engine = make_attention_engine();
            if (engine) attention = std::make_unique<FusedAttention>(std::move(engine));
        } catch (const std::exception& e) {
            *why_none = e.what();
        }
    }
    return attention.get();
}

std::vector<ScratchBuffer> plan(const ScratchShapes& shapes, int /*threads*/, bool ask_libraries) {
    // The fused attention's plans are asked of the device's engine where
    // one can run (a device); else its workspace is planned at the bound.
    if (!(ask_libraries && attention_engine_wanted(shapes) && visible_devices() > 0))
        return CudaBackend::scratch_plan(shapes, ask_libraries, nullptr, "");
    std::string why_none;
    FusedAttention* attention = device_fused_attention(&why_none);
    return CudaBackend::scratch_plan(shapes, ask_libraries, attention, why_none);
}

// Whether the work before the latest record of `event` has completed.
bool event_done(cudaEvent_t event) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaErrorNotReady) cudaGetLastError();  // no error, though the runtime may record it
    return status == cudaSuccess;
}

// The stream a CUDA Array Interface v3 handle names, for the calling thread
// and its current device.
cudaStream_t interface_stream(std::uintptr_t handle) {
    if (handle == 1) return cudaStreamLegacy;
    if (handle == 2) return cudaStreamPerThread;
    return reinterpret_cast<cudaStream_t>(handle);
}

std::size_t device_memory(int device) {
    int current = 0;
    std::size_t free_bytes = 0, total_bytes = 0;
    if (device < 0 || device >= visible_devices() || cudaGetDevice(&current) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const bool known = cudaSetDevice(device) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    cudaGetLastError();
    cudaSetDevice(current);
    return known ? total_bytes : 0;
}

[[maybe_unused]] const bool registered = [] {
    // Classifier chunks of at least 64M logits (128 MiB in bf16): a few
    // hundred rows of a 150k vocabulary, enough blocks and matmul rows to
    // fill the GPU; more where the memory budget allows (one chunk of all
    // rows when it fits).
    register_backend(NANOQ_CUDA_BACKEND_NAME, BackendPlugin{&create, &make_nccl_group, &visible_devices, &plan,
                                                            std::int64_t(1) << 26, MemoryKind::Pinned, &new_nccl_id,
                                                            &attention_engine_library, &device_memory});
    return true;
}();

}  // namespace

std::size_t CudaBackend::scratch_bytes(const ScratchShapes& s, bool ask_libraries, bool* exact) {
    const AttentionShape& a = s.attention;
    if (a.head_dim > 256)
        throw InvalidArgument("the cuda backend's attention supports head_dim up to 256, got " +
                              std::to_string(a.head_dim));
    const int rows = a.batch * a.time;
    const int q_width = a.heads * a.head_dim, kv_width = a.kv_heads * a.head_dim;
    std::size_t bytes = 0;
    auto need = [&](std::size_t b) { bytes = std::max(bytes, b); };
    // The bias column sums (bias_backward) at every width a bias has: q; k
    // and v; o and down (hidden); the packed q|k|v; gate and up (intermediate,
    // with mlp_bias: at large B*T this is the largest need of all).
    for (int cols : {q_width, kv_width, s.hidden, q_width + 2 * kv_width, s.intermediate})
        need(sizeof(float) * bias_backward_scratch_floats(rows, cols));
    need(rmsnorm_backward_scratch_bytes(rows, s.hidden));
    need(rmsnorm_backward_scratch_bytes(rows * a.heads, a.head_dim));
    need(rmsnorm_backward_scratch_bytes(rows * a.kv_heads, a.head_dim));
    need(qk_norm_rope_backward_scratch_bytes(a.batch, a.time, a.heads, a.kv_heads, a.head_dim));
    need(attention_backward_scratch_bytes(a.batch, a.time, a.heads, a.kv_heads, a.head_dim));
    need(sizeof(float) * classifier_scratch_floats(s.classifier_rows));
    need(sizeof(float) * sum_squares_scratch_floats(s.max_reduce));
    // The one size a library reports: where it is only bounded, the total is
    // inexact if the bound is the largest need (else the true need is below another's).
    bool sort_exact = true;
    const std::size_t embedding = embedding_backward_scratch_bytes(rows, s.vocab, ask_libraries, &sort_exact);
    *exact = sort_exact || embedding <= bytes;
    return std::max(bytes, embedding);
}

std::size_t CudaBackend::fp8_operand_bytes(const ScratchShapes& s) {
    const AttentionShape& a = s.attention;
    const std::size_t rows = std::size_t(a.batch) * a.time, C = s.hidden, I = s.intermediate;
    const std::size_t Q = std::size_t(a.heads) * a.head_dim, P = std::size_t(a.heads + 2 * a.kv_heads) * a.head_dim;
    // What each call holds at once (the operands of one product, or of one
    // Fp8Reuse), with room for the weights as if uncached (ZeRO-3 has no
    // cache, and a weight the cache cannot take is quantized here):
    const std::vector<std::vector<std::size_t>> calls = {
        {rows * C, P * C},                       // q|k|v forward: x, W
        {rows * Q, C * Q},                       // o forward
        {rows * C, I * C, I * C},                // gate|up forward: x once, Wg, Wu
        {rows * I, C * I},                       // down forward
        {rows * P, rows * P, rows * C, P * C},   // q|k|v backward: dy, dy^T, x^T, W^T
        {rows * C, rows * C, rows * Q, C * Q},   // o backward
        {rows * I, rows * I, rows * I, rows * I, rows * C, I * C, I * C},  // gate|up backward: dgate, dup (both
                                                                           // forms), x^T, Wg^T, Wu^T
        {rows * C, rows * C, rows * I, C * I},   // down backward
    };
    std::size_t most = 0;
    for (const auto& operands : calls) {
        std::size_t bytes = 0;
        for (std::size_t operand : operands) bytes += fp8_aligned(operand);
        most = std::max(most, bytes);
    }
    // The header of maxima and inverse scales, the producer maxima, the forward maxima, the codes.
    return kFp8CodesStart + fp8_site_bytes(std::size_t(std::max(s.layers, 0)) * kProjectionSites) + most;
}

// The fp8 weight cache: each projection weight's e4m3 copy (forward) and
// transposed copy (dgrad) are quantized once per generation of the weights
// instead of on every call, so that the micro-batches of an optimizer step
// (and a recomputed forward) reuse them. weights_changed() (after update()
// and set_parameter()) advances the generation on the device; each slot
// remembers the generation it was quantized at, and the quantize kernels
// check it on the device, so a captured graph's replay quantizes exactly
// when the weights have changed. Slots are keyed by the weight's address,
// which is why there is no cache where layer weights are gathered into
// reused buffers (ZeRO stage 3). A slot: a 256-byte header (amax, inverse
// scale, stamp), then the bytes, 256-byte aligned. NANOQ_FP8_WEIGHT_CACHE=0
// turns the cache off (the tests compare the two).
std::size_t CudaBackend::fp8_weight_cache_bytes(const ScratchShapes& s) {
    if (s.matmul_dtype != MatmulPrecision::FP8 || !s.weights_in_place || s.layers <= 0) return 0;
    if (!env_switch("NANOQ_FP8_WEIGHT_CACHE")) return 0;
    const AttentionShape& a = s.attention;
    const std::size_t hidden = s.hidden, intermediate = s.intermediate;
    const std::size_t q = std::size_t(a.heads) * a.head_dim, kv = std::size_t(a.kv_heads) * a.head_dim;
    // q, k, v, o, gate, up, down, each as stored and transposed.
    const std::size_t weights[] = {q * hidden, kv * hidden, kv * hidden, hidden * q,
                                   intermediate * hidden, intermediate * hidden, hidden * intermediate};
    std::size_t per_layer = 0;
    for (std::size_t bytes : weights) per_layer += 2 * (kFp8Align + fp8_aligned(bytes));
    return kFp8Align + std::size_t(s.layers) * per_layer;
}

std::vector<ScratchBuffer> CudaBackend::scratch_plan(const ScratchShapes& s, bool ask_libraries,
                                                     FusedAttention* attention, const std::string& why_none,
                                                     AttentionChoice* chosen) {
    bool exact = true;
    const std::size_t bytes = scratch_bytes(s, ask_libraries, &exact);
    const std::int64_t rows = std::int64_t(s.attention.batch) * s.attention.time;
    std::vector<ScratchBuffer> plan = {
        {"cuda-op-scratch", DType::F32, static_cast<std::int64_t>((bytes + 3) / 4), MemoryKind::Device, exact},
        {"cublaslt-workspace", DType::F32, static_cast<std::int64_t>(kMatmulWorkspaceBytes / 4), MemoryKind::Device,
         true},
        // Room for one batch of tokens and targets between synchronisations.
        {"host-staging", DType::I32, 2 * rows, MemoryKind::Pinned, true},
    };
    AttentionChoice choice;
    choice.fused = choose_attention(s, attention, why_none, &choice.refused);
    if (choice.fused) {
        std::size_t workspace =
            attention ? attention->prepare(s.attention, attention_dtype(s), false, s.attention_deterministic, s.backward)
                      : attention_workspace_bound(s.attention, s.attention_deterministic, s.backward);
        // Packed documents: the plans with a bias, where the library builds
        // them ("cudnn" insists; "auto" runs them natively, saying why).
        if (s.packed_documents) {
            choice.documents = true;
            // The mask's rows (T bf16 each) must keep the 16-byte alignment
            // cuDNN assumes of every row without checking it.
            if (s.attention.time % 8 != 0) {
                const std::string why = "the document mask needs seq_len a multiple of 8 in the fused library, got " +
                                        std::to_string(s.attention.time);
                if (s.attention_impl == AttentionImpl::Cudnn)
                    throw InvalidArgument("attention=\"cudnn\" cannot run packed documents (packed_documents): " +
                                          why);
                choice.documents = false;
                choice.documents_refused = why;
            } else if (attention) {
                try {
                    workspace = std::max(workspace, attention->prepare(s.attention, attention_dtype(s), true,
                                                                          s.attention_deterministic, s.backward));
                } catch (const NanoqError& e) {
                    if (s.attention_impl == AttentionImpl::Cudnn)
                        throw InvalidArgument(std::string("attention=\"cudnn\" cannot run packed documents "
                                                          "(packed_documents): ") + e.what());
                    choice.documents = false;
                    choice.documents_refused = e.what();
                }
            }
        }
        // At least one element, so that the buffer shows in the plan even
        // where the library needs none.
        plan.push_back({kAttentionWorkspaceName, DType::F32,
                        std::max<std::int64_t>(1, static_cast<std::int64_t>((workspace + 3) / 4)), MemoryKind::Device,
                        attention != nullptr});
        if (choice.documents)
            plan.push_back({kAttentionMaskName, DType::BF16, attention_bias_elements(s.attention), MemoryKind::Device,
                            true});
    }
    if (chosen) *chosen = choice;
    if (s.matmul_dtype == MatmulPrecision::FP8)
        plan.push_back({kFp8OperandsName, DType::F32, static_cast<std::int64_t>(fp8_operand_bytes(s) / 4),
                        MemoryKind::Device, true});
    if (const std::size_t cache = fp8_weight_cache_bytes(s))
        plan.push_back({kFp8WeightCacheName, DType::F32, static_cast<std::int64_t>(cache / 4), MemoryKind::Device,
                        true});
    // Shapes with a q|k|v projection (hidden > 0) only.
    if (s.hidden > 0 && qkv_packed_elements(s.attention) > 0)
        plan.push_back({kQkvPackedName, s.dtype == Precision::BF16 ? DType::BF16 : DType::F32,
                        qkv_packed_elements(s.attention), MemoryKind::Device, true});
    return plan;
}

namespace {

// A build has code for the GPUs of the architectures it was built for
// (cmake/cuda_architectures.cmake) and, through their PTX, for newer ones. On an
// older GPU every kernel launch would fail with "no kernel image": say so
// before any work, with how to build for it. (Compute capability 8.0 is the
// oldest the backend supports, as build_backend/nanoq_build.py's
// MIN_COMPUTE_CAPABILITY says; a test holds the two together.)
void check_kernel_image(int device) {
    const cudaError_t status = kernel_image_status();
    if (status == cudaSuccess) return;
    if (status != cudaErrorNoKernelImageForDevice && status != cudaErrorInvalidDeviceFunction)
        NANOQ_CUDA_CHECK(status);
    int major = 0, minor = 0;
    NANOQ_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    NANOQ_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    const std::string what = "this cuda backend has no code for device " + std::to_string(device) +
                             " (compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                             "): it was built for CUDA architectures " + NANOQ_CUDA_ARCHITECTURES + ". ";
    if (major < 8)
        throw NanoqError(what + "The cuda backend supports GPUs of compute capability 8.0 (Ampere) and newer; "
                                "train with backend=\"cpu\" here");
    const std::string arch = std::to_string(major) + std::to_string(minor);
    throw NanoqError(what + "Reinstall it on this machine (pip install . builds for the GPUs it sees), or build it "
                            "for this GPU: CMAKE_ARGS=\"-DCMAKE_CUDA_ARCHITECTURES=" + arch +
                            "\" NANOQ_CUDA=ON pip install .");
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
    NANOQ_CUDA_CHECK(cudaSetDevice(device));
    check_kernel_image(device);
    NANOQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    for (cudaEvent_t& event : batch_ready_) NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&batch_read_, cudaEventDisableTiming));
    matmul_ = std::make_unique<LtMatmul>([this](cudaEvent_t event) { host_wait(event); });
}

CudaBackend::~CudaBackend() {
    cudaSetDevice(device_);
    release_captured();
    matmul_.reset();
    for (cudaEvent_t event : batch_ready_)
        if (event) cudaEventDestroy(event);
    if (batch_read_) cudaEventDestroy(batch_read_);
    if (staged_) cudaEventDestroy(staged_);
    if (stream_) cudaStreamDestroy(stream_);
}

void* CudaBackend::raw_alloc(std::size_t bytes, MemoryKind kind) {
    // Ops may come from another thread than the one that made the backend
    // (OpRunner's callers); every op call allocates first, so set the device here.
    if (kind != MemoryKind::Host) NANOQ_CUDA_CHECK(cudaSetDevice(device_));
    void* data = nullptr;
    cudaError_t status = cudaSuccess;
    switch (kind) {
        case MemoryKind::Device: status = cudaMalloc(&data, bytes); break;
        case MemoryKind::Pinned: status = cudaMallocHost(&data, bytes); break;
        case MemoryKind::Host: return std::malloc(bytes);
    }
    if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return nullptr;
    }
    NANOQ_CUDA_CHECK(status);
    return data;
}

void CudaBackend::raw_free(void* data, MemoryKind kind) {
    if (kind != MemoryKind::Host) cudaSetDevice(device_);  // may run on another thread (destructors)
    switch (kind) {
        case MemoryKind::Device: cudaFree(data); break;
        case MemoryKind::Pinned: cudaFreeHost(data); break;
        case MemoryKind::Host: std::free(data); break;
    }
}

void CudaBackend::reserve_scratch(NamedAllocator& allocator, const ScratchShapes& s) {
    const OpScope op(*this);
    NANOQ_CUDA_CHECK(cudaSetDevice(device_));  // CUB sizes its storage for the current device
    if (s.matmul_dtype == MatmulPrecision::FP8) {
        // cuBLASLt's fp8 matmuls need Ada or Hopper (compute capability 8.9 or newer).
        int major = 0, minor = 0;
        NANOQ_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
        NANOQ_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_));
        if (major * 10 + minor < 89)
            throw InvalidArgument("matmul_dtype \"fp8\" needs a GPU of compute capability 8.9 or newer (Ada, "
                                  "Hopper); device " + std::to_string(device_) + " is " + std::to_string(major) +
                                  "." + std::to_string(minor));
    }
    std::string why_none;
    if (!fused_attention_ && attention_engine_wanted(s)) fused_attention_ = device_fused_attention(&why_none);
    AttentionChoice choice;
    const std::vector<ScratchBuffer> plan = scratch_plan(s, true, fused_attention_, why_none, &choice);
    attention_fused_ = choice.fused;
    attention_deterministic_ = s.attention_deterministic;
    fused_backward_ = s.backward;
    fused_shape_ = s.attention;
    fused_dtype_ = attention_dtype(s);
    fused_documents_ = choice.fused && choice.documents;
    if (!choice.refused.empty())
        std::fprintf(stderr, "nanoq: device %d: attention=\"auto\" runs nanoq's own attention kernels: %s\n",
                     device_, choice.refused.c_str());
    if (!choice.documents_refused.empty())
        std::fprintf(stderr, "nanoq: device %d: packed documents run in nanoq's own attention kernels: %s\n", device_,
                     choice.documents_refused.c_str());
    const std::vector<Tensor> scratch = allocate_scratch(allocator, plan);
    scratch_ = scratch[0];
    matmul_workspace_ = scratch[1];
    pinned_ = scratch[2];
    attention_workspace_ = Tensor();
    attention_mask_ = Tensor();
    mask_positions_ = nullptr;  // a new mask holds no positions yet
    fp8_operands_ = Tensor();
    fp8_weight_cache_ = Tensor();
    qkv_packed_ = Tensor();
    for (std::size_t i = 0; i < plan.size(); ++i) {
        if (plan[i].name == kAttentionWorkspaceName) attention_workspace_ = scratch[i];
        if (plan[i].name == kAttentionMaskName) attention_mask_ = scratch[i];
        if (plan[i].name == kFp8OperandsName) fp8_operands_ = scratch[i];
        if (plan[i].name == kFp8WeightCacheName) fp8_weight_cache_ = scratch[i];
        if (plan[i].name == kQkvPackedName) qkv_packed_ = scratch[i];
    }
    fp8_cache_slots_.clear();
    fp8_cache_used_ = kFp8Align;  // the generation word's block
    fp8_producer_maxima_ = env_switch("NANOQ_FP8_PRODUCER_MAXIMA");
    fp8_fast_forward_ = env_switch("NANOQ_FP8_FAST_ACCUM");
    fp8_forward_maxima_ = env_switch("NANOQ_FP8_FORWARD_MAXIMA");
    fp8_site_known_.assign(fp8_operands_.data ? std::size_t(std::max(s.layers, 0)) * kProjectionSites : 0, 0);
    fp8_site_pending_ = fp8_site_ = -1;
    fp8_forget_produced();
    if (fp8_weight_cache_.data) {
        // Generation 1, every stamp 0: each slot is quantized on first use.
        NANOQ_CUDA_CHECK(cudaMemsetAsync(fp8_weight_cache_.data, 0, fp8_weight_cache_.bytes(), stream_));
        weights_changed();
    }
}

void* CudaBackend::scratch(std::size_t bytes) const {
    if (bytes > scratch_.bytes()) throw InternalError("cuda op needs more scratch than was reserved");
    return scratch_.data;
}

void CudaBackend::copy_from_host(const Tensor& dst, const void* src) {
    const OpScope op(*this);
    const std::size_t bytes = dst.bytes();
    // pinned_ is free again once the copies out of it are known complete:
    // after synchronize(), or once the event after the latest one has
    // completed (also when an op threw before its synchronize()).
    if (pinned_used_ > 0 && event_done(staged_)) pinned_used_ = 0;
    if (pinned_.data && pinned_used_ + bytes <= pinned_.bytes()) {
        // Through pinned memory, so the copy is truly asynchronous.
        char* staging = static_cast<char*>(pinned_.data) + pinned_used_;
        std::memcpy(staging, src, bytes);
        pinned_used_ += bytes;
        NANOQ_CUDA_CHECK(cudaMemcpyAsync(dst.data, staging, bytes, cudaMemcpyDefault, stream_));
        NANOQ_CUDA_CHECK(cudaEventRecord(staged_, stream_));
    } else {
        NANOQ_CUDA_CHECK(cudaMemcpyAsync(dst.data, src, bytes, cudaMemcpyDefault, stream_));
    }
}

void CudaBackend::copy_from_device(const Tensor& dst, const void* src, int source_device) {
    const OpScope op(*this);
    NANOQ_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data, device_, src, source_device, dst.bytes(), stream_));
}

void CudaBackend::copy_to_host(void* dst, const Tensor& src) {
    const OpScope op(*this);
    // Into pageable memory the copy blocks the host until the stream gets
    // there; a polling wait first keeps that from hanging on a collective
    // that a failed peer never joins.
    host_wait(stream_);
    NANOQ_CUDA_CHECK(cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDefault, stream_));
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
    const OpScope op(*this);
    if (dst.numel() != src.numel()) throw InternalError("copy between tensors of different sizes");
    if (dst.dtype == src.dtype) {
        // Default: either side may be pinned host memory (offloaded optimizer state).
        NANOQ_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault, stream_));
        return;
    }
    if (dst.dtype == DType::BF16 && src.dtype == DType::F32)
        cast_f32_to_bf16(ptr<bf16>(dst), ptr<float>(src), src.numel(), stream_);
    else if (dst.dtype == DType::F32 && src.dtype == DType::BF16)
        cast_bf16_to_f32(ptr<float>(dst), ptr<bf16>(src), src.numel(), stream_);
    else
        throw InternalError(std::string("copy from ") + dtype_name(src.dtype) + " to " + dtype_name(dst.dtype));
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::fill(const Tensor& t, float value) {
    const OpScope op(*this);
    if (t.dtype == DType::F64) {  // the statistics
        cuda::fill<double>(t.f64(), value, t.numel(), stream_);
    } else {
        with_dtype(t.dtype, [&](auto tag) {
            using T = decltype(tag);
            cuda::fill<T>(ptr<T>(t), value, t.numel(), stream_);
        });
    }
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::synchronize() {
    const OpScope op(*this);
    host_wait(stream_);
    pinned_used_ = 0;  // every staged copy has completed
}

namespace {

// Polls `query` (cudaStreamQuery or cudaEventQuery of one handle) until the
// work is done, running `check` (with the seconds waited) between polls so
// that a wait on a collective a peer abandoned, or that has lasted beyond
// the collective time limit, ends with an error instead of spinning forever.
template <typename Query>
void poll_until_done(Query query, const char* what, const std::function<void(double)>& check) {
    const auto start = std::chrono::steady_clock::now();
    const auto waited = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    if (check) check(0.0);  // a wait begins (the communicator reads its time limit afresh)
    for (Backoff backoff;; backoff.pause()) {
        const cudaError_t status = query();
        if (status == cudaSuccess) return;
        if (status != cudaErrorNotReady) {
            // A collective that failed because a peer did: the check reports that.
            if (check) check(0.0);
            check_cuda(status, what, __FILE__, __LINE__);
        }
        cudaGetLastError();  // not-ready is no error, though the runtime may record it
        if (check) check(waited());
    }
}

}  // namespace

void CudaBackend::host_wait(cudaStream_t stream) {
    poll_until_done([&] { return cudaStreamQuery(stream); }, "cudaStreamQuery (host wait)", host_wait_check_);
}

void CudaBackend::host_wait(cudaEvent_t event) {
    poll_until_done([&] { return cudaEventQuery(event); }, "cudaEventQuery (host wait)", host_wait_check_);
}

void CudaBackend::run_captured(const std::string& key, const std::function<void()>& body) {
    // The body's ops open their own scopes; a replay runs them without any:
    // no producer maximum recorded before or inside outlives the call.
    fp8_forget_produced();
    struct Forget {
        CudaBackend& backend;
        ~Forget() { backend.fp8_forget_produced(); }
    } forget{*this};
    if (!options_.cuda_graphs) return body();
    auto found = graphs_.find(key);
    if (found == graphs_.end()) {
        graphs_.emplace(key, nullptr);
        return body();
    }
    if (!found->second) {
        // Thread-local mode: only this worker's calls that may synchronise
        // break the capture, not the other devices' workers.
        NANOQ_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        try {
            body();
        } catch (const std::exception& e) {
            cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
            cudaStreamIsCapturing(stream_, &status);
            cudaGraph_t discarded = nullptr;
            cudaStreamEndCapture(stream_, &discarded);
            if (discarded) cudaGraphDestroy(discarded);
            cudaGetLastError();
            if (status == cudaStreamCaptureStatusInvalidated)
                throw InternalError(std::string(e.what()) + " (inside the CUDA graph capture of \"" + key +
                                    "\": a call that CUDA forbids while capturing; cuda_graphs = false runs "
                                    "without graphs)");
            throw;
        }
        cudaGraph_t graph = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
        if (ended != cudaSuccess)
            throw InternalError(std::string("the CUDA graph capture of \"") + key +
                                "\" failed at cudaStreamEndCapture: " + cudaGetErrorString(ended));
        const cudaError_t made = cudaGraphInstantiate(&found->second, graph, 0);
        cudaGraphDestroy(graph);
        if (made != cudaSuccess) found->second = nullptr;
        NANOQ_CUDA_CHECK(made);
    }
    NANOQ_CUDA_CHECK(cudaGraphLaunch(found->second, stream_));
}

void CudaBackend::release_captured() {
    // A graph still running is freed when it completes (cudaGraphExecDestroy).
    for (const auto& graph : graphs_)
        if (graph.second) cudaGraphExecDestroy(graph.second);
    graphs_.clear();
}

void CudaBackend::copy_from_staging(const Tensor& dst, const void* src) {
    const OpScope op(*this);
    // The source is pinned: the copy is asynchronous, and the trainer keeps
    // it unchanged until wait_batch_read().
    NANOQ_CUDA_CHECK(cudaMemcpyAsync(dst.data, src, dst.bytes(), cudaMemcpyDefault, stream_));
}

void CudaBackend::mark_batch_read() { NANOQ_CUDA_CHECK(cudaEventRecord(batch_read_, stream_)); }

void CudaBackend::wait_batch_read() { host_wait(batch_read_); }

void CudaBackend::record_batch_ready(const std::uintptr_t* streams, int count) {
    const OpScope op(*this);
    if (count > 2) throw InternalError("record_batch_ready takes the inputs' and the targets' streams");
    // The caller's thread: its current device decides which device's default
    // stream 1 and 2 name, so it is this device's for the records, then the
    // caller's again.
    int callers = 0;
    NANOQ_CUDA_CHECK(cudaGetDevice(&callers));
    NANOQ_CUDA_CHECK(cudaSetDevice(device_));
    batch_ready_count_ = 0;
    cudaError_t status = cudaSuccess;
    for (int i = 0; i < count && status == cudaSuccess; ++i) {
        if (!streams[i] || (i > 0 && streams[i] == streams[0])) continue;
        status = cudaEventRecord(batch_ready_[batch_ready_count_], interface_stream(streams[i]));
        if (status == cudaSuccess) ++batch_ready_count_;
    }
    cudaSetDevice(callers);
    NANOQ_CUDA_CHECK(status);
}

void CudaBackend::wait_batch_ready(Backend& source) {
    const OpScope op(*this);
    const auto& from = dynamic_cast<const CudaBackend&>(source);
    for (int i = 0; i < from.batch_ready_count_; ++i)
        NANOQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, from.batch_ready_[i], 0));
}

bool CudaBackend::memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
    NANOQ_CUDA_CHECK(cudaSetDevice(device_));
    NANOQ_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return true;
}

// fp8 matmuls (matmul_dtype fp8): the projections (q/k/v, o, gate/up,
// down) and their backward. Every operand is quantized with its own current
// per-tensor scale (kernels_fp8.cu): activations and weights to e4m3,
// gradients to e5m2 (they need the range more than the precision), and
// cuBLASLt multiplies them in the "TN" layout its fp8 kernels take, which is
// why the backward quantizes transposed copies:
//   forward  y[M,N]   = x[M,K] W[N,K]^T      x, W as stored         bias in the epilogue
//   dgrad    dx[rows,k] (+)= dy[rows,n] W    dy as stored, W^T [k,n] accumulates into dx
//   wgrad    dW[n,k]  += dy^T x              dy^T [n,rows], x^T [k,rows]  beta 1 into the bf16 or
//                                                                    float32 gradient
// The bias gradient (column sums of dy) stays in bf16. Not in fp8: the
// classifier, the adapters' products (LoRA calls matmul, which stays bf16
// except for a fresh unscaled x W^T), attention, and any product with a
// dimension that is not a multiple of 16. Master weights and optimizer are
// untouched. The weights' e4m3 copies come from the fp8 weight cache where
// there is one (fp8_weight_cache_bytes), else are quantized on every call.
// Within one composite (Fp8Reuse) each tensor is quantized once per form:
// matmul_backward writes dy and dy^T in one pass, gate|up's forward
// quantizes x once for both products, and its backward dgate, dup (both
// forms each) and x^T once.
// Accumulation: the forward products run in cuBLASLt's fp8 fast
// accumulation mode (faster on Hopper; the tensor cores' partial sums are
// not promoted to float32 along K), the gradients' products promote them:
// the gradients are the small, wide-ranging values that lose most to a
// short accumulator (torchao's float8 training defaults to the same split).
// NANOQ_FP8_FAST_ACCUM=0 promotes in the forward too.
// cuBLASLt's fp8 kernels take only 16-byte aligned matrices and bias; the
// codes are, an output or bias that is a view at another offset may not be:
// its product runs in bf16.
namespace {
bool aligned_16(const Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0; }
}  // namespace

bool CudaBackend::fp8_applies(int M, int N, int K) const {
    return options_.matmul_dtype == MatmulPrecision::FP8 && fp8_operands_.data && !in_classifier_ &&
           LtMatmul::fp8_supported(M, N, K);
}

CudaBackend::Fp8Reuse::~Fp8Reuse() {
    if (--backend_.fp8_reuse_depth_ == 0) backend_.fp8_reuse_begun_ = false;
}

void CudaBackend::fp8_begin() {
    // Inside an Fp8Reuse only its first product begins the buffer.
    if (fp8_reuse_depth_ > 0 && fp8_reuse_begun_) return;
    fp8_reuse_begun_ = fp8_reuse_depth_ > 0;
    fp8_used_ = kFp8CodesStart + fp8_site_bytes(fp8_site_known_.size());  // the header and the maxima
    fp8_scales_used_ = 0;
    fp8_reused_.clear();
    NANOQ_CUDA_CHECK(cudaMemsetAsync(fp8_operands_.data, 0, kFp8Align, stream_));  // every maximum starts at 0
}

std::uint8_t* CudaBackend::fp8_take(std::size_t bytes, int rows, int cols) {
    if (fp8_used_ + fp8_aligned(bytes) > fp8_operands_.bytes())
        throw InternalError("an fp8 operand of " + std::to_string(rows) + "x" + std::to_string(cols) +
                            " needs more fp8 operand room than was reserved (" +
                            std::to_string(fp8_operands_.bytes()) + " bytes, " + std::to_string(fp8_used_) +
                            " taken)");
    auto* codes = static_cast<std::uint8_t*>(fp8_operands_.data) + fp8_used_;
    fp8_used_ += fp8_aligned(bytes);
    return codes;
}

float* CudaBackend::fp8_take_scales() {
    if (2 * (fp8_scales_used_ + 1) * sizeof(float) > kFp8Align)
        throw InternalError("more fp8 operands at once than the operand buffer's header holds");
    return static_cast<float*>(fp8_operands_.data) + 2 * fp8_scales_used_++;
}

CudaBackend::Fp8Operand CudaBackend::fp8_operand(const Tensor& x, int rows, int cols, bool transposed,
                                                 Fp8Format format, float* keep_max, float* known_max) {
    if (keep_max && transposed) throw InternalError("fp8_operand keeps the maximum of a plain quantization only");
    const Fp8Key key{x.data, rows, cols, transposed, format};
    for (const auto& [k, operand] : fp8_reused_)
        if (k == key) return operand;
    float* scales = fp8_take_scales();  // maximum, inverse scale
    std::uint8_t* codes = fp8_take(std::size_t(rows) * cols, rows, cols);
    float* produced = known_max ? known_max : fp8_produced_max(x, std::int64_t(rows) * cols);
    float* amax = produced ? produced : &scales[0];
    if (transposed)
        cuda::fp8_quantize_transposed<bf16>(codes, amax, &scales[1], ptr<bf16>(x), rows, cols, format,
                                            produced != nullptr, stream_);
    else
        cuda::fp8_quantize<bf16>(codes, amax, &scales[1], ptr<bf16>(x), std::int64_t(rows) * cols, format,
                                 produced != nullptr, keep_max, stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
    ++fp8_quantizations_;
    if (known_max) ++fp8_forward_maxima_taken_;
    else if (produced) ++fp8_producer_maxima_taken_;
    const Fp8Operand operand{codes, &scales[1]};
    fp8_reused_.push_back({key, operand});
    return operand;
}

void CudaBackend::fp8_both_forms(const Tensor& x, int rows, int cols, Fp8Format format) {
    if (fp8_reuse_depth_ == 0) throw InternalError("fp8_both_forms outside an Fp8Reuse: nothing would take them");
    fp8_begin();
    const Fp8Key plain_key{x.data, rows, cols, false, format}, transposed_key{x.data, rows, cols, true, format};
    for (const auto& entry : fp8_reused_)
        if (entry.first == plain_key || entry.first == transposed_key) return;  // one form is there: take it
    float* scales = fp8_take_scales();
    std::uint8_t* plain = fp8_take(std::size_t(rows) * cols, rows, cols);
    std::uint8_t* transposed = fp8_take(std::size_t(rows) * cols, rows, cols);
    float* produced = fp8_produced_max(x, std::int64_t(rows) * cols);
    cuda::fp8_quantize_both<bf16>(plain, transposed, produced ? produced : &scales[0], &scales[1], ptr<bf16>(x), rows,
                                  cols, format, produced != nullptr, stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
    ++fp8_quantizations_;
    if (produced) ++fp8_producer_maxima_taken_;
    fp8_reused_.push_back({plain_key, {plain, &scales[1]}});
    fp8_reused_.push_back({transposed_key, {transposed, &scales[1]}});
}

// Producer maxima. Current scaling needs each operand's largest magnitude
// before its quantization; where the kernel that wrote the operand has just
// taken it on the way, the quantization uses that and leaves its own pass
// out: SwiGLU's output (the down projection's input) and its gradients
// dgate and dup (gate|up's dy), the largest operands (rows x intermediate);
// the norms' outputs (the q|k|v and gate|up projections' input); and the
// norms' input gradient, the residual stream's gradient (the o and down
// projections' dy); and the packed q|k|v gradient (the q|k|v projection's
// dy), which the pass after attention's backward packs. Not attention's
// output (cuDNN's or the native kernel's: its own pass), nor any x^T of a
// weight gradient (the forward's record is long gone by then: forward
// maxima, below, keep those). The maximum is the
// same number (the largest magnitude of the values as stored), so the codes
// are bitwise those of a quantization that takes it itself
// (NANOQ_FP8_PRODUCER_MAXIMA=0 turns producer maxima off; the tests compare
// the two). A producer records which tensor its maximum is of
// (fp8_produce_max); the record is good for the rest of its op and for the
// next op, never later: every op that queues work opens an OpScope, and the
// outermost scope of a call (next_op) forgets the records older than the
// previous op's. So no other op can have written the tensor in between, as
// a later op might (a transient's memory is another tensor's afterwards).
// A replayed CUDA graph runs ops that open no scope: run_captured forgets
// every record before and after. The maxima live in a ring of slots after
// the operand buffer's header; a record whose slot is taken again goes.
void CudaBackend::next_op() {
    fp8_produced_before_ = std::move(fp8_produced_);
    fp8_produced_.clear();
    fp8_site_ = fp8_site_pending_;
    fp8_site_defines_ = fp8_site_pending_defines_;
    fp8_site_pending_ = -1;
    // A definition forgets the site's maximum until this op keeps it anew.
    if (fp8_site_defines_ && fp8_site_ >= 0 && std::size_t(fp8_site_) < fp8_site_known_.size())
        fp8_site_known_[std::size_t(fp8_site_)] = 0;
}

// Forward maxima. The weight gradients' x^T (the projections' inputs) are
// the values the forward quantized as stored: the model says which value
// an op's projection input holds (projection_input: layer and projection),
// the forward's quantization keeps its maximum in that site's slot (the
// quantize kernel stores a copy), and the backward's transposing
// quantization of the same values takes it instead of a pass of its own:
// the same number, so the same codes (NANOQ_FP8_FORWARD_MAXIMA=0 turns it
// off; the tests compare). A slot counts only once this micro-batch's
// forward op defined it and its quantization ran (fp8_site_known_); a
// definition that does not quantize (a product off fp8) leaves it unknown.
// Within a captured graph the host-side record is what it was at capture:
// the same ops define and take the same sites on every replay.
void CudaBackend::projection_input(int site, bool defines) {
    fp8_site_pending_ = site;
    fp8_site_pending_defines_ = defines;
}

float* CudaBackend::fp8_site_slot(bool defining) const {
    if (!fp8_forward_maxima_ || fp8_site_ < 0 || std::size_t(fp8_site_) >= fp8_site_known_.size() ||
        defining != fp8_site_defines_ || (!defining && !fp8_site_known_[std::size_t(fp8_site_)]))
        return nullptr;
    return reinterpret_cast<float*>(static_cast<char*>(fp8_operands_.data) + kFp8CodesStart) + fp8_site_;
}

float* CudaBackend::fp8_produce_max(const Tensor& out, std::int64_t written) {
    if (!fp8_producer_maxima_ || !fp8_operands_.data || out.dtype != DType::BF16 || written != out.numel() ||
        options_.matmul_dtype != MatmulPrecision::FP8 || in_classifier_)
        return nullptr;
    float* slot = reinterpret_cast<float*>(static_cast<char*>(fp8_operands_.data) + kFp8Align) + fp8_produced_next_;
    fp8_produced_next_ = (fp8_produced_next_ + 1) % kFp8ProducedSlots;
    for (auto* records : {&fp8_produced_, &fp8_produced_before_})
        records->erase(std::remove_if(records->begin(), records->end(),
                                      [&](const ProducedMax& r) { return r.amax == slot; }),
                       records->end());
    NANOQ_CUDA_CHECK(cudaMemsetAsync(slot, 0, sizeof(float), stream_));
    fp8_produced_.push_back({out.data, out.numel(), slot});
    return slot;
}

float* CudaBackend::fp8_produced_max(const Tensor& x, std::int64_t numel) const {
    for (const auto* records : {&fp8_produced_, &fp8_produced_before_})
        for (auto r = records->rbegin(); r != records->rend(); ++r)  // the latest first
            if (r->data == x.data && r->numel == numel) return r->amax;
    return nullptr;
}

CudaBackend::Fp8Operand CudaBackend::fp8_weight(const Tensor& weight, int rows, int cols, bool transposed) {
    const float* inverse_scale = nullptr;
    if (const std::uint8_t* cached = fp8_cached_weight(weight, rows, cols, transposed, &inverse_scale))
        return {cached, inverse_scale};
    return fp8_operand(weight, rows, cols, transposed, Fp8Format::E4M3);
}

void CudaBackend::weights_changed() {
    const OpScope op(*this);
    if (!fp8_weight_cache_.data) return;
    cuda::fp8_advance_generation(static_cast<unsigned*>(fp8_weight_cache_.data), stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
}

const std::uint8_t* CudaBackend::fp8_cached_weight(const Tensor& weight, int rows, int cols, bool transposed,
                                                   const float** inverse_scale) {
    if (!fp8_weight_cache_.data) return nullptr;
    char* base = static_cast<char*>(fp8_weight_cache_.data);
    const auto key = std::make_tuple(static_cast<const void*>(weight.data), rows, cols, transposed);
    auto it = fp8_cache_slots_.find(key);
    if (it == fp8_cache_slots_.end()) {
        const std::size_t bytes = kFp8Align + fp8_aligned(std::size_t(rows) * cols);
        if (fp8_cache_used_ + bytes > fp8_weight_cache_.bytes()) return nullptr;  // not planned for: uncached
        it = fp8_cache_slots_.emplace(key, fp8_cache_used_).first;
        fp8_cache_used_ += bytes;
    }
    char* slot = base + it->second;
    float* header = reinterpret_cast<float*>(slot);  // amax, inverse scale, stamp
    auto* bytes = reinterpret_cast<std::uint8_t*>(slot + kFp8Align);
    cuda::fp8_quantize_cached<bf16>(bytes, &header[0], &header[1], reinterpret_cast<unsigned*>(&header[2]),
                                    reinterpret_cast<const unsigned*>(base), ptr<bf16>(weight), rows, cols,
                                    transposed, stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
    *inverse_scale = &header[1];
    return bytes;
}

bool CudaBackend::fp8_projection(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M, int N,
                                 int K, bool trans_a, bool trans_b, bool accumulate, float scale) {
    if (!fp8_applies(M, N, K) || trans_a || !trans_b || accumulate || scale != 1.0f) return false;
    if (a.dtype != DType::BF16 || b.dtype != DType::BF16 || out.dtype != DType::BF16 ||
        (bias.data && bias.dtype != DType::BF16) || !aligned_16(out) || !aligned_16(bias))
        return false;
    fp8_begin();
    float* keep = fp8_site_slot(true);
    const Fp8Operand x8 = fp8_operand(a, M, K, false, Fp8Format::E4M3, keep);
    if (keep) fp8_site_known_[std::size_t(fp8_site_)] = 1;
    const Fp8Operand w8 = fp8_weight(b, N, K, false);
    matmul_->run_fp8(out, x8.codes, CUDA_R_8F_E4M3, w8.codes, CUDA_R_8F_E4M3, x8.inverse_scale, w8.inverse_scale, M,
                     N, K, false, bias, fp8_fast_forward_, matmul_workspace_.data, matmul_workspace_.bytes(), stream_);
    return true;
}

// dx[rows,k] = dy[rows,n] (W^T[k,n])^T: M = rows, N = k, K = n.
bool CudaBackend::fp8_input_grad_runs(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n,
                                      int k) const {
    return fp8_applies(rows, k, n) && dx.dtype == DType::BF16 && dy.dtype == DType::BF16 &&
           weight.dtype == DType::BF16 && aligned_16(dx);
}

// dW[n,k] += (dy^T[n,rows]) (x^T[k,rows])^T: M = n, N = k, K = rows.
bool CudaBackend::fp8_weight_grad_runs(const Tensor& dweight, const Tensor& dy, const Tensor& x, int rows, int n,
                                       int k) const {
    return fp8_applies(n, k, rows) && dy.dtype == DType::BF16 && x.dtype == DType::BF16 &&
           (dweight.dtype == DType::BF16 || dweight.dtype == DType::F32) && aligned_16(dweight);
}

bool CudaBackend::fp8_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                                 bool accumulate) {
    if (!fp8_input_grad_runs(dx, dy, weight, rows, n, k)) return false;
    fp8_begin();
    const Fp8Operand dy8 = fp8_operand(dy, rows, n, false, Fp8Format::E5M2);
    const Fp8Operand wt8 = fp8_weight(weight, n, k, true);
    matmul_->run_fp8(dx, dy8.codes, CUDA_R_8F_E5M2, wt8.codes, CUDA_R_8F_E4M3, dy8.inverse_scale, wt8.inverse_scale,
                     rows, k, n, accumulate, Tensor(), false, matmul_workspace_.data, matmul_workspace_.bytes(),
                     stream_);
    return true;
}

bool CudaBackend::fp8_weight_grad(const Tensor& dweight, const Tensor& dy, const Tensor& x, int rows, int n, int k) {
    if (!fp8_weight_grad_runs(dweight, dy, x, rows, n, k)) return false;
    fp8_begin();
    const Fp8Operand dyt8 = fp8_operand(dy, rows, n, true, Fp8Format::E5M2);
    const Fp8Operand xt8 = fp8_operand(x, rows, k, true, Fp8Format::E4M3, nullptr, fp8_site_slot(false));
    matmul_->run_fp8(dweight, dyt8.codes, CUDA_R_8F_E5M2, xt8.codes, CUDA_R_8F_E4M3, dyt8.inverse_scale,
                     xt8.inverse_scale, n, k, rows, true, Tensor(), false, matmul_workspace_.data,
                     matmul_workspace_.bytes(), stream_);
    return true;
}

void CudaBackend::matmul_input_grad(const Tensor& dx, const Tensor& dy, const Tensor& weight, int rows, int n, int k,
                                    bool accumulate) {
    const OpScope op(*this);
    if (fp8_input_grad(dx, dy, weight, rows, n, k, accumulate)) return;
    Backend::matmul_input_grad(dx, dy, weight, rows, n, k, accumulate);
}

void CudaBackend::matmul_weight_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                     int rows, int n, int k) {
    const OpScope op(*this);
    if (!fp8_weight_grad(dweight, dy, x, rows, n, k))
        return Backend::matmul_weight_grad(dweight, dbias, dy, x, rows, n, k);
    if (dbias.data) bias_backward(dbias, dy, rows, n);  // the bias gradient stays in bf16
}

void CudaBackend::matmul_backward(const Tensor& dx, bool accumulate, const Tensor& dweight, const Tensor& dbias,
                                  const Tensor& dy, const Tensor& weight, const Tensor& x, int rows, int n, int k) {
    const OpScope op(*this);
    Fp8Reuse reuse(*this);
    if (dweight.data && fp8_input_grad_runs(dx, dy, weight, rows, n, k) &&
        fp8_weight_grad_runs(dweight, dy, x, rows, n, k))
        fp8_both_forms(dy, rows, n, Fp8Format::E5M2);  // dgrad's dy and wgrad's dy^T
    Backend::matmul_backward(dx, accumulate, dweight, dbias, dy, weight, x, rows, n, k);
}

void CudaBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                         bool trans_b, bool accumulate) {
    const OpScope op(*this);
    if (fp8_projection(out, a, b, Tensor(), M, N, K, trans_a, trans_b, accumulate, 1.0f)) return;
    matmul_->run(out, a, b, M, N, K, trans_a, trans_b, accumulate, matmul_workspace_.data, matmul_workspace_.bytes(),
                 stream_);
}

void CudaBackend::matmul_epilogue(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, int M,
                                  int N, int K, bool trans_a, bool trans_b, bool accumulate, float scale) {
    const OpScope op(*this);
    // The scale is cuBLASLt's alpha and the bias its epilogue: one pass over
    // out. What the epilogue cannot take runs the default body (which
    // rejects a scale on an accumulating product).
    if ((accumulate && scale != 1.0f) || (bias.data && !LtMatmul::bias_supported(out, bias)))
        return Backend::matmul_epilogue(out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, scale);
    if (fp8_projection(out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, scale)) return;
    matmul_->run(out, a, b, M, N, K, trans_a, trans_b, accumulate, matmul_workspace_.data, matmul_workspace_.bytes(),
                 stream_, bias, scale);
}

void CudaBackend::classifier(const Tensor& hidden, const Tensor& lm_head, const Tensor& targets, const Tensor& stats,
                             const Tensor& dhidden, const Tensor& dlm_head, const Tensor& workspace, int rows,
                             int channels, int vocab, int time, float z_loss) {
    const OpScope op(*this);
    struct Scope {
        bool& flag;
        explicit Scope(bool& f) : flag(f) { flag = true; }
        ~Scope() { flag = false; }
    } scope(in_classifier_);
    Backend::classifier(hidden, lm_head, targets, stats, dhidden, dlm_head, workspace, rows, channels, vocab, time,
                        z_loss);
}

void CudaBackend::add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) {
    const OpScope op(*this);
    require_same_dtype(out, bias, "add_bias");
    with_dtype(out.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::add_bias<T>(ptr<T>(out), ptr<T>(bias), rows, cols, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) {
    const OpScope op(*this);
    with_dtype(dout.dtype, [&](auto tag) {
        using T = decltype(tag);
        float* work = static_cast<float*>(scratch(sizeof(float) * bias_backward_scratch_floats(rows, cols)));
        cuda::bias_backward<T>(dbias.f32(), ptr<T>(dout), rows, cols, work, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {
    const OpScope op(*this);
    require_same_dtype(a, b, "add");
    with_dtype(out.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::add<T>(ptr<T>(out), ptr<T>(a), ptr<T>(b), out.numel(), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::accumulate(const Tensor& out, const Tensor& a) {
    const OpScope op(*this);
    require_same_dtype(out, a, "accumulate");
    with_dtype(out.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::accumulate<T>(ptr<T>(out), ptr<T>(a), out.numel(), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::scale_dropout(const Tensor& out, const Tensor& in, float scale, float drop, std::uint64_t seed,
                                const Tensor& seed_base) {
    const OpScope op(*this);
    require_same_dtype(out, in, "scale_dropout");
    const std::uint64_t* base = seed_base.data ? seed_base_value(seed_base) : nullptr;
    with_dtype(out.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::scale_dropout<T>(ptr<T>(out), ptr<T>(in), scale, drop, seed, base, out.numel(), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int rows,
                                    int channels) {
    const OpScope op(*this);
    with_dtype(table.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::embedding_forward<T>(ptr<T>(out), tokens.i32(), ptr<T>(table), rows, channels, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::embedding_backward(const Tensor& table_grad, const Tensor& dout, const Tensor& tokens, int rows,
                                     int channels) {
    const OpScope op(*this);
    const int vocab = static_cast<int>(table_grad.numel() / channels);
    with_dtype(dout.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::embedding_backward<T>(table_grad.f32(), ptr<T>(dout), tokens.i32(), rows, channels, vocab,
                                    scratch(embedding_backward_scratch_bytes(rows, vocab)), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight,
                                  int rows, int channels, float eps) {
    const OpScope op(*this);
    require_same_dtype(inp, weight, "rmsnorm_forward");
    with_dtype(inp.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::rmsnorm_forward<T>(ptr<T>(out), rstd.f32(), ptr<T>(inp), ptr<T>(weight), rows, channels, eps,
                                 fp8_produce_max(out, std::int64_t(rows) * channels), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                   const Tensor& weight, const Tensor& rstd, int rows, int channels,
                                   bool accumulate) {
    const OpScope op(*this);
    require_same_dtype(inp, weight, "rmsnorm_backward");
    with_dtype(inp.dtype, [&](auto tag) {
        using T = decltype(tag);
        void* work = scratch(rmsnorm_backward_scratch_bytes(rows, channels));
        cuda::rmsnorm_backward<T>(ptr<T>(dinp), dweight.f32(), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight),
                                  rstd.f32(), rows, channels, accumulate,
                                  fp8_produce_max(dinp, std::int64_t(rows) * channels), work, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads,
                               int head_dim) {
    const OpScope op(*this);
    with_dtype(x.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::rope_forward<T>(ptr<T>(x), cos_sin.f32(), batch, time, heads, head_dim, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                                int head_dim) {
    const OpScope op(*this);
    with_dtype(dx.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::rope_backward<T>(ptr<T>(dx), cos_sin.f32(), batch, time, heads, head_dim, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

AttentionInfo CudaBackend::attention_info() const {
    AttentionInfo info;
    if (attention_fused_) info.implementation = fused_attention_->engine().library();
    if (attention_fused_ && attention_mask_.data) info.documents = info.implementation;
    // Those this backend's shape runs (the device's engine may hold others'):
    // forward and (but for an inference trainer) backward, and again with the
    // documents' mask.
    if (attention_fused_) info.plans = (fused_documents_ ? 2 : 1) * (fused_backward_ ? 2 : 1);
    info.document_masks = document_masks_;
    info.deterministic = !attention_fused_ || attention_deterministic_;
    return info;
}

// The fused library's plans are causal or bidirectional attention (the
// shape's causal flag is part of each plan). An attention over packed
// documents runs there with their mask as the plans' bias where the run
// reserved it (TrainOptions::packed_documents, and the library built those
// plans). The mask (one pass of B*T*T bf16) is written from a batch's
// positions once, when the trainer loads them (positions_changed, outside
// any captured work, so a replay's calls read the mask of the positions just
// loaded): the forward and backward calls of every layer then share it. A
// call with positions that were not announced (the op harness, any other
// caller) writes it first itself. Without the mask packed rows run the
// native kernels, also with attention="cudnn": never the fused causal mask
// in their place.
bool CudaBackend::documents_fused(const AttentionShape& s) const {
    return attention_fused_ && attention_mask_.data && attention_mask_.numel() >= attention_bias_elements(s);
}

void CudaBackend::write_document_mask(const Tensor& positions, const AttentionShape& s) {
    cuda::document_mask_bias(static_cast<bf16*>(attention_mask_.data), positions.i32(), s.batch, s.time, stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
    ++document_masks_;
}

void CudaBackend::positions_changed(const Tensor& positions, const AttentionShape& s) {
    mask_positions_ = nullptr;
    if (!positions.data || !documents_fused(s)) return;
    const OpScope op(*this);
    write_document_mask(positions, s);
    mask_positions_ = positions.data;
    mask_batch_ = s.batch;
    mask_time_ = s.time;
}

bool CudaBackend::fused_attention_runs(const Tensor& positions, const AttentionShape& s, DType dtype) {
    if (!attention_fused_) return false;
    const bool documents = positions.data && documents_fused(s);
    // Only the shapes reserve_scratch prepared: another one (generation's
    // prompt pass, a new length each time) runs the native kernels rather
    // than build, compile and keep plans anew.
    const AttentionShape& p = fused_shape_;
    if (s.batch != p.batch || s.time != p.time || s.heads != p.heads || s.kv_heads != p.kv_heads ||
        s.head_dim != p.head_dim || s.causal != p.causal || dtype != fused_dtype_ || (documents && !fused_documents_))
        return false;
    if (!positions.data) return true;
    if (!documents) {
        if (!said_documents_native_ && !attention_mask_.data)
            std::fprintf(stderr, "nanoq: device %d: positions (packed documents) run in nanoq's own attention "
                                 "kernels: TrainOptions.packed_documents reserves their mask so that %s runs "
                                 "them\n", device_, fused_attention_->engine().library().c_str());
        said_documents_native_ = true;
        return false;
    }
    if (positions.data != mask_positions_ || s.batch != mask_batch_ || s.time != mask_time_) {
        write_document_mask(positions, s);
        mask_positions_ = nullptr;  // it no longer holds the announced positions
    }
    return true;
}

void CudaBackend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& positions, const AttentionShape& s) {
    const OpScope op(*this);
    if (fused_attention_runs(positions, s, q.dtype)) {
        const AttentionTensors tensors{out, lse, q, k, v, {}, {}, {}, {}, positions.data ? attention_mask_ : Tensor(),
                                       attention_deterministic_};
        fused_attention_->forward(tensors, s, attention_workspace_, stream_);
        return;
    }
    with_dtype(q.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::attention_forward<T>(ptr<T>(out), lse.f32(), ptr<T>(q), ptr<T>(k), ptr<T>(v), s.batch, s.time, s.heads,
                                   s.kv_heads, s.head_dim, s.causal,
                                   positions.data ? positions.i32() : nullptr, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

// The last row of a causal attention over the cached positions, with the
// query in the workspace's last row and zeros in the rows of its tile above
// it (rows are independent): the kernel computes the last query tile only
// (its other rows are dropped), so a token costs one pass over the cached
// keys. Always the native kernel: a fused library would plan anew for every
// length.
void CudaBackend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionShape& s, const Tensor& workspace, const Tensor& lse_workspace) {
    const OpScope op(*this);
    if (s.batch != 1) throw InternalError("attention_decode attends for one sequence (batch 1)");
    const std::int64_t time = s.time, width = std::int64_t(s.heads) * s.head_dim;
    if (workspace.numel() < 2 * time * width || lse_workspace.numel() < s.heads * time)
        throw InternalError("attention_decode's workspace is smaller than 2 * time * heads * head_dim");
    const Tensor queries = workspace.slice(0, time * width), outputs = workspace.slice(time * width, time * width);
    // The rows of the last query tile before the query: the only others the kernel reads.
    const std::int64_t tile_start = (time - 1) / kAttentionQueryTile * kAttentionQueryTile;
    if (time - 1 > tile_start) fill(queries.slice(tile_start * width, (time - 1 - tile_start) * width), 0.0f);
    copy(queries.slice((time - 1) * width, width), q);
    with_dtype(q.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::attention_forward<T>(ptr<T>(outputs), lse_workspace.f32(), ptr<T>(queries), ptr<T>(k), ptr<T>(v), 1,
                                   s.time, s.heads, s.kv_heads, s.head_dim, true, nullptr, stream_,
                                   static_cast<int>(time - 1));
    });
    NANOQ_CUDA_CHECK_LAUNCH();
    copy(out, outputs.slice((time - 1) * width, width));
}

void CudaBackend::attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                     const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& positions, const AttentionShape& s) {
    const OpScope op(*this);
    if (fused_attention_runs(positions, s, q.dtype)) {
        const AttentionTensors tensors{out, lse, q, k, v, dout, dq, dk, dv, positions.data ? attention_mask_ : Tensor(),
                                       attention_deterministic_};
        fused_attention_->backward(tensors, s, attention_workspace_, stream_);
        return;
    }
    with_dtype(q.dtype, [&](auto tag) {
        using T = decltype(tag);
        void* work = scratch(attention_backward_scratch_bytes(s.batch, s.time, s.heads, s.kv_heads, s.head_dim));
        cuda::attention_backward<T>(ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), ptr<T>(dout), ptr<T>(out), lse.f32(),
                                    ptr<T>(q), ptr<T>(k), ptr<T>(v), s.batch, s.time, s.heads, s.kv_heads, s.head_dim,
                                    s.causal, positions.data ? positions.i32() : nullptr, work, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
    const OpScope op(*this);
    with_dtype(gate.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::swiglu_forward<T>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), out.numel(), fp8_produce_max(out, out.numel()),
                                stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                                  const Tensor& up) {
    const OpScope op(*this);
    with_dtype(gate.dtype, [&](auto tag) {
        using T = decltype(tag);
        float* dgate_max = fp8_produce_max(dgate, dout.numel());
        float* dup_max = fp8_produce_max(dup, dout.numel());
        cuda::swiglu_backward<T>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), dout.numel(),
                                 dgate_max, dup_max, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows, int vocab,
                                int first_position, int time, float z_loss, bool with_grad) {
    const OpScope op(*this);
    with_dtype(logits.dtype, [&](auto tag) {
        using T = decltype(tag);
        float* work = static_cast<float*>(scratch(sizeof(float) * classifier_scratch_floats(rows)));
        cuda::cross_entropy<T>(ptr<T>(logits), targets.i32(), stats.f64(), rows, vocab, first_position, time, z_loss,
                               with_grad, work, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::sum_squares(const Tensor& out, const Tensor& x) {
    const OpScope op(*this);
    float* work = static_cast<float*>(scratch(sizeof(float) * sum_squares_scratch_floats(x.numel())));
    cuda::sum_squares(out.f64(), x.f32(), x.numel(), work, stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::optimizer_scale(const Tensor& out, const Tensor& gathered, int ranks, const Tensor& grad_clip) {
    const OpScope op(*this);
    cuda::optimizer_scale(out.f32(), gathered.f64(), ranks, kGatherStride, grad_clip.f64(), stream_);
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                        const Tensor& scale, const AdamWStep& s) {
    const OpScope op(*this);
    require_same_dtype(m, v, "adamw moments");
    with_dtype(param.dtype, [&](auto param_tag) {
        using P = decltype(param_tag);
        with_dtype(m.dtype, [&](auto state_tag) {
            using S = decltype(state_tag);
            cuda::adamw<P, S>(ptr<P>(param), grad.f32(), ptr<S>(m), ptr<S>(v), param.numel(), s.lr, s.beta1, s.beta2,
                              s.eps, s.weight_decay, s.step, scale.f32(), s.seed, stream_);
        });
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::adamw_shard(const AdamWShard& a) {
    const OpScope op(*this);
    require_same_dtype(a.m, a.v, "adamw_shard moments");
    if (a.step_values.numel() != kAdamWStepSlots || a.segments.numel() % kAdamWSegmentSlots != 0 || a.chunk < 1)
        throw InternalError("adamw_shard: malformed step values, segment table or chunk");
    const std::int64_t n = a.master.numel();
    if (a.grad.numel() != n || a.m.numel() != n || a.v.numel() != n || (a.weights.data && a.weights.numel() != n))
        throw InternalError("adamw_shard: master, weights, grad, m and v differ in size");
    const int segment_count = static_cast<int>(a.segments.numel() / kAdamWSegmentSlots);
    const double* segments = segment_count ? a.segments.f64() : nullptr;
    with_dtype(a.master.dtype, [&](auto param_tag) {
        using P = decltype(param_tag);
        with_dtype(a.m.dtype, [&](auto state_tag) {
            using S = decltype(state_tag);
            with_dtype(a.weights.data ? a.weights.dtype : a.master.dtype, [&](auto weight_tag) {
                using W = decltype(weight_tag);
                cuda::adamw_shard<P, S, W>(ptr<P>(a.master), a.weights.data ? ptr<W>(a.weights) : nullptr,
                                           a.grad.f32(), ptr<S>(a.m), ptr<S>(a.v), a.master.numel(),
                                           a.step_values.f64(), segments, segment_count, a.chunk, a.scale.f32(),
                                           stream_);
            });
        });
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

// ---- Fused composites -------------------------------------------------------
// residual_rmsnorm_backward, gate_up_swiglu_forward and
// swiglu_gate_up_backward need no override: their default bodies already
// are one rmsnorm_backward kernel, and the projection matmuls around one
// vectorised SwiGLU kernel.

void CudaBackend::residual_rmsnorm_forward(const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                                           const Tensor& residual, const Tensor& delta, const Tensor& weight,
                                           int rows, int channels, float eps) {
    const OpScope op(*this);
    require_same_dtype(residual, delta, "residual_rmsnorm_forward");
    require_same_dtype(residual, weight, "residual_rmsnorm_forward");
    with_dtype(residual.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::residual_rmsnorm_forward<T>(ptr<T>(residual_out), ptr<T>(out), rstd.f32(), ptr<T>(residual),
                                          ptr<T>(delta), ptr<T>(weight), rows, channels, eps,
                                          fp8_produce_max(out, std::int64_t(rows) * channels), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

namespace {

bool fused_qk_norm_rope(DType dtype, int head_dim) {
    bool supported = false;
    with_dtype(dtype, [&](auto tag) { supported = qk_norm_rope_supported<decltype(tag)>(head_dim); });
    return supported;
}

template <class T>
const T* optional_ptr(const Tensor& t) {
    return t.data ? static_cast<const T*>(t.data) : nullptr;
}

}  // namespace

void CudaBackend::qk_norm_rope_forward(const QkvActivations& a, const QkvWeights& w, const Tensor& cos_sin,
                                       const QkvShape& s) {
    const OpScope op(*this);
    const AttentionShape& t = s.attention;
    if (!fused_qk_norm_rope(a.q.dtype, t.head_dim)) return Backend::qk_norm_rope_forward(a, w, cos_sin, s);
    with_dtype(a.q.dtype, [&](auto tag) {
        using T = decltype(tag);
        const bool norms = w.q_norm.data != nullptr;
        cuda::qk_norm_rope_forward<T>(ptr<T>(a.q), ptr<T>(a.k), norms ? a.q_rstd.f32() : nullptr,
                                      norms ? a.k_rstd.f32() : nullptr, norms ? optional_ptr<T>(a.q_raw) : nullptr,
                                      norms ? optional_ptr<T>(a.k_raw) : nullptr, optional_ptr<T>(w.q_norm),
                                      optional_ptr<T>(w.k_norm), cos_sin.f32(), t.batch, t.time, t.heads,
                                      t.kv_heads, t.head_dim, s.eps, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::qk_norm_rope_backward(const Tensor& dq, const Tensor& dk, const QkvActivations& a,
                                        const QkvWeights& w, const QkvWeights& g, const Tensor& cos_sin,
                                        const QkvShape& s) {
    const OpScope op(*this);
    if (!fused_qk_norm_rope(dq.dtype, s.attention.head_dim))
        return Backend::qk_norm_rope_backward(dq, dk, a, w, g, cos_sin, s);
    norm_rope_backward(Tensor(), dq, dk, Tensor(), a, w, g, cos_sin, s);
}

void CudaBackend::norm_rope_backward(const Tensor& packed, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                     const QkvActivations& a, const QkvWeights& w, const QkvWeights& g,
                                     const Tensor& cos_sin, const QkvShape& s) {
    const AttentionShape& t = s.attention;
    const bool norms = w.q_norm.data != nullptr;
    if (norms && (!g.q_norm.data || !g.k_norm.data))
        throw InternalError("the q/k norm backward needs q/k norm gradient tensors (a sink when frozen)");
    // The packed gradient's maximum for its fp8 quantization, where the pass writes all of it (v too).
    float* packed_max = packed.data && dv.data ? fp8_produce_max(packed, packed.numel()) : nullptr;
    with_dtype(dq.dtype, [&](auto tag) {
        using T = decltype(tag);
        void* work = norms ? scratch(qk_norm_rope_backward_scratch_bytes(t.batch, t.time, t.heads, t.kv_heads,
                                                                         t.head_dim))
                           : nullptr;
        cuda::qkv_pack_backward<T>(packed.data ? ptr<T>(packed) : nullptr, ptr<T>(dq), ptr<T>(dk),
                                   dv.data ? ptr<T>(dv) : nullptr, norms ? g.q_norm.f32() : nullptr,
                                   norms ? g.k_norm.f32() : nullptr, norms ? optional_ptr<T>(a.q_raw) : nullptr,
                                   norms ? optional_ptr<T>(a.k_raw) : nullptr, norms ? a.q_rstd.f32() : nullptr,
                                   norms ? a.k_rstd.f32() : nullptr, optional_ptr<T>(w.q_norm),
                                   optional_ptr<T>(w.k_norm), cos_sin.f32(), t.batch, t.time, t.heads, t.kv_heads,
                                   t.head_dim, work, packed_max, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

// ---- Packed projections -----------------------------------------------------
// q|k|v: one matmul x @ Wqkv^T (bias in the epilogue; fp8 with matmul_dtype
// fp8, through matmul_epilogue) into the qkv-packed scratch [rows, (H + 2
// Hkv) D], then one pass (qkv_unpack_forward) writes q, k, v, with
// qkv_forward also the q/k norms and RoPE. Backward: one pass
// (qkv_pack_backward) writes dq|dk|dv into the same buffer, free again by
// then (the forward's pass consumed it, and every op runs in order on the
// stream, captured or not), then one dgrad and one wgrad matmul over the
// packed width. A call the buffer or the pass cannot take (a head_dim the
// pass does not handle, mixed dtypes, more rows than planned) runs the
// default body.
//
// gate|up: one strided-batched matmul of two products (the gate and the up
// row blocks of the weight, x shared with batch stride 0) writes gate and up
// where they lie, when up follows gate in memory without overlap; the batch
// stride is their distance (product i's output is gate + i * stride, an
// address in the device's one flat address space, also where the two are
// separate allocations). The activation stack pushes gate then up (when
// recomputed) and dgate then dup (always), so those are batched; stored
// activations are separate allocations, batched where they lie in order.
// Otherwise two matmuls. The weight gradient is one batched matmul likewise (dgate,
// dup), accumulating into the two row blocks. dx = dgate Wg + dup Wu stays
// two accumulating matmuls: its sum runs along K across two separate
// matrices, which a strided batch (separate products, no reduction across
// them) cannot express without copying dgate|dup side by side. With
// matmul_dtype fp8 gate|up takes the two (fp8) matmuls of the default, and
// every backward product goes through matmul_input_grad and
// matmul_weight_grad (fp8 where they run so).

namespace {

// up's distance from gate in elements where up follows gate without
// overlapping it (same dtype and size), else -1.
std::int64_t following(const Tensor& first, const Tensor& second) {
    if (first.dtype != second.dtype || first.numel() != second.numel() || !first.data || !second.data) return -1;
    const auto from = reinterpret_cast<std::uintptr_t>(first.data);
    const auto to = reinterpret_cast<std::uintptr_t>(second.data);
    const std::size_t size = dtype_size(first.dtype);
    if (to < from + first.bytes() || (to - from) % size != 0) return -1;
    return static_cast<std::int64_t>((to - from) / size);
}

}  // namespace

Tensor CudaBackend::packed_qkv(const QkvShape& s, std::initializer_list<const Tensor*> activations) const {
    const AttentionShape& t = s.attention;
    const DType dtype = (*activations.begin())->dtype;
    for (const Tensor* a : activations)
        if (a->dtype != dtype) return Tensor();
    const std::int64_t elements = qkv_packed_elements(t);
    if (!qkv_packed_.data || elements * dtype_size(dtype) > qkv_packed_.bytes() ||
        !fused_qk_norm_rope(dtype, t.head_dim))
        return Tensor();
    const std::int64_t rows = std::int64_t(t.batch) * t.time;
    return Tensor(qkv_packed_.data, dtype, {rows, elements / rows});
}

void CudaBackend::qkv_projection(const QkvActivations& a, const Tensor& x, const QkvWeights& w, const QkvShape& s) {
    const OpScope op(*this);
    const bool norms = w.q_norm.data != nullptr;
    const Tensor& q = norms ? a.q_raw : a.q;
    const Tensor& k = norms ? a.k_raw : a.k;
    const Tensor packed = packed_qkv(s, {&q, &k, &a.v});
    if (!packed.data) return Backend::qkv_projection(a, x, w, s);
    const AttentionShape& t = s.attention;
    matmul_epilogue(packed, x, w.qkv, w.qkv_bias, t.batch * t.time, static_cast<int>(packed.shape[1]), s.hidden,
                    false, true, false, 1.0f);
    with_dtype(packed.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::qkv_unpack_forward<T>(ptr<T>(packed), ptr<T>(q), ptr<T>(k), ptr<T>(a.v), nullptr, nullptr, nullptr,
                                    nullptr, nullptr, nullptr, nullptr, t.batch, t.time, t.heads, t.kv_heads,
                                    t.head_dim, s.eps, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::qkv_forward(const QkvActivations& a, const Tensor& x, const QkvWeights& w, const Tensor& cos_sin,
                              const QkvShape& s) {
    const OpScope op(*this);
    const bool norms = w.q_norm.data != nullptr;
    const Tensor packed =
        norms ? packed_qkv(s, {&a.q, &a.k, &a.v, &a.q_raw, &a.k_raw}) : packed_qkv(s, {&a.q, &a.k, &a.v});
    if (!packed.data) return Backend::qkv_forward(a, x, w, cos_sin, s);
    const AttentionShape& t = s.attention;
    matmul_epilogue(packed, x, w.qkv, w.qkv_bias, t.batch * t.time, static_cast<int>(packed.shape[1]), s.hidden,
                    false, true, false, 1.0f);
    with_dtype(packed.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::qkv_unpack_forward<T>(ptr<T>(packed), ptr<T>(a.q), ptr<T>(a.k), ptr<T>(a.v),
                                    norms ? ptr<T>(a.q_raw) : nullptr, norms ? ptr<T>(a.k_raw) : nullptr,
                                    norms ? a.q_rstd.f32() : nullptr, norms ? a.k_rstd.f32() : nullptr,
                                    optional_ptr<T>(w.q_norm), optional_ptr<T>(w.k_norm), cos_sin.f32(), t.batch,
                                    t.time, t.heads, t.kv_heads, t.head_dim, s.eps, stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
}

void CudaBackend::packed_qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& g, const Tensor& dqkv,
                                      const Tensor& x, const QkvWeights& w, const QkvShape& s) {
    const int rows = static_cast<int>(dqkv.shape[0]), width = static_cast<int>(dqkv.shape[1]);
    matmul_backward(dx, accumulate, g.qkv, g.qkv_bias, dqkv, w.qkv, x, rows, width, s.hidden);
}

void CudaBackend::qkv_projection_backward(const Tensor& dx, bool accumulate, const QkvWeights& g, const Tensor& dq,
                                          const Tensor& dk, const Tensor& dv, const Tensor& x, const QkvWeights& w,
                                          const QkvShape& s) {
    const OpScope op(*this);
    const Tensor packed = packed_qkv(s, {&dq, &dk, &dv});
    if (!packed.data) return Backend::qkv_projection_backward(dx, accumulate, g, dq, dk, dv, x, w, s);
    const AttentionShape& t = s.attention;
    with_dtype(packed.dtype, [&](auto tag) {
        using T = decltype(tag);
        cuda::qkv_pack_backward<T>(ptr<T>(packed), ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), nullptr, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, t.batch, t.time, t.heads,
                                   t.kv_heads, t.head_dim, nullptr, fp8_produce_max(packed, packed.numel()), stream_);
    });
    NANOQ_CUDA_CHECK_LAUNCH();
    packed_qkv_backward(dx, accumulate, g, packed, x, w, s);
}

void CudaBackend::qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& g, const Tensor& dq,
                               const Tensor& dk, const Tensor& dv, const QkvActivations& a, const Tensor& x,
                               const QkvWeights& w, const Tensor& cos_sin, const QkvShape& s) {
    const OpScope op(*this);
    const Tensor packed = packed_qkv(s, {&dq, &dk, &dv});
    if (!packed.data) return Backend::qkv_backward(dx, accumulate, g, dq, dk, dv, a, x, w, cos_sin, s);
    norm_rope_backward(packed, dq, dk, dv, a, w, g, cos_sin, s);
    packed_qkv_backward(dx, accumulate, g, packed, x, w, s);
}

void CudaBackend::gate_up_projection(const Tensor& gate, const Tensor& up, const Tensor& x, const Tensor& gate_up,
                                     int rows, int intermediate, int channels) {
    const OpScope op(*this);
    const std::int64_t distance = following(gate, up);
    if (distance < 0 || options_.matmul_dtype == MatmulPrecision::FP8 || x.dtype != gate_up.dtype) {
        Fp8Reuse reuse(*this);  // fp8: x quantized once for both
        return Backend::gate_up_projection(gate, up, x, gate_up, rows, intermediate, channels);
    }
    const LtMatmul::Batch batch{2, 0, std::int64_t(intermediate) * channels, distance};
    matmul_->run_batched(gate, x, gate_up, rows, intermediate, channels, false, true, false, batch,
                         matmul_workspace_.data, matmul_workspace_.bytes(), stream_);
}

void CudaBackend::gate_up_projection_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up,
                                              const Tensor& dgate, const Tensor& dup, const Tensor& x,
                                              const Tensor& gate_up, int rows, int intermediate, int channels) {
    const OpScope op(*this);
    const std::int64_t block = std::int64_t(intermediate) * channels;
    const Tensor weight[2] = {gate_up.slice(0, block), gate_up.slice(block, block)};
    // fp8: dgate and dup quantized once each for dgrad and wgrad, x^T once for both wgrads.
    Fp8Reuse reuse(*this);
    if (dgate_up.data && fp8_input_grad_runs(dx, dgate, weight[0], rows, intermediate, channels) &&
        fp8_weight_grad_runs(dgate_up, dgate, x, rows, intermediate, channels)) {
        fp8_both_forms(dgate, rows, intermediate, Fp8Format::E5M2);
        fp8_both_forms(dup, rows, intermediate, Fp8Format::E5M2);
    }
    matmul_input_grad(dx, dgate, weight[0], rows, intermediate, channels, accumulate);
    matmul_input_grad(dx, dup, weight[1], rows, intermediate, channels, true);
    if (!dgate_up.data) return;  // frozen
    const std::int64_t distance = following(dgate, dup);
    if (distance < 0 || options_.matmul_dtype == MatmulPrecision::FP8 || dgate.dtype != x.dtype) {
        matmul_weight_grad(dgate_up.slice(0, block), Tensor(), dgate, x, rows, intermediate, channels);
        matmul_weight_grad(dgate_up.slice(block, block), Tensor(), dup, x, rows, intermediate, channels);
        return;
    }
    const LtMatmul::Batch batch{2, distance, 0, block};
    matmul_->run_batched(dgate_up, dgate, x, intermediate, channels, rows, true, false, true, batch,
                         matmul_workspace_.data, matmul_workspace_.bytes(), stream_);
}

}  // namespace cuda
}  // namespace nanoq
