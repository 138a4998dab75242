#include "cuda/cublaslt_matmul.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/cuda_check.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

// The heuristic's best few: enough to find the fast one, few enough that
// timing them all stays a small part of the first step.
constexpr int kCandidates = 8;
constexpr int kTimedRuns = 3;

void check_lt(cublasStatus_t status, const char* what) {
    if (status != CUBLAS_STATUS_SUCCESS)
        throw NanoqError(std::string("cuBLASLt error ") + cublasLtGetStatusName(status) + " (" +
                         std::to_string(static_cast<int>(status)) + ") in " + what);
}

cudaDataType_t lt_type(DType dtype) {
    switch (dtype) {
        case DType::F32: return CUDA_R_32F;
        case DType::BF16: return CUDA_R_16BF;
        default: throw InternalError(std::string("matmul on ") + dtype_name(dtype));
    }
}

// The largest power of two up to 256 that divides the address. The heuristic
// assumes 256-byte aligned operands unless told otherwise, and slices of the
// flat weight buffer (or of activations) need not be.
int alignment(const void* pointer) {
    const auto address = reinterpret_cast<std::uintptr_t>(pointer);
    int bytes = 256;
    while (bytes > 1 && address % bytes != 0) bytes /= 2;
    return bytes;
}

std::size_t lt_size(cudaDataType_t type) {
    switch (type) {
        case CUDA_R_32F: return 4;
        case CUDA_R_16BF: return 2;
        default: return 1;  // fp8
    }
}

// The alignment every product of a batch has: the pointer's and its batch
// stride's (in bytes; 0 keeps the pointer's).
int batch_alignment(const void* pointer, std::int64_t stride, cudaDataType_t type) {
    int bytes = alignment(pointer);
    const auto stride_bytes = static_cast<std::uint64_t>(stride) * lt_size(type);
    while (bytes > 1 && stride_bytes % bytes != 0) bytes /= 2;
    return bytes;
}

template <class T>
void set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attribute, const T& value,
                const char* what) {
    check_lt(cublasLtMatrixLayoutSetAttribute(layout, attribute, &value, sizeof(value)), what);
}

// An environment switch: unset is `fallback`, "0" off, "1" on.
bool env_flag(const char* name, bool fallback) {
    const char* value = std::getenv(name);
    if (!value || !*value) return fallback;
    if (!std::strcmp(value, "0")) return false;
    if (!std::strcmp(value, "1")) return true;
    throw InvalidArgument(std::string(name) + " must be 0 or 1, got \"" + value + "\"");
}

struct PreferenceDeleter {
    void operator()(cublasLtMatmulPreference_t preference) const { cublasLtMatmulPreferenceDestroy(preference); }
};

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value, const char* what) {
    check_lt(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), what);
}

}  // namespace

struct LtMatmul::Product {
    void* out;
    const void* a;
    const void* b;
    const void* bias;  // null: none
    cudaDataType_t out_type, a_type, b_type;
    int bias_type;     // -1: none
    int M, N, K;
    bool trans_a, trans_b, accumulate;
    float alpha;
    const float* a_scale;  // fp8: the dequantization factors, else null
    const float* b_scale;
    bool fast_accumulation;  // fp8 only
    std::size_t out_bytes;   // all products' outputs, from out
    Batch batch;
    int align_out() const { return batch_alignment(out, batch.out_stride, out_type); }
    int align_a() const { return batch_alignment(a, batch.a_stride, a_type); }
    int align_b() const { return batch_alignment(b, batch.b_stride, b_type); }
};

LtMatmul::LtMatmul(std::function<void(cudaEvent_t)> host_wait) : host_wait_(std::move(host_wait)) {
    check_lt(cublasLtCreate(&handle_), "cublasLtCreate");
}

void LtMatmul::destroy(Plan& p) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    p = Plan{};
}

LtMatmul::~LtMatmul() {
    for (auto& entry : plans_) destroy(entry.second);
    if (handle_) cublasLtDestroy(handle_);
}

