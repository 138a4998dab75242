// The emulator's stand-ins for cuBLASLt and NCCL (see cublasLt.h, nccl.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "cuda_fp8.h"
#include "nccl.h"

// ---- cuBLASLt -------------------------------------------------------------------------
struct nanoq_emu_lt_handle {
    int unused = 0;
};
struct nanoq_emu_lt_desc {
    cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void* bias = nullptr;
    int bias_type = -1;  // -1: D's type
    const float* a_scale = nullptr;  // device pointers; null: 1
    const float* b_scale = nullptr;
    // fp8 fast accumulation: the stand-in computes every product alike (in
    // float64); only the device's products lose precision with it, which
    // the GPU tests' tolerances check. It counts the products of each mode.
    std::int8_t fast_accum = 0;
};
struct nanoq_emu_lt_layout {
    cudaDataType_t type;
    std::uint64_t rows, cols;
    std::int64_t ld;
    std::int32_t batch_count = 1;
    std::int64_t batch_stride = 0;  // elements
};
struct nanoq_emu_lt_preference {
    std::size_t max_workspace = 0;
    std::uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: the library's default assumption
};

namespace {

constexpr std::size_t kEmulatedWorkspace = 1 << 20;
// fp8 products queued so far in this process: [0] promoting, [1] with fast accumulation.
std::atomic<unsigned long long> fp8_products[2];
// The heuristic offers NANOQ_EMU_LT_ALGORITHMS algorithms (default 1, at
// most 8; read at each call): the same reference GEMM, algorithm i of n
// slower by (n - 1 - i) * kAlgorithmDelay, so that the fastest one is known.
// One by default because timing several multiplies the emulator's slowest
// work, the reference GEMM, on the first use of every shape; the tests of
// the choice (test_cublaslt.py) ask for more.
constexpr int kMaxEmulatedAlgorithms = 8;
constexpr auto kAlgorithmDelay = std::chrono::microseconds(500);

int offered_algorithms() {
    const char* text = std::getenv("NANOQ_EMU_LT_ALGORITHMS");
    const int count = text && *text ? std::atoi(text) : 1;
    return std::clamp(count, 1, kMaxEmulatedAlgorithms);
}

bool is_fp8(int type) { return type == CUDA_R_8F_E4M3 || type == CUDA_R_8F_E5M2; }

double load(const void* p, cudaDataType_t type, std::int64_t i) {
    if (type == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    if (is_fp8(type))
        return nanoq_emu::fp8_decode(static_cast<const __nv_fp8_storage_t*>(p)[i],
                                     type == CUDA_R_8F_E4M3 ? __NV_E4M3 : __NV_E5M2);
    return static_cast<const float*>(p)[i];
}

void store(void* p, cudaDataType_t type, std::int64_t i, double value) {
    const float f = static_cast<float>(value);
    if (type == CUDA_R_16BF)
        static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(f);
    else
        static_cast<float*>(p)[i] = f;
}

std::int64_t lt_bytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : type == CUDA_R_16BF ? 2 : 1; }

unsigned alignment_of(const void* p) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    unsigned bytes = 256;
    while (bytes > 1 && address % bytes) bytes /= 2;
    return bytes;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    *handle = new nanoq_emu_lt_handle();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    *desc = new nanoq_emu_lt_desc();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                                              const void* buffer, std::size_t bytes) {
    switch (attribute) {
        case CUBLASLT_MATMUL_DESC_TRANSA:
        case CUBLASLT_MATMUL_DESC_TRANSB: {
            if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto op = *static_cast<const cublasOperation_t*>(buffer);
            if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
            (attribute == CUBLASLT_MATMUL_DESC_TRANSA ? desc->trans_a : desc->trans_b) = op;
            return CUBLAS_STATUS_SUCCESS;
        }
        case CUBLASLT_MATMUL_DESC_EPILOGUE: {
            if (bytes != sizeof(std::uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto epilogue = *static_cast<const std::uint32_t*>(buffer);
            if (epilogue != CUBLASLT_EPILOGUE_DEFAULT && epilogue != CUBLASLT_EPILOGUE_BIAS)
                return CUBLAS_STATUS_NOT_SUPPORTED;  // an epilogue the stand-in does not implement
            desc->epilogue = static_cast<cublasLtEpilogue_t>(epilogue);
            return CUBLAS_STATUS_SUCCESS;
        }
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
        case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: {
            if (bytes != sizeof(void*)) return CUBLAS_STATUS_INVALID_VALUE;
            const void* pointer = *static_cast<const void* const*>(buffer);
            if (attribute == CUBLASLT_MATMUL_DESC_BIAS_POINTER)
                desc->bias = pointer;
            else
                (attribute == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? desc->a_scale : desc->b_scale) =
                    static_cast<const float*>(pointer);
            return CUBLAS_STATUS_SUCCESS;
        }
        case CUBLASLT_MATMUL_DESC_FAST_ACCUM: {
            if (bytes != sizeof(std::int8_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto fast = *static_cast<const std::int8_t*>(buffer);
            if (fast != 0 && fast != 1) return CUBLAS_STATUS_INVALID_VALUE;
            desc->fast_accum = fast;
            return CUBLAS_STATUS_SUCCESS;
        }
        case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: {
            if (bytes != sizeof(std::int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto type = *static_cast<const std::int32_t*>(buffer);
            if (type != -1 && type != CUDA_R_32F && type != CUDA_R_16BF) return CUBLAS_STATUS_INVALID_VALUE;
            desc->bias_type = type;
            return CUBLAS_STATUS_SUCCESS;
        }
    }
    return CUBLAS_STATUS_INVALID_VALUE;  // an attribute the stand-in does not know
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type, std::uint64_t rows,
                                          std::uint64_t cols, std::int64_t ld) {
    if (type != CUDA_R_32F && type != CUDA_R_16BF && !is_fp8(type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (ld < static_cast<std::int64_t>(std::max<std::uint64_t>(rows, 1))) return CUBLAS_STATUS_INVALID_VALUE;
    *layout = new nanoq_emu_lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attribute, const void* buffer,
                                                std::size_t bytes) {
    switch (attribute) {
        case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: {
            if (bytes != sizeof(std::int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto count = *static_cast<const std::int32_t*>(buffer);
            if (count < 1) return CUBLAS_STATUS_INVALID_VALUE;
            layout->batch_count = count;
            return CUBLAS_STATUS_SUCCESS;
        }
        case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: {
            if (bytes != sizeof(std::int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
            const auto stride = *static_cast<const std::int64_t*>(buffer);
            if (stride < 0) return CUBLAS_STATUS_NOT_SUPPORTED;  // see cublasLt.h
            layout->batch_stride = stride;
            return CUBLAS_STATUS_SUCCESS;
        }
    }
    return CUBLAS_STATUS_INVALID_VALUE;  // an attribute the stand-in does not know
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference) {
    *preference = new nanoq_emu_lt_preference();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference) {
    delete preference;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attribute, const void* buffer,
                                                    std::size_t bytes) {
    if (attribute == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (bytes != sizeof(std::uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        p->max_workspace = *static_cast<const std::uint64_t*>(buffer);
        return CUBLAS_STATUS_SUCCESS;
    }
    const int slot = attribute - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
    if (slot < 0 || slot > 3 || bytes != sizeof(std::uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    p->align[slot] = *static_cast<const std::uint32_t*>(buffer);
    return CUBLAS_STATUS_SUCCESS;
}

namespace {

// The bias type an epilogue reads: D's, except fp8 products into float32,
// which take a bf16 bias (as cuBLASLt's table has it).
int bias_type(const nanoq_emu_lt_desc& desc, const nanoq_emu_lt_layout& a, const nanoq_emu_lt_layout& d) {
    if (desc.bias_type != -1) return desc.bias_type;
    return is_fp8(a.type) && d.type == CUDA_R_32F ? CUDA_R_16BF : d.type;
}

// What the real library refuses for this combination (NOT_SUPPORTED), or success.
cublasStatus_t supported(const nanoq_emu_lt_desc& desc, const nanoq_emu_lt_layout& a, const nanoq_emu_lt_layout& b,
                         const nanoq_emu_lt_layout& d, std::uint64_t k) {
    const bool fp8 = is_fp8(a.type) || is_fp8(b.type);
    if (fp8) {
        // Hopper's fp8 kernels: A transposed, B not ("TN"), not both e5m2, a 16-bit or float32
        // output, and every dimension and leading dimension a multiple of 16.
        if (!is_fp8(a.type) || !is_fp8(b.type) || (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2))
            return CUBLAS_STATUS_NOT_SUPPORTED;
        if (desc.trans_a != CUBLAS_OP_T || desc.trans_b != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
        if (d.type != CUDA_R_16BF && d.type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
        for (std::uint64_t extent : {d.rows, d.cols, k, static_cast<std::uint64_t>(a.ld),
                                     static_cast<std::uint64_t>(b.ld), static_cast<std::uint64_t>(d.ld)})
            if (extent % 16) return CUBLAS_STATUS_NOT_SUPPORTED;
    } else if (a.type != b.type || desc.a_scale || desc.b_scale || desc.fast_accum) {
        return CUBLAS_STATUS_NOT_SUPPORTED;  // (the stand-in refuses fast accumulation off fp8 too)
    }
    if (desc.epilogue == CUBLASLT_EPILOGUE_BIAS) {
        const int type = bias_type(desc, a, d);
        if (fp8 ? type != CUDA_R_16BF && type != d.type : type != d.type) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

// A strided batch the library computes as asked: one batch count for all
// four layouts, C laid out as D, and D's products apart (each matrix spans
// ld * (cols - 1) + rows elements).
bool batch_consistent(const nanoq_emu_lt_layout& a, const nanoq_emu_lt_layout& b, const nanoq_emu_lt_layout& c,
                      const nanoq_emu_lt_layout& d) {
    if (a.batch_count != d.batch_count || b.batch_count != d.batch_count || c.batch_count != d.batch_count)
        return false;
    if (c.batch_stride != d.batch_stride || c.ld != d.ld) return false;
    const std::int64_t span = d.ld * static_cast<std::int64_t>(d.cols - 1) + static_cast<std::int64_t>(d.rows);
    return d.batch_count == 1 || d.batch_stride >= span;
}

bool log_calls() {
    const char* text = std::getenv("NANOQ_EMU_LT_LOG");
    return text && text[0] == '1';
}

}  // namespace

const char* cublasLtGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t preference,
                                              int requested, cublasLtMatmulHeuristicResult_t* results, int* returned) {
    *returned = 0;
    if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    const std::uint64_t m = d->rows, n = d->cols;
    const std::uint64_t a_rows = desc->trans_a == CUBLAS_OP_N ? a->rows : a->cols;
    const std::uint64_t k = desc->trans_a == CUBLAS_OP_N ? a->cols : a->rows;
    const std::uint64_t b_rows = desc->trans_b == CUBLAS_OP_N ? b->rows : b->cols;
    const std::uint64_t b_cols = desc->trans_b == CUBLAS_OP_N ? b->cols : b->rows;
    if (a_rows != m || b_rows != k || b_cols != n || c->rows != m || c->cols != n || c->type != d->type)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!batch_consistent(*a, *b, *c, *d)) return CUBLAS_STATUS_INVALID_VALUE;
    if (const cublasStatus_t status = supported(*desc, *a, *b, *d, k); status != CUBLAS_STATUS_SUCCESS) return status;
    // NANOQ_EMU_LT_NO_FAST_ACCUM=1: a library without fp8 fast-accumulation kernels (read at each call).
    const char* no_fast = std::getenv("NANOQ_EMU_LT_NO_FAST_ACCUM");
    if (desc->fast_accum && no_fast && !std::strcmp(no_fast, "1")) return CUBLAS_STATUS_NOT_SUPPORTED;
    for (int i = 0; i < 4; ++i)
        if (preference->align[i] == 0 || (preference->align[i] & (preference->align[i] - 1)))
            return CUBLAS_STATUS_INVALID_VALUE;
    // fp8 kernels need every matrix and the bias 16-byte aligned.
    if (is_fp8(a->type)) {
        for (int i = 0; i < 4; ++i)
            if (preference->align[i] < 16) return CUBLAS_STATUS_NOT_SUPPORTED;
        if (desc->epilogue == CUBLASLT_EPILOGUE_BIAS && alignment_of(desc->bias) < 16)
            return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const int count = std::min(requested, offered_algorithms());
    for (int index = 0; index < count; ++index) {
        cublasLtMatmulHeuristicResult_t r{};
        // The algorithm remembers the alignments it was chosen for (the
        // bias's from the pointer the descriptor holds, as the library does).
        for (int i = 0; i < 4; ++i) r.algo.data[i] = preference->align[i];
        r.workspaceSize = std::min(preference->max_workspace, kEmulatedWorkspace);
        r.algo.data[4] = r.workspaceSize;
        r.algo.data[5] = static_cast<std::uint64_t>(count - 1 - index);  // its delay, in kAlgorithmDelay
        r.algo.data[6] = desc->epilogue == CUBLASLT_EPILOGUE_BIAS ? alignment_of(desc->bias) : 1;
        r.state = CUBLAS_STATUS_SUCCESS;
        r.wavesCount = 1.0f;
        results[index] = r;
    }
    *returned = count;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t desc, const void* alpha_p, const void* a,
                              cublasLtMatrixLayout_t al, const void* b, cublasLtMatrixLayout_t bl, const void* beta_p,
                              const void* c, cublasLtMatrixLayout_t cl, void* d, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, std::size_t workspace_bytes,
                              cudaStream_t stream) {
    if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
    const void* pointers[4] = {a, b, c, d};
    for (int i = 0; i < 4; ++i)
        if (alignment_of(pointers[i]) < algo->data[i]) return CUBLAS_STATUS_INVALID_VALUE;  // misaligned for the algo
    if (workspace_bytes < algo->data[4] || (algo->data[4] && !workspace)) return CUBLAS_STATUS_INVALID_VALUE;
    const bool ta = desc->trans_a == CUBLAS_OP_T, tb = desc->trans_b == CUBLAS_OP_T;
    const std::int64_t m = static_cast<std::int64_t>(dl->rows), n = static_cast<std::int64_t>(dl->cols);
    const std::int64_t k = static_cast<std::int64_t>(ta ? al->rows : al->cols);
    if ((ta ? al->cols : al->rows) != dl->rows || (tb ? bl->cols : bl->rows) != static_cast<std::uint64_t>(k) ||
        (tb ? bl->rows : bl->cols) != dl->cols || cl->rows != dl->rows || cl->cols != dl->cols || cl->type != dl->type)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!batch_consistent(*al, *bl, *cl, *dl)) return CUBLAS_STATUS_INVALID_VALUE;
    if (supported(*desc, *al, *bl, *dl, k) != CUBLAS_STATUS_SUCCESS) return CUBLAS_STATUS_INVALID_VALUE;
    // A batch's later products are as aligned as the algorithm was chosen for (the strides' alignment).
    for (int i = 0; i < 4 && dl->batch_count > 1; ++i) {
        const nanoq_emu_lt_layout* layouts[4] = {al, bl, cl, dl};
        const auto* later = static_cast<const char*>(pointers[i]) +
                            layouts[i]->batch_stride * static_cast<std::int64_t>(lt_bytes(layouts[i]->type));
        if (alignment_of(later) < algo->data[i]) return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (log_calls())
        std::fprintf(stderr, "nanoq emu cublasLtMatmul %lldx%lldx%lld batch %d\n", static_cast<long long>(m),
                     static_cast<long long>(n), static_cast<long long>(k), dl->batch_count);
    const bool with_bias = desc->epilogue == CUBLASLT_EPILOGUE_BIAS;
    if (with_bias && (!desc->bias || alignment_of(desc->bias) < algo->data[6])) return CUBLAS_STATUS_INVALID_VALUE;
    const float alpha = *static_cast<const float*>(alpha_p), beta = *static_cast<const float*>(beta_p);
    const nanoq_emu_lt_layout A = *al, B = *bl, C = *cl, D = *dl;
    const auto bias_kind = static_cast<cudaDataType_t>(bias_type(*desc, A, D));
    const void* bias = with_bias ? desc->bias : nullptr;
    const float *a_scale = desc->a_scale, *b_scale = desc->b_scale;
    if (is_fp8(A.type)) ++fp8_products[desc->fast_accum ? 1 : 0];
    const auto delay = static_cast<int>(algo->data[5]) * kAlgorithmDelay;
    const void *a_base = a, *b_base = b, *c_base = c;
    void* d_base = d;
    nanoq_emu::enqueue(
        stream,
        [=] {
            if (delay.count()) std::this_thread::sleep_for(delay);
            // The scales are read when the product runs, as on the device.
            const double scale = double(alpha) * (a_scale ? *a_scale : 1.0f) * (b_scale ? *b_scale : 1.0f);
            std::vector<double> column(m), a_columns(static_cast<std::size_t>(m * k));
            auto at = [](const void* base, const nanoq_emu_lt_layout& layout, std::int32_t product) {
                return static_cast<const char*>(base) + product * layout.batch_stride * lt_bytes(layout.type);
            };
            for (std::int32_t product = 0; product < D.batch_count; ++product) {
                const void *pa = at(a_base, A, product), *pb = at(b_base, B, product), *pc = at(c_base, C, product);
                void* pd = const_cast<char*>(at(d_base, D, product));
                // op(A) once in doubles, column p at p * m (the products below
                // then read it in order, whatever A's type and layout).
                for (std::int64_t p = 0; p < k; ++p)
                    for (std::int64_t i = 0; i < m; ++i)
                        a_columns[i + p * m] = load(pa, A.type, ta ? p + i * A.ld : i + p * A.ld);
                for (std::int64_t j = 0; j < n; ++j) {
                    std::fill(column.begin(), column.end(), 0.0);
                    for (std::int64_t p = 0; p < k; ++p) {
                        const double bv = load(pb, B.type, tb ? j + p * B.ld : p + j * B.ld);
                        if (bv == 0.0) continue;
                        const double* a_column = &a_columns[p * m];
                        for (std::int64_t i = 0; i < m; ++i) column[i] += a_column[i] * bv;
                    }
                    for (std::int64_t i = 0; i < m; ++i) {
                        double value = scale * column[i];
                        if (beta != 0.0f) value += beta * load(pc, C.type, i + j * C.ld);  // beta 0: C is not read
                        if (bias) value += load(bias, bias_kind, i);  // D's rows: our output's columns
                        store(pd, D.type, i + j * D.ld, value);
                    }
                }
            }
        },
        "cublasLtMatmul");
    return CUBLAS_STATUS_SUCCESS;
}

// ---- NCCL ------------------------------------------------------------------------------------
namespace {

enum class Collective { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce };

const char* collective_name(Collective c) {
    switch (c) {
        case Collective::AllReduce: return "ncclAllReduce";
        case Collective::ReduceScatter: return "ncclReduceScatter";
        case Collective::AllGather: return "ncclAllGather";
        case Collective::Broadcast: return "ncclBroadcast";
        case Collective::Reduce: return "ncclReduce";
    }
    return "?";
}

struct Call {
    Collective what;
    const void* send;
    void* recv;
    std::size_t count;
    ncclDataType_t type;
    int root;
};

struct Clique {
    explicit Clique(int n) : nranks(n), rank_aborted(n, 0), executed(n, 0) {}
    const int nranks;
    std::mutex mutex;
    std::condition_variable changed;
    int joined = 0;
    // The ranks' calls disagreed (an emulator check): every rank is released.
    bool aborted = false;
    // ncclCommAbort of that rank: as with the real library, only that rank's
    // own waits end. A peer waiting for it waits on (on a GPU for ever, here
    // up to the emulator's bound) until it aborts its own communicator too.
    std::vector<char> rank_aborted;
    struct Pending {
        std::vector<Call> calls;
        std::vector<bool> present;
        int arrived = 0, released = 0;
        bool done = false;
    };
    std::map<std::uint64_t, Pending> pending;  // by collective sequence number
    // Per rank, the collectives it has started running: the i-th one of
    // every rank make up collective i. The order of execution matches them,
    // as with the real library, also for collectives replayed from a graph.
    std::vector<std::uint64_t> executed;
};

std::mutex registry_mutex;
std::map<std::uint64_t, std::weak_ptr<Clique>>& registry() {
    static auto* r = new std::map<std::uint64_t, std::weak_ptr<Clique>>();
    return *r;
}

std::uint64_t id_key(const ncclUniqueId& id) {
    std::uint64_t key;
    std::memcpy(&key, id.internal, sizeof(key));
    return key;
}

std::size_t type_bytes(ncclDataType_t type) {
    switch (type) {
        case ncclBfloat16: return 2;
        case ncclFloat64: return 8;
        default: return 4;
    }
}

// Sums in rank order, rounding to the type after every addition as a
// reduction of that type does.
void add_value(std::vector<char>& out, ncclDataType_t type, std::size_t i, const void* in, bool first) {
    switch (type) {
        case ncclBfloat16: {
            auto* o = reinterpret_cast<__nv_bfloat16*>(out.data());
            const float v = __bfloat162float(static_cast<const __nv_bfloat16*>(in)[i]);
            o[i] = __float2bfloat16_rn(first ? v : __bfloat162float(o[i]) + v);
            break;
        }
        case ncclInt32: {
            auto* o = reinterpret_cast<std::int32_t*>(out.data());
            const std::int32_t v = static_cast<const std::int32_t*>(in)[i];
            o[i] = first ? v : o[i] + v;
            break;
        }
        case ncclFloat64: {
            auto* o = reinterpret_cast<double*>(out.data());
            const double v = static_cast<const double*>(in)[i];
            o[i] = first ? v : o[i] + v;
            break;
        }
        default: {
            auto* o = reinterpret_cast<float*>(out.data());
            const float v = static_cast<const float*>(in)[i];
            o[i] = first ? v : o[i] + v;
        }
    }
}

void perform(const std::vector<Call>& calls) {
    const Call& c0 = calls[0];
    const int n = static_cast<int>(calls.size());
    const std::size_t bytes = type_bytes(c0.type);
    switch (c0.what) {
        case Collective::AllReduce:
        case Collective::Reduce: {
            std::vector<char> sum(c0.count * bytes);
            for (int r = 0; r < n; ++r)
                for (std::size_t i = 0; i < c0.count; ++i) add_value(sum, c0.type, i, calls[r].send, r == 0);
            for (int r = 0; r < n; ++r)
                if (c0.what == Collective::AllReduce || r == c0.root) std::memcpy(calls[r].recv, sum.data(), sum.size());
            break;
        }
        case Collective::ReduceScatter: {
            std::vector<std::vector<char>> parts(n, std::vector<char>(c0.count * bytes));
            for (int owner = 0; owner < n; ++owner) {
                std::vector<char>& part = parts[owner];
                for (int r = 0; r < n; ++r) {
                    const char* src = static_cast<const char*>(calls[r].send) + owner * c0.count * bytes;
                    for (std::size_t i = 0; i < c0.count; ++i) add_value(part, c0.type, i, src, r == 0);
                }
            }
            for (int r = 0; r < n; ++r) std::memcpy(calls[r].recv, parts[r].data(), parts[r].size());
            break;
        }
        case Collective::AllGather: {
            std::vector<char> all(n * c0.count * bytes);
            for (int r = 0; r < n; ++r) std::memcpy(all.data() + r * c0.count * bytes, calls[r].send, c0.count * bytes);
            for (int r = 0; r < n; ++r) std::memcpy(calls[r].recv, all.data(), all.size());
            break;
        }
        case Collective::Broadcast: {
            std::vector<char> data(static_cast<const char*>(calls[c0.root].send),
                                   static_cast<const char*>(calls[c0.root].send) + c0.count * bytes);
            for (int r = 0; r < n; ++r) std::memcpy(calls[r].recv, data.data(), data.size());
            break;
        }
    }
}

}  // namespace

struct nanoq_emu_nccl_comm {
    std::shared_ptr<Clique> clique;
    int rank;
    bool blocking;
    // A nonblocking call returned ncclInProgress and ncclCommGetAsyncError has
    // not reported its end yet. The real library may not even have queued
    // the work by then, so relying on it (or calling again) is undefined;
    // the emulator refuses the next call instead.
    bool in_progress = false;
    std::thread::id owner = std::this_thread::get_id();  // the thread that created it
    // CUDA graphs (captured, instantiated, or launches of them in flight)
    // that hold one of its collectives: the real library's finalize waits
    // until none is left, for ever if the caller destroys them only later.
    std::shared_ptr<std::atomic<int>> graph_refs = std::make_shared<std::atomic<int>>(0);
};

namespace {

// NCCL forbids two threads operating one communicator at once (and using it
// after another thread freed it). nanoq keeps each communicator on the
// thread that created it; calls from any other thread are counted here
// (nanoq_emu_nccl_foreign_thread_calls) for tests to check that.
std::atomic<unsigned long long> foreign_thread_calls{0};

// Finalizes, aborts and destroys of a communicator whose collectives CUDA
// graphs still held (nanoq_emu_nccl_teardowns_under_graphs): each would
// hang with the real library.
std::atomic<unsigned long long> teardowns_under_graphs{0};

// A rank whose ncclCommInitRank* never counts as joined
// (nanoq_emu_nccl_withhold_rank): as a process of the run that never
// reaches its initialisation, every rank's initialisation waits for ever.
std::atomic<int> withheld_rank{-1};

// A rank stopped without failing (nanoq_emu_nccl_stall_rank), as a
// process of the run stuck in I/O or a deadlock: its collectives from now
// on never contribute, so its peers' wait for it (up to the clique's 120 s
// bound), and its host stops too, in its next stream or event query
// (nanoq_emu::stall_host), until a peer aborts: it cannot give up itself.
std::atomic<int> stalled_rank{-1};

void note_thread(ncclComm_t comm, const char* what) {
    if (!comm || comm->owner == std::this_thread::get_id()) return;
    if (foreign_thread_calls++ == 0)
        std::fprintf(stderr, "nanoq emulator: %s on rank %d's NCCL communicator from a thread that did not create it\n",
                     what, comm->rank);
}

// Nonblocking communicators used inside the calling thread's ncclGroupStart/End.
thread_local int tl_group_depth = 0;
thread_local std::vector<ncclComm_t> tl_group_nonblocking;

// What a call that was carried out returns: nonblocking communicators
// report ncclInProgress (as the real library may), at ncclGroupEnd when grouped.
ncclResult_t issued(ncclComm_t comm) {
    if (comm->blocking) return ncclSuccess;
    if (tl_group_depth > 0) {
        tl_group_nonblocking.push_back(comm);
        return ncclSuccess;
    }
    comm->in_progress = true;
    return ncclInProgress;
}

ncclResult_t enqueue_collective(ncclComm_t comm, cudaStream_t stream, Call call) {
    nanoq_emu::jitter();
    if (!comm) return ncclInvalidArgument;
    note_thread(comm, collective_name(call.what));
    if (comm->in_progress) return ncclInvalidUsage;
    std::shared_ptr<Clique> clique = comm->clique;
    {
        std::lock_guard<std::mutex> lock(clique->mutex);
        if (clique->aborted) return ncclInvalidUsage;
        if (clique->joined < clique->nranks) return ncclInvalidUsage;  // not initialised yet
    }
    if (call.root < 0 || call.root >= clique->nranks) return ncclInvalidArgument;
    const int rank = comm->rank;
    // Recorded into a graph: the graph holds the communicator until the
    // graph, every executable made from it and their launches are gone.
    std::shared_ptr<void> graph_ref;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) == cudaSuccess && capturing == cudaStreamCaptureStatusActive) {
        std::shared_ptr<std::atomic<int>> refs = comm->graph_refs;
        ++*refs;
        graph_ref = std::shared_ptr<void>(nullptr, [refs](void*) { --*refs; });
    }
    nanoq_emu::enqueue(
        stream,
        [clique, rank, call, graph_ref] {
            (void)graph_ref;
            nanoq_emu::jitter();
            std::unique_lock<std::mutex> lock(clique->mutex);
            const std::uint64_t seq = clique->executed[rank]++;
            const auto aborted_here = [&] {
                return std::string(collective_name(call.what)) + ": communicator aborted";
            };
            if (clique->rank_aborted[rank]) throw nanoq_emu::Error(aborted_here());  // queued before the abort
            if (rank == stalled_rank.load()) {
                clique->changed.wait_for(lock, std::chrono::seconds(120),
                                         [&] { return clique->aborted || clique->rank_aborted[rank]; });
                throw nanoq_emu::Error(std::string(collective_name(call.what)) + ": rank stalled by the test");
            }
            Clique::Pending& p = clique->pending[seq];
            if (p.calls.empty()) {
                p.calls.resize(clique->nranks);
                p.present.assign(clique->nranks, false);
            }
            p.calls[rank] = call;
            p.present[rank] = true;
            // A rank that aborted never contributes (its kernels are gone), so
            // the collective cannot complete for the others.
            const bool peer_aborted = std::find(clique->rank_aborted.begin(), clique->rank_aborted.end(), 1) !=
                                      clique->rank_aborted.end();
            if (++p.arrived == clique->nranks && !peer_aborted) {
                const Call& c0 = p.calls[0];
                for (int r = 1; r < clique->nranks; ++r) {
                    const Call& c = p.calls[r];
                    if (c.what != c0.what || c.count != c0.count || c.type != c0.type || c.root != c0.root) {
                        clique->aborted = true;
                        clique->changed.notify_all();
                        throw nanoq_emu::Error(std::string("NCCL ranks disagree on collective ") +
                                               std::to_string(seq) + ": rank 0 calls " + collective_name(c0.what) +
                                               " of " + std::to_string(c0.count) + ", rank " + std::to_string(r) +
                                               " calls " + collective_name(c.what) + " of " + std::to_string(c.count));
                    }
                }
                perform(p.calls);
                p.done = true;
                clique->changed.notify_all();
            } else if (!clique->changed.wait_for(lock, std::chrono::seconds(120), [&] {
                           return p.done || clique->aborted || clique->rank_aborted[rank];
                       })) {
                throw nanoq_emu::Error(std::string(collective_name(call.what)) +
                                       ": the other ranks did not join within 120 s");
            }
            if (!p.done) throw nanoq_emu::Error(aborted_here());
            if (++p.released == clique->nranks) clique->pending.erase(seq);
        },
        collective_name(call.what));
    return issued(comm);
}

ncclResult_t init_rank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, bool blocking) {
    if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    std::shared_ptr<Clique> clique;
    {
        std::lock_guard<std::mutex> lock(registry_mutex);
        auto& slot = registry()[id_key(id)];
        clique = slot.lock();
        if (!clique) {
            clique = std::make_shared<Clique>(nranks);
            slot = clique;
        }
    }
    if (clique->nranks != nranks) return ncclInvalidUsage;
    int device = 0;
    cudaGetDevice(&device);
    if (nanoq_emu::device_lost(device)) return ncclUnhandledCudaError;  // NCCL's CUDA calls fail there
    *comm = new nanoq_emu_nccl_comm{clique, rank, blocking};
    std::unique_lock<std::mutex> lock(clique->mutex);
    if (rank != withheld_rank.load()) ++clique->joined;
    clique->changed.notify_all();
    if (!blocking) {
        (*comm)->in_progress = true;
        return ncclInProgress;
    }
    // A blocking init waits for every rank, for ever, as the real one does
    // (bounded here so that a test cannot hang the machine).
    if (!clique->changed.wait_for(lock, std::chrono::seconds(300),
                                  [&] { return clique->joined == nranks || clique->aborted; }))
        return ncclSystemError;
    return clique->aborted ? ncclRemoteError : ncclSuccess;
}

}  // namespace

const char* ncclGetLastError(ncclComm_t) { return ""; }

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (emulated NCCL)";
        case ncclSystemError: return "unhandled system error (emulated NCCL: timed out)";
        case ncclInternalError: return "internal error (emulated NCCL)";
        case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
        case ncclInvalidUsage: return "invalid usage (emulated NCCL)";
        case ncclRemoteError:
            return "remote process exited or there was a network error (emulated NCCL: the ranks' calls disagreed)";
        case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static std::mutex mutex;
    static std::mt19937_64 rng(std::random_device{}());
    std::memset(id->internal, 0, sizeof(id->internal));
    std::lock_guard<std::mutex> lock(mutex);
    const std::uint64_t key = rng();
    std::memcpy(id->internal, &key, sizeof(key));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    return init_rank(comm, nranks, id, rank, true);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
    return init_rank(comm, nranks, id, rank, !config || config->blocking != 0);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
    if (!comm) return ncclInvalidArgument;
    note_thread(comm, "ncclCommGetAsyncError");
    std::lock_guard<std::mutex> lock(comm->clique->mutex);
    if (comm->clique->aborted) {
        *async_error = ncclRemoteError;
    } else if (comm->clique->joined < comm->clique->nranks) {
        *async_error = ncclInProgress;  // initialisation waits for every rank
    } else {
        *async_error = ncclSuccess;  // the emulator carries calls out at once
        comm->in_progress = false;
    }
    return ncclSuccess;
}

namespace {

// Whether CUDA graphs still hold `comm`'s collectives once the launches of
// them in flight have ended (for those the real library waits; for a graph
// or executable still alive, for ever): then counted and said, once.
bool held_by_graphs(ncclComm_t comm, const char* call) {
    for (int waited = 0; waited < 5000 && comm->graph_refs->load() > 0; ++waited)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const int graphs = comm->graph_refs->load();
    if (graphs == 0) return false;
    if (teardowns_under_graphs++ == 0)
        std::fprintf(stderr, "nanoq emulator: %s on rank %d while %d captured collective(s) of CUDA graphs still "
                             "hold the communicator (NCCL would wait for ever: destroy the graphs first)\n",
                     call, comm->rank, graphs);
    return true;
}

}  // namespace

// Flushes the communicator's work before ncclCommDestroy; nothing to flush
// here. Refused (the real library would hang) while graphs hold it.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    note_thread(comm, "ncclCommFinalize");
    if (comm->in_progress) return ncclInvalidUsage;
    if (held_by_graphs(comm, "ncclCommFinalize")) return ncclInvalidUsage;
    return issued(comm);
}

// Ends this rank's collectives, queued or waiting, with an error, and frees
// the communicator. Its peers are not released (see Clique::rank_aborted).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    note_thread(comm, "ncclCommAbort");
    {
        std::lock_guard<std::mutex> lock(comm->clique->mutex);
        comm->clique->rank_aborted[comm->rank] = 1;
        comm->clique->changed.notify_all();
    }
    nanoq_emu::release_stalled_host();  // a peer gave up on the stopped rank
    // Its collectives in flight end now (graph launches among them); the
    // real library then waits for every graph that still holds one: for
    // ever where one is still alive. Counted, and carried on.
    held_by_graphs(comm, "ncclCommAbort");
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    note_thread(comm, "ncclCommDestroy");
    if (comm) held_by_graphs(comm, "ncclCommDestroy");
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
    ++tl_group_depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (tl_group_depth == 0) return ncclInvalidUsage;
    if (--tl_group_depth > 0 || tl_group_nonblocking.empty()) return ncclSuccess;
    for (ncclComm_t comm : tl_group_nonblocking) comm->in_progress = true;
    tl_group_nonblocking.clear();
    return ncclInProgress;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t,
                           ncclComm_t comm, cudaStream_t stream) {
    return enqueue_collective(comm, stream, Call{Collective::AllReduce, send, recv, count, type, 0});
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recv_count, ncclDataType_t type, ncclRedOp_t,
                               ncclComm_t comm, cudaStream_t stream) {
    return enqueue_collective(comm, stream, Call{Collective::ReduceScatter, send, recv, recv_count, type, 0});
}
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
    return enqueue_collective(comm, stream, Call{Collective::AllGather, send, recv, send_count, type, 0});
}
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    return enqueue_collective(comm, stream, Call{Collective::Broadcast, send, recv, count, type, root});
}
ncclResult_t ncclReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t, int root,
                        ncclComm_t comm, cudaStream_t stream) {
    return enqueue_collective(comm, stream, Call{Collective::Reduce, send, recv, count, type, root});
}

// How many calls so far used an NCCL communicator from a thread other than
// its creator's (see note_thread). Exported for tests (ctypes).
extern "C" __attribute__((visibility("default"))) unsigned long long nanoq_emu_nccl_foreign_thread_calls() {
    return foreign_thread_calls.load();
}

// Finalizes, aborts and destroys of a communicator whose collectives CUDA
// graphs still held (the real library would have hung in each).
extern "C" __attribute__((visibility("default"))) unsigned long long nanoq_emu_nccl_teardowns_under_graphs() {
    return teardowns_under_graphs.load();
}

// From now on rank `rank`'s initialisations never join their clique (-1:
// every rank joins again). Exported for tests (ctypes).
extern "C" __attribute__((visibility("default"))) void nanoq_emu_nccl_withhold_rank(int rank) {
    withheld_rank = rank;
}

// From now on rank `rank`, whose host drives device `device`, is stopped:
// its collectives and its host's queries (-1: no rank is). Exported for
// tests (ctypes).
extern "C" __attribute__((visibility("default"))) void nanoq_emu_nccl_stall_rank(int rank, int device) {
    stalled_rank = rank;
    if (rank >= 0) nanoq_emu::stall_host(device);
    else nanoq_emu::release_stalled_host();
}

// The fp8 products cublasLtMatmul has queued in this process, with
// (`fast` 1) or without fast accumulation (tests/test_fp8.py).
extern "C" __attribute__((visibility("default"))) unsigned long long nanoq_emu_lt_fp8_products(int fast) {
    return fp8_products[fast ? 1 : 0].load();
}
