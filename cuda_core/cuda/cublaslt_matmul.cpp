#include "cuda/cublaslt_matmul.h"

#include <cstdint>
#include <string>

#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {
namespace {

void check_lt(cublasStatus_t status, const char* what) {
    if (status != CUBLAS_STATUS_SUCCESS)
        throw NanoqError(std::string("cuBLASLt error ") + std::to_string(static_cast<int>(status)) + " in " + what);
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

}  // namespace

LtMatmul::LtMatmul() { check_lt(cublasLtCreate(&handle_), "cublasLtCreate"); }

LtMatmul::~LtMatmul() {
    for (auto& entry : plans_) {
        Plan& p = entry.second;
        cublasLtMatrixLayoutDestroy(p.a);
        cublasLtMatrixLayoutDestroy(p.b);
        cublasLtMatrixLayoutDestroy(p.c);
        cublasLtMatmulDescDestroy(p.desc);
    }
    if (handle_) cublasLtDestroy(handle_);
}

LtMatmul::Plan& LtMatmul::plan(const Key& key, std::size_t workspace_bytes) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    const auto [M, N, K, trans_a, trans_b, accumulate, out_type, a_type, b_type, out_align, a_align, b_align] = key;
    (void)accumulate;
    Plan p;
    check_lt(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    // Column-major view: D[N,M] = op(B') @ op(A'), B' being our b and A' our a.
    const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)),
             "TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)),
             "TRANSB");
    // Our b is stored [K,N] (ld N) or, transposed, [N,K] (ld K): column-major N x K or K x N.
    check_lt(cublasLtMatrixLayoutCreate(&p.a, static_cast<cudaDataType_t>(b_type), trans_b ? K : N, trans_b ? N : K,
                                        trans_b ? K : N),
             "layout b");
    // Our a is stored [M,K] (ld K) or, transposed, [K,M] (ld M).
    check_lt(cublasLtMatrixLayoutCreate(&p.b, static_cast<cudaDataType_t>(a_type), trans_a ? M : K, trans_a ? K : M,
                                        trans_a ? M : K),
             "layout a");
    check_lt(cublasLtMatrixLayoutCreate(&p.c, static_cast<cudaDataType_t>(out_type), N, M, N), "layout out");

    cublasLtMatmulPreference_t preference = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace_bytes, sizeof(workspace_bytes)),
             "workspace preference");
    // cuBLASLt's A is our b and its B our a (operands swapped, see above).
    const std::uint32_t aligns[4] = {static_cast<std::uint32_t>(b_align), static_cast<std::uint32_t>(a_align),
                                     static_cast<std::uint32_t>(out_align), static_cast<std::uint32_t>(out_align)};
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
        check_lt(cublasLtMatmulPreferenceSetAttribute(preference, align_attrs[i], &aligns[i], sizeof(aligns[i])),
                 "alignment preference");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, preference, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(preference);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0)
        throw NanoqError("cuBLASLt has no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                         std::to_string(K) + " matmul of these dtypes");
    p.algo = result.algo;
    return plans_.emplace(key, p).first->second;
}

void LtMatmul::run(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                   bool trans_b, bool accumulate, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    if (a.dtype != b.dtype) throw InternalError("matmul operands of different dtypes");
    const Key key{M,
                  N,
                  K,
                  trans_a,
                  trans_b,
                  accumulate,
                  lt_type(out.dtype),
                  lt_type(a.dtype),
                  lt_type(b.dtype),
                  alignment(out.data),
                  alignment(a.data),
                  alignment(b.data)};
    Plan& p = plan(key, workspace_bytes);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    check_lt(cublasLtMatmul(handle_, p.desc, &alpha, b.data, p.a, a.data, p.b, &beta, out.data, p.c, out.data, p.c,
                            &p.algo, workspace, workspace_bytes, stream),
             "cublasLtMatmul");
}

}  // namespace cuda
}  // namespace nanoq