LtMatmul::Plan& LtMatmul::plan(const Key& key, const Product& x, void* workspace, std::size_t workspace_bytes,
                               cudaStream_t stream) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    const bool autotune = env_flag("NANOQ_MATMUL_AUTOTUNE", true), log_plan = env_flag("NANOQ_MATMUL_LOG", false);
    Plan p;
    try {
        build(p, x, workspace, workspace_bytes, stream, autotune, log_plan, key);
    } catch (...) {
        destroy(p);
        throw;
    }
    return plans_.emplace(key, p).first->second;
}

void LtMatmul::build(Plan& p, const Product& x, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                     bool autotune, bool log_plan, const Key& key) {
    const int M = x.M, N = x.N, K = x.K;
    check_lt(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    // Column-major view: D[N,M] = op(B') @ op(A'), B' being our b and A' our a.
    const cublasOperation_t op_first = x.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = x.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first, "TRANSA");
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second, "TRANSB");
    if (x.bias) {
        // The bias runs along D's rows, which are our output's columns; its
        // pointer tells the heuristic the alignment to plan for.
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS, "EPILOGUE");
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, x.bias, "BIAS_POINTER");
    }
    if (x.a_scale) {
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, x.b_scale, "A_SCALE_POINTER");
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x.a_scale, "B_SCALE_POINTER");
        const std::int8_t fast = x.fast_accumulation ? 1 : 0;
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast, "FAST_ACCUM");
    }
    // Our b is stored [K,N] (ld N) or, transposed, [N,K] (ld K): column-major N x K or K x N.
    check_lt(cublasLtMatrixLayoutCreate(&p.a, x.b_type, x.trans_b ? K : N, x.trans_b ? N : K, x.trans_b ? K : N),
             "layout b");
    // Our a is stored [M,K] (ld K) or, transposed, [K,M] (ld M).
    check_lt(cublasLtMatrixLayoutCreate(&p.b, x.a_type, x.trans_a ? M : K, x.trans_a ? K : M, x.trans_a ? M : K),
             "layout a");
    check_lt(cublasLtMatrixLayoutCreate(&p.c, x.out_type, N, M, N), "layout out");
    if (x.batch.count > 1) {
        const std::int32_t count = x.batch.count;
        const std::pair<cublasLtMatrixLayout_t, std::int64_t> layouts[3] = {
            {p.a, x.batch.b_stride}, {p.b, x.batch.a_stride}, {p.c, x.batch.out_stride}};
        for (const auto& [layout, stride] : layouts) {
            set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count, "BATCH_COUNT");
            set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride, "STRIDED_BATCH_OFFSET");
        }
    }

    cublasLtMatmulPreference_t preference = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, PreferenceDeleter> owned(preference);
    const std::uint64_t max_workspace = workspace_bytes;
    check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &max_workspace, sizeof(max_workspace)),
             "workspace preference");
    // cuBLASLt's A is our b and its B our a (operands swapped, see above).
    const std::uint32_t aligns[4] = {static_cast<std::uint32_t>(x.align_b()), static_cast<std::uint32_t>(x.align_a()),
                                     static_cast<std::uint32_t>(x.align_out()),
                                     static_cast<std::uint32_t>(x.align_out())};
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
        check_lt(cublasLtMatmulPreferenceSetAttribute(preference, align_attrs[i], &aligns[i], sizeof(aligns[i])),
                 "alignment preference");
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    // Only those the heuristic vouches for that fit the workspace.
    // What the heuristic said, for the error where none is usable.
    cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS;
    int found = 0, too_large = 0;
    auto usable_algorithms = [&] {
        int usable = 0;
        found = too_large = 0;
        heuristic = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, preference, kCandidates,
                                                   results, &found);
        for (int i = 0; heuristic == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
            if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
            if (results[i].workspaceSize > workspace_bytes) {
                ++too_large;
                continue;
            }
            results[usable++] = results[i];
        }
        return usable;
    };
    int usable = usable_algorithms();
    const std::string shape = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
    bool fast = x.a_scale && x.fast_accumulation;
    if (usable == 0 && fast) {
        // Fast accumulation is a speed hint: where the library has no such
        // kernel for this product, it promotes (said once per plan).
        const std::int8_t off = 0;
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, off, "FAST_ACCUM");
        usable = usable_algorithms();
        fast = false;
        if (usable > 0)
            std::fprintf(stderr, "nanoq: cuBLASLt has no fp8 fast-accumulation algorithm for the %s product; it "
                                 "promotes its partial sums instead\n", shape.c_str());
    }
    if (usable == 0) {
        // Everything that decides it, so that one failed run says why.
        char text[512];
        std::snprintf(text, sizeof(text),
                      "cuBLASLt has no algorithm for a %s matmul (heuristic %s, %d results, %d needing more than "
                      "the %zu-byte workspace; trans_a=%d trans_b=%d accumulate=%d types out/a/b/bias "
                      "%d/%d/%d/%d, alignments out/a/b/bias %d/%d/%d/%d bytes, fp8 fast accumulation %d, batch %d)",
                      shape.c_str(), cublasLtGetStatusName(heuristic), found, too_large, workspace_bytes,
                      int(x.trans_a), int(x.trans_b), int(x.accumulate), x.out_type, x.a_type, x.b_type, x.bias_type,
                      x.align_out(), x.align_a(), x.align_b(), x.bias ? alignment(x.bias) : 0,
                      int(x.a_scale && x.fast_accumulation), x.batch.count);
        throw NanoqError(text);
    }
    std::string log = "untimed";
    int chosen = 0;
    if (usable > 1 && autotune) {
        int device = 0;
        NANOQ_CUDA_CHECK(cudaGetDevice(&device));
        chosen = remembered_choice(device, key, -1);
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        NANOQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        if (chosen >= 0 && chosen < usable) {
            log = "chosen earlier in this process";
        } else if (capture != cudaStreamCaptureStatusNone) {
            // Timing waits on events on the host, which a capture forbids
            // (it would invalidate the graph, and the timed launches would
            // join it): a plan first needed inside a capture keeps the
            // heuristic's first choice, not remembered, so that a later
            // trainer times it. (The trainer runs every captured body once
            // uncaptured first, so its plans exist before a capture.)
            chosen = 0;
            log = "untimed (first needed inside a CUDA graph capture)";
        } else {
            chosen = fastest(p, results, usable, x, workspace, workspace_bytes, stream, &log);
            remembered_choice(device, key, chosen);
        }
    }
    p.algo = results[chosen].algo;
    if (log_plan)
        std::fprintf(stderr, "nanoq matmul plan %s trans_a=%d trans_b=%d accumulate=%d types=%d/%d/%d bias=%d: "
                             "%d algorithms, %s, chose %d, batch %d, fast_accum=%d\n",
                     shape.c_str(), x.trans_a, x.trans_b, x.accumulate, x.out_type, x.a_type, x.b_type, x.bias_type,
                     usable, log.c_str(), chosen, x.batch.count, int(fast));
}

