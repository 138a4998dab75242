// Entry points for tests that drive the cuda backend's fp8 path below the
// trainer (tests/test_fp8.py, through ctypes): the quantize kernels alone,
// and one projection through CudaBackend configured for fp8. The op harness
// cannot reach them: the fp8 path needs TrainOptions and its own scratch.
// Compiled into the emulated backend only. Each returns 0, or 1 with the
// error in `message`.
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "allocator.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace {

int fail(const std::exception& e, char* message, int message_bytes) {
    if (message_bytes > 0) {
        std::strncpy(message, e.what(), message_bytes - 1);
        message[message_bytes - 1] = '\0';
    }
    return 1;
}

std::vector<__nv_bfloat16> to_bf16(const float* x, std::size_t n) {
    std::vector<__nv_bfloat16> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(x[i]);
    return out;
}

}  // namespace

// out[n] = e4m3 bytes of x[n] (float32, or rounded to bf16 first when
// bf16_input) quantized by nanoq::cuda::fp8_quantize; amax_inverse[0] = the
// maximum, [1] = the inverse scale.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_quantize(const float* x, long n, int bf16_input,
                                                                             unsigned char* out, float* amax_inverse,
                                                                             char* message, int message_bytes) {
    using namespace nanoq::cuda;
    try {
        NANOQ_CUDA_CHECK(cudaSetDevice(0));
        void *input = nullptr, *bytes = nullptr, *floats = nullptr;
        const std::size_t element = bf16_input ? sizeof(__nv_bfloat16) : sizeof(float);
        NANOQ_CUDA_CHECK(cudaMalloc(&input, element * n + 1));
        NANOQ_CUDA_CHECK(cudaMalloc(&bytes, n + 1));
        NANOQ_CUDA_CHECK(cudaMalloc(&floats, 2 * sizeof(float)));
        const std::vector<__nv_bfloat16> rounded = bf16_input ? to_bf16(x, n) : std::vector<__nv_bfloat16>();
        NANOQ_CUDA_CHECK(cudaMemcpy(input, bf16_input ? static_cast<const void*>(rounded.data()) : x, element * n,
                                    cudaMemcpyHostToDevice));
        NANOQ_CUDA_CHECK(cudaMemset(floats, 0, 2 * sizeof(float)));
        float* amax = static_cast<float*>(floats);
        auto* q = static_cast<std::uint8_t*>(bytes);
        if (bf16_input)
            fp8_quantize<bf16>(q, amax, amax + 1, static_cast<const bf16*>(input), n, nullptr);
        else
            fp8_quantize<float>(q, amax, amax + 1, static_cast<const float*>(input), n, nullptr);
        NANOQ_CUDA_CHECK(cudaGetLastError());
        NANOQ_CUDA_CHECK(cudaDeviceSynchronize());
        NANOQ_CUDA_CHECK(cudaMemcpy(out, bytes, n, cudaMemcpyDeviceToHost));
        NANOQ_CUDA_CHECK(cudaMemcpy(amax_inverse, floats, 2 * sizeof(float), cudaMemcpyDeviceToHost));
        cudaFree(input);
        cudaFree(bytes);
        cudaFree(floats);
        return 0;
    } catch (const std::exception& e) {
        return fail(e, message, message_bytes);
    }
}

// out[M,N] = a[M,K] @ b[N,K]^T (+ bias[N] unless null) through
// CudaBackend::matmul_epilogue of a backend configured with matmul_dtype
// fp8, its scratch reserved for these shapes; inputs rounded to bf16, out
// read back from bf16.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_projection(int M, int N, int K, const float* a,
                                                                               const float* b, const float* bias,
                                                                               float* out, char* message,
                                                                               int message_bytes) {
    using namespace nanoq;
    try {
        cuda::CudaBackend backend(0);
        TrainOptions options;
        options.dtype = Precision::BF16;
        options.matmul_dtype = MatmulPrecision::FP8;
        backend.configure(options);
        NamedAllocator allocator(backend, 0);
        // Rows M; the projection's input K and output N wide.
        ScratchShapes shapes{AttentionShape{1, M, 1, 1, 16}, K, N, 16, 1, 0};
        shapes.matmul_dtype = MatmulPrecision::FP8;
        backend.reserve_scratch(allocator, shapes);
        auto upload = [&](const char* name, const float* host, std::int64_t n) {
            const Tensor t = allocator.allocate(Context::Activations, name, DType::BF16, {n});
            const std::vector<__nv_bfloat16> rounded = to_bf16(host, n);
            backend.copy_from_host(t, rounded.data());
            backend.synchronize();  // before `rounded` goes
            return t;
        };
        const Tensor ta = upload("a", a, std::int64_t(M) * K), tb = upload("b", b, std::int64_t(N) * K);
        const Tensor tbias = bias ? upload("bias", bias, N) : Tensor();
        const Tensor tout = allocator.allocate(Context::Activations, "out", DType::BF16, {std::int64_t(M) * N});
        backend.matmul_epilogue(tout, ta, tb, tbias, M, N, K, false, true, false, 1.0f);
        std::vector<__nv_bfloat16> result(std::size_t(M) * N);
        backend.copy_to_host(result.data(), tout);
        backend.synchronize();
        for (std::size_t i = 0; i < result.size(); ++i) out[i] = __bfloat162float(result[i]);
        return 0;
    } catch (const std::exception& e) {
        return fail(e, message, message_bytes);
    }
}
