// Row-major matmuls through cuBLASLt, with one plan per shape.
//
// cuBLASLt is column-major: a row-major [R, C] matrix is its column-major
// transpose, so C = op(A) @ op(B) is computed as C^T = op(B)^T @ op(A)^T with
// the operands swapped. The descriptors and the algorithm are built on first
// use of a shape/dtype/alignment combination and cached; fp32 runs in true
// fp32 (no TF32), bf16 and fp8 inputs accumulate in fp32.
//
// Bias epilogue: a bias[N] (of out's dtype) is added by cuBLASLt after the
// product, in fp32 before out is rounded, instead of by a second kernel.
//
// Algorithms chosen by measurement: at plan build the heuristic's best few
// algorithms (those that fit the workspace) are each timed with CUDA events
// on the stream (one warm-up, then kTimedRuns runs) and the fastest kept
// (ties to the heuristic's order; one that fails to launch is skipped). It
// runs once per plan, synchronously, in the first step; the environment
// variable NANOQ_MATMUL_AUTOTUNE=0 keeps the heuristic's first choice
// instead. Algorithms differ in how they split and order the sum over K (split-K,
// tile shapes), so the choice can change results in the last bits, within
// the accumulation dtype's rounding; since timings vary, two runs may choose
// differently. Within a process each device's choices are remembered, so a
// second trainer (or a rebuilt backend) reuses them and computes bitwise as
// the first; across processes set NANOQ_MATMUL_AUTOTUNE=0 for bitwise-repeatable runs.
// NANOQ_MATMUL_LOG=1 prints each plan's choice to stderr (the tests read it).
//
// Strided batches: run_batched multiplies `count` products of one shape
// in one launch, product i reading each operand at i times its batch
// stride (a stride of 0 shares the operand among the products; the
// outputs must not overlap). The stride alignments count with the
// pointers' in the plan.
//
// fp8: run_fp8 multiplies fp8 operands (e4m3, or e5m2 for one of the two)
// quantized with per-tensor scales; cuBLASLt dequantizes with the scale
// pointers (device floats, read when the product runs). Its fp8 kernels on
// Ada and Hopper take only the "TN" layout (both operands K-contiguous),
// e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 (never e5m2 x e5m2), and a bf16
// or float32 output, which may be accumulated into (beta 1, C = D). With
// `fast_accumulation` the product runs in cuBLASLt's fp8 fast accumulation
// mode (CUBLASLT_MATMUL_DESC_FAST_ACCUM): the tensor cores' partial sums are
// not promoted to float32 along K every so often, which is faster on Hopper
// and less exact; without it they are. Where cuBLASLt has no fast kernel for
// a product, that product promotes (and says so on stderr).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>

#include "tensor.h"

namespace nanoq {
namespace cuda {

class LtMatmul {
public:
    // `host_wait` waits on the host for an event (the backend's polling wait,
    // which ends with an error where a failed peer would make it hang).
    explicit LtMatmul(std::function<void(cudaEvent_t)> host_wait);
    ~LtMatmul();
    LtMatmul(const LtMatmul&) = delete;
    LtMatmul& operator=(const LtMatmul&) = delete;

    // out[M,N] = alpha * op(a) @ op(b) (+ out with `accumulate`) (+ bias[N]
    // unless `bias` is empty), as Backend::matmul_epilogue; out's dtype may
    // differ from a and b (f32 out of bf16 inputs). bias_supported first.
    void run(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a, bool trans_b,
             bool accumulate, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
             const Tensor& bias = Tensor(), float alpha = 1.0f);
    // Products i = 0 .. count-1 of a strided batch; strides in elements of
    // each operand's dtype, none negative.
    struct Batch {
        int count = 1;
        std::int64_t a_stride = 0, b_stride = 0, out_stride = 0;
    };
    // out + i * out_stride [M,N] = op(a + i * a_stride) @ op(b + i * b_stride)
    // (+ that output with `accumulate`) for each product i of `batch`, in one
    // launch; `out` is product 0's output.
    void run_batched(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                     bool trans_b, bool accumulate, const Batch& batch, void* workspace, std::size_t workspace_bytes,
                     cudaStream_t stream);
    // Whether the bias epilogue takes this bias for this output.
    static bool bias_supported(const Tensor& out, const Tensor& bias) { return bias.dtype == out.dtype; }

    // out[M,N] = (a_scale[0] * a8[M,K]) @ (b_scale[0] * b8[N,K])^T (+ out with
    // `accumulate`) (+ bias[N], bf16 with a bf16 out only, unless empty) for fp8 operands
    // of the given types (CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2, not both e5m2;
    // row-major, K contiguous in both: the "TN" layout fp8 needs); M, N, K
    // multiples of 16 (fp8_supported); out bf16 or float32.
    void run_fp8(const Tensor& out, const void* a8, cudaDataType_t a_type, const void* b8, cudaDataType_t b_type,
                 const float* a_scale, const float* b_scale, int M, int N, int K, bool accumulate, const Tensor& bias,
                 bool fast_accumulation, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
    static bool fp8_supported(int M, int N, int K) { return M % 16 == 0 && N % 16 == 0 && K % 16 == 0; }

private:
    // One call's operands in cuBLASLt's terms (see run).
    struct Product;
    // Shape, transposes, accumulate, dtypes (out, a, b, bias or -1), alignments (out, a, b, bias), fp8 (0: not
    // fp8, 1: fp8, 2: fp8 with fast accumulation), batch count and strides (a, b, out).
    using Key = std::tuple<int, int, int, bool, bool, bool, int, int, int, int, int, int, int, int, int, int,
                           std::int64_t, std::int64_t, std::int64_t>;
    struct Plan {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
        cublasLtMatmulAlgo_t algo{};
    };
    void execute(const Product& product, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
    Plan& plan(const Key& key, const Product& product, void* workspace, std::size_t workspace_bytes,
               cudaStream_t stream);
    // Fills `plan`'s descriptors and algorithm (plan() destroys it if this throws).
    void build(Plan& plan, const Product& product, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
               bool autotune, bool log_plan, const Key& key);
    static void destroy(Plan& plan);
    // The index of the fastest of `count` algorithms for `product`, timed on `stream`.
    int fastest(const Plan& plan, const cublasLtMatmulHeuristicResult_t* results, int count, const Product& product,
                void* workspace, std::size_t workspace_bytes, cudaStream_t stream, std::string* log);

    // The index (in the heuristic's list) each device's plans chose, for the process.
    static int remembered_choice(int device, const Key& key, int choice);

    cublasLtHandle_t handle_ = nullptr;
    std::function<void(cudaEvent_t)> host_wait_;
    std::map<Key, Plan> plans_;
};

}  // namespace cuda
}  // namespace nanoq