int LtMatmul::remembered_choice(int device, const Key& key, int choice) {
    static std::mutex mutex;
    static std::map<std::pair<int, Key>, int> choices;
    std::lock_guard<std::mutex> lock(mutex);
    if (choice >= 0) choices[{device, key}] = choice;
    const auto it = choices.find({device, key});
    return it == choices.end() ? -1 : it->second;
}

int LtMatmul::fastest(const Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, const Product& x,
                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream, std::string* log) {
    // A fresh product may be timed into its own output (the call that
    // follows overwrites it); one that accumulates into a scratch output, so
    // that out is left as it was. Stream-ordered, so that no device-wide
    // synchronisation (cudaFree's) waits on collectives of other streams.
    // Without room for it, no timing.
    void* out = x.out;
    if (x.accumulate) {
        if (cudaMallocAsync(&out, x.out_bytes, stream) != cudaSuccess) {
            cudaGetLastError();
            *log = "untimed (no memory for a scratch output)";
            return 0;
        }
        NANOQ_CUDA_CHECK(cudaMemsetAsync(out, 0, x.out_bytes, stream));
    }
    cudaEvent_t start = nullptr, stop = nullptr;
    NANOQ_CUDA_CHECK(cudaEventCreate(&start));
    NANOQ_CUDA_CHECK(cudaEventCreate(&stop));
    const float beta = x.accumulate ? 1.0f : 0.0f;
    auto launch = [&](int i) {
        return cublasLtMatmul(handle_, p.desc, &x.alpha, x.b, p.a, x.a, p.b, &beta, out, p.c, out, p.c,
                              &results[i].algo, workspace, workspace_bytes, stream);
    };
    int best = -1;
    float best_ms = std::numeric_limits<float>::infinity();
    std::string times;
    std::exception_ptr failure;
    try {
        for (int i = 0; i < count; ++i) {
            float ms = std::numeric_limits<float>::infinity();
            if (launch(i) == CUBLAS_STATUS_SUCCESS) {  // warm-up; one that fails to launch is skipped
                NANOQ_CUDA_CHECK(cudaEventRecord(start, stream));
                bool ran = true;
                for (int run = 0; run < kTimedRuns && ran; ++run) ran = launch(i) == CUBLAS_STATUS_SUCCESS;
                NANOQ_CUDA_CHECK(cudaEventRecord(stop, stream));
                host_wait_(stop);
                if (ran) NANOQ_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            }
            // A launch that failed may leave its error pending, for the next
            // kernel's launch check to blame on that kernel: it was this one's.
            if (!std::isfinite(ms)) cudaGetLastError();
            char text[32];
            std::snprintf(text, sizeof(text), "%s%.4g", i ? " " : "", ms / kTimedRuns);
            times += text;
            if (ms < best_ms) best = i, best_ms = ms;  // strict: ties keep the heuristic's order
        }
    } catch (...) {
        failure = std::current_exception();
    }
    if (x.accumulate) {
        cudaFreeAsync(out, stream);
        // The device's pool would keep the scratch (its release threshold is
        // 0, but that releases only at a stream, event or device
        // synchronisation, which this backend never makes: it polls), outside
        // the memory plan for the rest of the run, an LM head's gradient
        // (0.9 GB at 1.5B): hand it back once the free has run.
        if (!failure) {
            try {
                NANOQ_CUDA_CHECK(cudaEventRecord(stop, stream));
                host_wait_(stop);
                int device = 0;
                cudaMemPool_t pool = nullptr;
                NANOQ_CUDA_CHECK(cudaGetDevice(&device));
                NANOQ_CUDA_CHECK(cudaDeviceGetMemPool(&pool, device));
                NANOQ_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
            } catch (...) {
                failure = std::current_exception();
            }
        }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (failure) std::rethrow_exception(failure);
    if (best < 0) throw NanoqError("cuBLASLt: none of the heuristic's algorithms ran");
    *log = "timed [" + times + "] ms";
    return best;
}

void LtMatmul::execute(const Product& x, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    const Key key{x.M,
                  x.N,
                  x.K,
                  x.trans_a,
                  x.trans_b,
                  x.accumulate,
                  x.out_type,
                  x.a_type,
                  x.b_type,
                  x.bias_type,
                  x.align_out(),
                  x.align_a(),
                  x.align_b(),
                  x.bias ? alignment(x.bias) : 0,
                  x.a_scale ? (x.fast_accumulation ? 2 : 1) : 0,
                  x.batch.count,
                  x.batch.a_stride,
                  x.batch.b_stride,
                  x.batch.out_stride};
    Plan& p = plan(key, x, workspace, workspace_bytes, stream);
    // Pointers the descriptor holds are this call's.
    if (x.bias) set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, x.bias, "BIAS_POINTER");
    if (x.a_scale) {
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, x.b_scale, "A_SCALE_POINTER");
        set_desc(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x.a_scale, "B_SCALE_POINTER");
    }
    const float beta = x.accumulate ? 1.0f : 0.0f;
    check_lt(cublasLtMatmul(handle_, p.desc, &x.alpha, x.b, p.a, x.a, p.b, &beta, x.out, p.c, x.out, p.c, &p.algo,
                            workspace, workspace_bytes, stream),
             "cublasLtMatmul");
}

