// The cuBLASLt subset nanoq uses, for the CPU emulator: descriptors and
// layouts as in the real library, and a reference GEMM (double accumulation)
// queued on the stream in place of cublasLtMatmul. It checks what the real
// library would reject or silently get wrong: inconsistent shapes and leading
// dimensions, pointers less aligned than the preference promised, and a
// workspace smaller than the heuristic's result asked for. Of the epilogues
// it knows the default and the bias (an unknown one is refused); fp8 (e4m3,
// e5m2) operands need Hopper's "TN" form and dimensions that are multiples of
// 16, and take per-tensor scale pointers. Strided batches: every layout of
// a call has the same batch count, C's and D's layouts are the same, and
// D's products must not overlap; negative batch strides are refused (the
// library documents none; nanoq needs none). NANOQ_EMU_LT_LOG=1 prints
// each cublasLtMatmul call (its m x n x k and batch count, in the library's
// column-major terms) to stderr, so that tests can count the launches. The heuristic can offer several
// algorithms (NANOQ_EMU_LT_ALGORITHMS: the same reference math, each slower
// by a known delay) so that choosing among them by timing runs in tests.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda_runtime.h"

enum cudaDataType_t : int { CUDA_R_32F = 0, CUDA_R_16BF = 14, CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29 };
typedef cudaDataType_t cudaDataType;

enum cublasStatus_t : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t : int { CUBLAS_COMPUTE_32F = 68 };

enum cublasLtMatmulDescAttributes_t : int {
    CUBLASLT_MATMUL_DESC_TRANSA = 3,
    CUBLASLT_MATMUL_DESC_TRANSB = 4,
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
    CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,
    CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,
    CUBLASLT_MATMUL_DESC_FAST_ACCUM = 25,
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,
};
enum cublasLtEpilogue_t : int {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
};
enum cublasLtMatrixLayoutAttribute_t : int {
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
};
enum cublasLtMatmulPreferenceAttributes_t : int {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

typedef struct nanoq_emu_lt_handle* cublasLtHandle_t;
typedef struct nanoq_emu_lt_desc* cublasLtMatmulDesc_t;
typedef struct nanoq_emu_lt_layout* cublasLtMatrixLayout_t;
typedef struct nanoq_emu_lt_preference* cublasLtMatmulPreference_t;

struct cublasLtMatmulAlgo_t {
    std::uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
    cublasLtMatmulAlgo_t algo;
    std::size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
};

// The status's enumerator name ("CUBLAS_STATUS_NOT_SUPPORTED"), as the library's.
const char* cublasLtGetStatusName(cublasStatus_t status);
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                                              const void* buffer, std::size_t bytes);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type, std::uint64_t rows,
                                          std::uint64_t cols, std::int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attribute, const void* buffer,
                                                std::size_t bytes);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t preference,
                                                    cublasLtMatmulPreferenceAttributes_t attribute, const void* buffer,
                                                    std::size_t bytes);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t preference, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                              cublasLtMatrixLayout_t a_layout, const void* b, cublasLtMatrixLayout_t b_layout,
                              const void* beta, const void* c, cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream);
