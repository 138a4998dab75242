// Row-major matmuls through cuBLASLt, with one plan per shape.
//
// cuBLASLt is column-major: a row-major [R, C] matrix is its column-major
// transpose, so C = op(A) @ op(B) is computed as C^T = op(B)^T @ op(A)^T with
// the operands swapped. The descriptors and the heuristic's algorithm are
// built on first use of a shape/dtype combination and cached; fp32 runs in
// true fp32 (no TF32), bf16 inputs accumulate in fp32.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <tuple>

#include "tensor.h"

namespace nanoq {
namespace cuda {

class LtMatmul {
public:
    LtMatmul();
    ~LtMatmul();
    LtMatmul(const LtMatmul&) = delete;
    LtMatmul& operator=(const LtMatmul&) = delete;

    // out[M,N] (+)= op(a) @ op(b) as in Backend::matmul.
    void run(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a, bool trans_b,
             bool accumulate, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

private:
    // Shape, transposes, accumulate, dtypes (out, a, b), pointer alignments (out, a, b).
    using Key = std::tuple<int, int, int, bool, bool, bool, int, int, int, int, int, int>;
    struct Plan {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
        cublasLtMatmulAlgo_t algo{};
    };
    Plan& plan(const Key& key, std::size_t workspace_bytes);

    cublasLtHandle_t handle_ = nullptr;
    std::map<Key, Plan> plans_;
};

}  // namespace cuda
}  // namespace nanoq