void LtMatmul::run(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                   bool trans_b, bool accumulate, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                   const Tensor& bias, float alpha) {
    if (a.dtype != b.dtype) throw InternalError("matmul operands of different dtypes");
    if (bias.data && !bias_supported(out, bias)) throw InternalError("matmul bias of another dtype than its output");
    const Product x{out.data,
                    a.data,
                    b.data,
                    bias.data,
                    lt_type(out.dtype),
                    lt_type(a.dtype),
                    lt_type(b.dtype),
                    bias.data ? static_cast<int>(lt_type(bias.dtype)) : -1,
                    M,
                    N,
                    K,
                    trans_a,
                    trans_b,
                    accumulate,
                    alpha,
                    nullptr,
                    nullptr,
                    false,
                    out.bytes(),
                    Batch{}};
    execute(x, workspace, workspace_bytes, stream);
}

void LtMatmul::run_batched(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                           bool trans_b, bool accumulate, const Batch& batch, void* workspace,
                           std::size_t workspace_bytes, cudaStream_t stream) {
    if (a.dtype != b.dtype) throw InternalError("matmul operands of different dtypes");
    if (batch.count < 1 || batch.a_stride < 0 || batch.b_stride < 0 || batch.out_stride < 0)
        throw InternalError("a batched matmul needs a positive count and strides that are not negative");
    const std::int64_t out_elements = std::int64_t(M) * N;
    if (batch.count > 1 && batch.out_stride < out_elements)
        throw InternalError("the outputs of a batched matmul overlap (stride " + std::to_string(batch.out_stride) +
                            " < " + std::to_string(out_elements) + ")");
    const std::size_t out_bytes = static_cast<std::size_t>((batch.count - 1) * batch.out_stride + out_elements) *
                                  dtype_size(out.dtype);
    const Product x{out.data,
                    a.data,
                    b.data,
                    nullptr,
                    lt_type(out.dtype),
                    lt_type(a.dtype),
                    lt_type(b.dtype),
                    -1,
                    M,
                    N,
                    K,
                    trans_a,
                    trans_b,
                    accumulate,
                    1.0f,
                    nullptr,
                    nullptr,
                    false,
                    out_bytes,
                    batch};
    execute(x, workspace, workspace_bytes, stream);
}

void LtMatmul::run_fp8(const Tensor& out, const void* a8, cudaDataType_t a_type, const void* b8, cudaDataType_t b_type,
                       const float* a_scale, const float* b_scale, int M, int N, int K, bool accumulate,
                       const Tensor& bias, bool fast_accumulation, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
    if (!fp8_supported(M, N, K))
        throw InternalError("an fp8 matmul needs M, N and K multiples of 16, got " + std::to_string(M) + "x" +
                            std::to_string(N) + "x" + std::to_string(K));
    if (bias.data && !bias_supported(out, bias)) throw InternalError("fp8 matmul bias of another dtype than its output");
    // cuBLASLt's bias of an fp8 product with a float32 output is bf16 (the
    // exception to "the bias has the output's type", BIAS_DATA_TYPE in
    // cublasLt.h): nanoq biases only bf16 outputs.
    if (bias.data && out.dtype != DType::BF16) throw InternalError("an fp8 matmul bias needs a bf16 output");
    if (a_type == CUDA_R_8F_E5M2 && b_type == CUDA_R_8F_E5M2)
        throw InternalError("an fp8 matmul of two e5m2 operands (cuBLASLt has no such kernel)");
    const Product x{out.data,
                    a8,
                    b8,
                    bias.data,
                    lt_type(out.dtype),
                    a_type,
                    b_type,
                    bias.data ? static_cast<int>(lt_type(bias.dtype)) : -1,
                    M,
                    N,
                    K,
                    false,
                    true,
                    accumulate,
                    1.0f,
                    a_scale,
                    b_scale,
                    fast_accumulation,
                    out.bytes(),
                    Batch{}};
    execute(x, workspace, workspace_bytes, stream);
}

}  // namespace cuda
}  // namespace nanoq
