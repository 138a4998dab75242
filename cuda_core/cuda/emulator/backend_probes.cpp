// Entry points for tests that reach below the trainer and the op harness
// (through ctypes): the fp8 quantize kernels alone, and one projection, its
// backward and gate|up through CudaBackend configured for fp8
// (tests/test_fp8.py; the fp8 path
// needs TrainOptions and its own scratch, which the op harness does not
// give), what the cuBLASLt stand-in refuses and a plan first needed inside
// a graph capture (tests/test_cublaslt.py), and the packed documents'
// announced mask (tests/test_fused_attention.py).
// Compiled into the emulated backend only. The fp8 ones return 0, or 1 with
// the error in `message`.
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allocator.h"
#include "comm.h"
#include "cuda/cuda_backend.h"
#include "cuda/cublaslt_matmul.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "cublasLt.h"

namespace {

int fail(const std::exception& e, char* message, int message_bytes) {
    if (message_bytes > 0) {
        std::strncpy(message, e.what(), message_bytes - 1);
        message[message_bytes - 1] = '\0';
    }
    return 1;
}

// A probe's body: 0 when it returns, else 1 with the exception's message.
template <class Body> int guarded(char* message, int message_bytes, const Body& body) {
    try {
        body();
        return 0;
    } catch (const std::exception& e) {
        return fail(e, message, message_bytes);
    }
}
std::vector<__nv_bfloat16> to_bf16(const float* x, std::size_t n) {
    std::vector<__nv_bfloat16> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(x[i]);
    return out;
}

}  // namespace

// out = the fp8 bytes (e4m3, or e5m2 when `e5m2`) of x[rows, cols] (float32,
// or rounded to bf16 first when bf16_input) quantized by
// nanoq::cuda::fp8_quantize, or by fp8_quantize_transposed when `transposed`
// is 1 (out[cols, rows]), or by fp8_quantize_both when it is 2 (out[2, n]:
// the plain codes, then the transposed); amax_inverse[0] = the maximum, [1]
// = the inverse scale.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_quantize(const float* x, int rows, int cols,
                                                                             int bf16_input, int e5m2, int transposed,
                                                                             int offset, unsigned char* out,
                                                                             float* amax_inverse, char* message,
                                                                             int message_bytes) {
    using namespace nanoq::cuda;
    return guarded(message, message_bytes, [&] {
        NANOQ_CUDA_CHECK(cudaSetDevice(0));
        const std::size_t n = std::size_t(rows) * cols;
        const Fp8Format format = e5m2 ? Fp8Format::E5M2 : Fp8Format::E4M3;
        void *input = nullptr, *bytes = nullptr, *floats = nullptr;
        const std::size_t element = bf16_input ? sizeof(__nv_bfloat16) : sizeof(float);
        // `offset` elements into both buffers: operands off the 16-byte alignment.
        NANOQ_CUDA_CHECK(cudaMalloc(&input, element * (n + offset) + 1));
        const std::size_t forms = transposed == 2 ? 2 : 1;
        NANOQ_CUDA_CHECK(cudaMalloc(&bytes, forms * (n + offset) + 1));
        NANOQ_CUDA_CHECK(cudaMalloc(&floats, 2 * sizeof(float)));
        const std::vector<__nv_bfloat16> rounded = bf16_input ? to_bf16(x, n) : std::vector<__nv_bfloat16>();
        NANOQ_CUDA_CHECK(cudaMemcpy(static_cast<char*>(input) + element * offset,
                                    bf16_input ? static_cast<const void*>(rounded.data()) : x, element * n,
                                    cudaMemcpyHostToDevice));
        NANOQ_CUDA_CHECK(cudaMemset(floats, 0, 2 * sizeof(float)));
        float* amax = static_cast<float*>(floats);
        auto* q = static_cast<std::uint8_t*>(bytes) + offset;
        auto run = [&](auto tag) {
            using T = decltype(tag);
            const T* data = static_cast<const T*>(input) + offset;
            if (transposed == 2)
                fp8_quantize_both<T>(q, q + n + offset, amax, amax + 1, data, rows, cols, format, false, nullptr);
            else if (transposed)
                fp8_quantize_transposed<T>(q, amax, amax + 1, data, rows, cols, format, false, nullptr);
            else
                fp8_quantize<T>(q, amax, amax + 1, data, std::int64_t(n), format, false, nullptr, nullptr);
        };
        if (bf16_input) run(bf16{});
        else run(float{});
        NANOQ_CUDA_CHECK(cudaGetLastError());
        NANOQ_CUDA_CHECK(cudaDeviceSynchronize());
        NANOQ_CUDA_CHECK(cudaMemcpy(out, q, n, cudaMemcpyDeviceToHost));
        if (forms == 2) NANOQ_CUDA_CHECK(cudaMemcpy(out + n, q + n + offset, n, cudaMemcpyDeviceToHost));
        NANOQ_CUDA_CHECK(cudaMemcpy(amax_inverse, floats, 2 * sizeof(float), cudaMemcpyDeviceToHost));
        cudaFree(input);
        cudaFree(bytes);
        cudaFree(floats);
    });
}

namespace {

// Configures `backend` for bf16 with matmul_dtype fp8 and reserves its
// scratch for a projection of `rows` rows, `in` wide in and `out` wide out
// (and the forward maxima's sites of `layers` layers).
// (`attention`, when given, is the shape of the q|k|v projections, whose
// packed scratch follows from it; else one head of 16.)
void configure_fp8(nanoq::cuda::CudaBackend& backend, nanoq::NamedAllocator& allocator, int rows, int in, int out,
                   int layers = 0, const nanoq::AttentionShape* attention = nullptr) {
    using namespace nanoq;
    TrainOptions options;
    options.dtype = Precision::BF16;
    options.matmul_dtype = MatmulPrecision::FP8;
    backend.configure(options);
    ScratchShapes shapes{attention ? *attention : AttentionShape{1, rows, 1, 1, 16}, in, out, 16, 1, 0};
    shapes.matmul_dtype = MatmulPrecision::FP8;
    shapes.layers = layers;
    backend.reserve_scratch(allocator, shapes);
}

// A device tensor of `count` host floats, as bf16 (rounded) or float32,
// copied before it returns.
nanoq::Tensor upload(nanoq::cuda::CudaBackend& backend, nanoq::NamedAllocator& allocator, const char* name,
                     const float* host, std::int64_t count, nanoq::DType dtype = nanoq::DType::BF16) {
    using namespace nanoq;
    const Tensor t = allocator.allocate(Context::Activations, name, dtype, {count});
    const bool bf16 = dtype == DType::BF16;
    const std::vector<__nv_bfloat16> rounded = bf16 ? to_bf16(host, count) : std::vector<__nv_bfloat16>();
    backend.copy_from_host(t, bf16 ? static_cast<const void*>(rounded.data()) : host);
    backend.synchronize();  // before `rounded` goes
    return t;
}

// A bf16 device tensor's values as host floats, copied before it returns.
void download(nanoq::cuda::CudaBackend& backend, const nanoq::Tensor& t, float* host) {
    std::vector<__nv_bfloat16> values(static_cast<std::size_t>(t.numel()));
    backend.copy_to_host(values.data(), t);
    backend.synchronize();
    for (std::size_t i = 0; i < values.size(); ++i) host[i] = __bfloat162float(values[i]);
}

// As upload, `offset` elements into a buffer of its own (an operand off
// the alignment the allocator gives).
nanoq::Tensor upload_at(nanoq::cuda::CudaBackend& backend, nanoq::NamedAllocator& allocator, const char* name,
                        const float* host, std::int64_t count, nanoq::DType dtype, std::int64_t offset) {
    std::vector<float> padded(static_cast<std::size_t>(offset), 0.0f);
    padded.insert(padded.end(), host, host + count);
    return upload(backend, allocator, name, padded.data(), offset + count, dtype).slice(offset, count);
}

}  // namespace

// out[M,N] = a[M,K] @ b[N,K]^T (+ bias[N] unless null) through
// CudaBackend::matmul_epilogue of a backend configured with matmul_dtype
// fp8, its scratch reserved for these shapes; inputs rounded to bf16, out
// read back from bf16. out and bias lie `out_offset` and `bias_offset` bf16
// elements into their device buffers (off cuBLASLt's fp8 alignment unless
// a multiple of 8).
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_projection(int M, int N, int K, const float* a,
                                                                               const float* b, const float* bias,
                                                                               float* out, int out_offset,
                                                                               int bias_offset, char* message,
                                                                               int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, M, K, N);
        const Tensor ta = upload(backend, allocator, "a", a, std::int64_t(M) * K);
        const Tensor tb = upload(backend, allocator, "b", b, std::int64_t(N) * K);
        const Tensor tbias = bias ? upload_at(backend, allocator, "bias", bias, N, DType::BF16, bias_offset) : Tensor();
        const Tensor tout = allocator.allocate(Context::Activations, "out", DType::BF16,
                                               {out_offset + std::int64_t(M) * N})
                                .slice(out_offset, std::int64_t(M) * N);
        backend.matmul_epilogue(tout, ta, tb, tbias, M, N, K, false, true, false, 1.0f);
        std::vector<__nv_bfloat16> result(std::size_t(M) * N);
        backend.copy_to_host(result.data(), tout);
        backend.synchronize();
        for (std::size_t i = 0; i < result.size(); ++i) out[i] = __bfloat162float(result[i]);
    });
}

// The backward of y = x W^T through CudaBackend configured with matmul_dtype
// fp8 (matmul_input_grad, matmul_weight_grad), inputs rounded to bf16:
// dx[rows,k] = dy[rows,n] W[n,k] (+ dx as given when accumulate_dx; dx bf16)
// and dweight[n,k] += dy^T x[rows,k] (dweight float32 when dweight_f32, else
// bf16). dx and dweight are read and written back as float32. With `joint`
// the two run as one matmul_backward, else as the two calls;
// *quantizations = how many passes quantized operands (the backend's
// fp8_quantizations()). dx and dweight lie `offset_bytes` into their device
// buffers (off cuBLASLt's fp8 alignment unless a multiple of 16).
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_backward(int rows, int n, int k, const float* dy,
                                                                             const float* weight, const float* x,
                                                                             float* dx, int accumulate_dx,
                                                                             float* dweight, int dweight_f32,
                                                                             int joint, int offset_bytes,
                                                                             int* quantizations, char* message,
                                                                             int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, rows, k, n);
        const Tensor tdy = upload(backend, allocator, "dy", dy, std::int64_t(rows) * n);
        const Tensor tweight = upload(backend, allocator, "weight", weight, std::int64_t(n) * k);
        const Tensor tx = upload(backend, allocator, "x", x, std::int64_t(rows) * k);
        const DType dweight_dtype = dweight_f32 ? DType::F32 : DType::BF16;
        const Tensor tdx = upload_at(backend, allocator, "dx", dx, std::int64_t(rows) * k, DType::BF16,
                                     offset_bytes / 2);
        const Tensor tdweight = upload_at(backend, allocator, "dweight", dweight, std::int64_t(n) * k, dweight_dtype,
                                          offset_bytes / static_cast<int>(dtype_size(dweight_dtype)));
        backend.synchronize();
        if (joint) {
            backend.matmul_backward(tdx, accumulate_dx != 0, tdweight, Tensor(), tdy, tweight, tx, rows, n, k);
        } else {
            backend.matmul_input_grad(tdx, tdy, tweight, rows, n, k, accumulate_dx != 0);
            backend.matmul_weight_grad(tdweight, Tensor(), tdy, tx, rows, n, k);
        }
        *quantizations = static_cast<int>(backend.fp8_quantizations());
        std::vector<__nv_bfloat16> dx_bf16(std::size_t(rows) * k), dweight_bf16(std::size_t(n) * k);
        backend.copy_to_host(dx_bf16.data(), tdx);
        if (dweight_f32) backend.copy_to_host(dweight, tdweight);
        else backend.copy_to_host(dweight_bf16.data(), tdweight);
        backend.synchronize();
        for (std::size_t i = 0; i < dx_bf16.size(); ++i) dx[i] = __bfloat162float(dx_bf16[i]);
        if (!dweight_f32)
            for (std::size_t i = 0; i < dweight_bf16.size(); ++i) dweight[i] = __bfloat162float(dweight_bf16[i]);
    });
}

// Forward maxima: y[rows, n] = x[rows, k] W^T (W [n, k]), then another op
// (a fill of another tensor), then the projection's backward
// (matmul_backward: dx = dy W, dW (float32, from zeros) += dy^T x) through
// CudaBackend configured with matmul_dtype fp8 and one layer's sites,
// inputs rounded to bf16. `hints` bit 0: the forward is told its x is
// site 1's value (projection_input, defines); bit 1: the backward is told
// its x is (takes). *taken = fp8_forward_maxima_taken(). Outputs as float32.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_forward_maxima(
    int rows, int n, int k, const float* x, const float* weight, const float* dy, int hints, float* y, float* dx,
    float* dweight, int* taken, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, rows, k, n, 1);
        const Tensor tx = upload(backend, allocator, "x", x, std::int64_t(rows) * k);
        const Tensor tw = upload(backend, allocator, "weight", weight, std::int64_t(n) * k);
        const Tensor tdy = upload(backend, allocator, "dy", dy, std::int64_t(rows) * n);
        const Tensor ty = allocator.allocate(Context::Activations, "y", DType::BF16, {std::int64_t(rows) * n});
        const Tensor tdx = allocator.allocate(Context::Activations, "dx", DType::BF16, {std::int64_t(rows) * k});
        const Tensor tdw = allocator.allocate(Context::Activations, "dweight", DType::F32, {std::int64_t(n) * k});
        const Tensor other = allocator.allocate(Context::Activations, "other", DType::BF16, {std::int64_t(rows) * k});
        backend.fill(tdw, 0.0f);
        if (hints & 1) backend.projection_input(1, true);
        backend.matmul_epilogue(ty, tx, tw, Tensor(), rows, n, k, false, true, false, 1.0f);
        backend.fill(other, 1.0f);
        if (hints & 2) backend.projection_input(1, false);
        backend.matmul_backward(tdx, false, tdw, Tensor(), tdy, tw, tx, rows, n, k);
        *taken = static_cast<int>(backend.fp8_forward_maxima_taken());
        download(backend, ty, y);
        download(backend, tdx, dx);
        backend.copy_to_host(dweight, tdw);
        backend.synchronize();
    });
}

// gate|up through CudaBackend configured with matmul_dtype fp8, inputs
// rounded to bf16: gate = x Wg^T, up = x Wu^T (x[rows, C], gate_up = Wg|Wu
// [2 I, C]); then dx[rows, C] = dgate Wg + dup Wu and dgate_up[2 I, C]
// (float32, from zeros) += dgate^T x | dup^T x. With `joint` through
// gate_up_projection and gate_up_projection_backward, else as the separate
// products (two matmuls, two matmul_input_grad, two matmul_weight_grad);
// *quantizations as in nanoq_emu_fp8_backward. Outputs as float32.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_gate_up(
    int rows, int intermediate, int channels, const float* x, const float* gate_up, const float* dgate,
    const float* dup, float* gate, float* up, float* dx, float* dgate_up, int joint, int* quantizations,
    char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, rows, channels, intermediate);
        const std::int64_t block = std::int64_t(intermediate) * channels, out = std::int64_t(rows) * intermediate;
        const Tensor tx = upload(backend, allocator, "x", x, std::int64_t(rows) * channels);
        const Tensor tw = upload(backend, allocator, "gate_up", gate_up, 2 * block);
        const Tensor tdgate = upload(backend, allocator, "dgate", dgate, out);
        const Tensor tdup = upload(backend, allocator, "dup", dup, out);
        const Tensor tgate = allocator.allocate(Context::Activations, "gate", DType::BF16, {out});
        const Tensor tup = allocator.allocate(Context::Activations, "up", DType::BF16, {out});
        const Tensor tdx = allocator.allocate(Context::Activations, "dx", DType::BF16, {std::int64_t(rows) * channels});
        const Tensor tdw = allocator.allocate(Context::Activations, "dgate_up", DType::F32, {2 * block});
        backend.fill(tdw, 0.0f);
        const Tensor wg = tw.slice(0, block), wu = tw.slice(block, block);
        if (joint) {
            backend.gate_up_projection(tgate, tup, tx, tw, rows, intermediate, channels);
            backend.gate_up_projection_backward(tdx, false, tdw, tdgate, tdup, tx, tw, rows, intermediate, channels);
        } else {
            backend.matmul(tgate, tx, wg, rows, intermediate, channels, false, true, false);
            backend.matmul(tup, tx, wu, rows, intermediate, channels, false, true, false);
            backend.matmul_input_grad(tdx, tdgate, wg, rows, intermediate, channels, false);
            backend.matmul_input_grad(tdx, tdup, wu, rows, intermediate, channels, true);
            backend.matmul_weight_grad(tdw.slice(0, block), Tensor(), tdgate, tx, rows, intermediate, channels);
            backend.matmul_weight_grad(tdw.slice(block, block), Tensor(), tdup, tx, rows, intermediate, channels);
        }
        *quantizations = static_cast<int>(backend.fp8_quantizations());
        download(backend, tgate, gate);
        download(backend, tup, up);
        download(backend, tdx, dx);
        backend.copy_to_host(dgate_up, tdw);
        backend.synchronize();
    });
}

// The MLP's fp8 products after the kernels that produce their operands,
// through CudaBackend configured with matmul_dtype fp8, inputs rounded to
// bf16: s = swiglu(gate, up) [rows, I], out[rows, C] = s Wd^T (Wd [C, I]);
// dgate, dup = swiglu_backward(dout, gate, up), then dx[rows, C] = dgate Wg
// + dup Wu and dgate_up[2 I, C] (float32, from zeros) += dgate^T x | dup^T x
// (gate_up_projection_backward). With `intervene` another op doubles s
// before its product and dgate before its products (add(t, t, t)).
// *quantizations as in nanoq_emu_fp8_backward; *maxima_taken = how many of
// them took the producing kernel's maximum (fp8_producer_maxima_taken()).
// Outputs as float32.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_mlp(
    int rows, int intermediate, int channels, const float* gate, const float* up, const float* down,
    const float* dout, const float* x, const float* gate_up, int intervene, float* out, float* dx, float* dgate_up,
    int* quantizations, int* maxima_taken, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, rows, channels, intermediate);
        const std::int64_t n = std::int64_t(rows) * intermediate, block = std::int64_t(intermediate) * channels;
        const Tensor tgate = upload(backend, allocator, "gate", gate, n);
        const Tensor tup = upload(backend, allocator, "up", up, n);
        const Tensor tdown = upload(backend, allocator, "down", down, block);
        const Tensor tdout = upload(backend, allocator, "dout", dout, n);
        const Tensor tx = upload(backend, allocator, "x", x, std::int64_t(rows) * channels);
        const Tensor tw = upload(backend, allocator, "gate_up", gate_up, 2 * block);
        const Tensor ts = allocator.allocate(Context::Activations, "swiglu", DType::BF16, {n});
        const Tensor tdgate = allocator.allocate(Context::Activations, "dgate", DType::BF16, {n});
        const Tensor tdup = allocator.allocate(Context::Activations, "dup", DType::BF16, {n});
        const std::int64_t rc = std::int64_t(rows) * channels;
        const Tensor tout = allocator.allocate(Context::Activations, "out", DType::BF16, {rc});
        const Tensor tdx = allocator.allocate(Context::Activations, "dx", DType::BF16, {rc});
        const Tensor tdw = allocator.allocate(Context::Activations, "dgate_up", DType::F32, {2 * block});
        backend.fill(tdw, 0.0f);
        backend.swiglu_forward(ts, tgate, tup);
        if (intervene) backend.add(ts, ts, ts);
        backend.matmul_epilogue(tout, ts, tdown, Tensor(), rows, channels, intermediate, false, true, false, 1.0f);
        backend.swiglu_backward(tdgate, tdup, tdout, tgate, tup);
        if (intervene) backend.add(tdgate, tdgate, tdgate);
        backend.gate_up_projection_backward(tdx, false, tdw, tdgate, tdup, tx, tw, rows, intermediate, channels);
        *quantizations = static_cast<int>(backend.fp8_quantizations());
        *maxima_taken = static_cast<int>(backend.fp8_producer_maxima_taken());
        download(backend, tout, out);
        download(backend, tdx, dx);
        backend.copy_to_host(dgate_up, tdw);
        backend.synchronize();
    });
}

// The fp8 products after the norms, through CudaBackend configured with
// matmul_dtype fp8, inputs rounded to bf16: xn = rmsnorm(x[rows, C], w[C]),
// y[rows, N] = xn W^T (W [N, C]); then d = dy W (dy [rows, N]) and dres
// [rows, C] (given) += rmsnorm_backward(d) (the residual stream's
// gradient), then the backward of a projection of h = y by W2 [C, N] with
// dres as its dy: dh[rows, N] = dres W2, dW2[C, N] (float32, from zeros) +=
// dres^T y (matmul_backward). With `intervene` another op doubles xn
// before its product and dres before its products (add(t, t, t)).
// *quantizations and *maxima_taken as in nanoq_emu_fp8_mlp. y, dres
// (as the products saw it), dh, dW2 come back as float32.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_norms(
    int rows, int channels, int n, const float* x, const float* norm_weight, const float* weight, const float* dy,
    const float* weight2, int intervene, float* y, float* dres, float* dh, float* dweight2, int* quantizations,
    int* maxima_taken, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        configure_fp8(backend, allocator, rows, channels, n);
        const std::int64_t rc = std::int64_t(rows) * channels, rn = std::int64_t(rows) * n;
        const Tensor tx = upload(backend, allocator, "x", x, rc);
        const Tensor tnorm = upload(backend, allocator, "norm", norm_weight, channels);
        const Tensor tw = upload(backend, allocator, "weight", weight, std::int64_t(n) * channels);
        const Tensor tdy = upload(backend, allocator, "dy", dy, rn);
        const Tensor tw2 = upload(backend, allocator, "weight2", weight2, std::int64_t(channels) * n);
        const Tensor tdres = upload(backend, allocator, "dres", dres, rc);
        const Tensor txn = allocator.allocate(Context::Activations, "xn", DType::BF16, {rc});
        const Tensor trstd = allocator.allocate(Context::Activations, "rstd", DType::F32, {rows});
        const Tensor ty = allocator.allocate(Context::Activations, "y", DType::BF16, {rn});
        const Tensor td = allocator.allocate(Context::Activations, "d", DType::BF16, {rc});
        const Tensor tdnorm = allocator.allocate(Context::Activations, "dnorm", DType::F32, {channels});
        const Tensor tdh = allocator.allocate(Context::Activations, "dh", DType::BF16, {rn});
        const Tensor tdw2 =
            allocator.allocate(Context::Activations, "dweight2", DType::F32, {std::int64_t(channels) * n});
        backend.fill(tdnorm, 0.0f);
        backend.fill(tdw2, 0.0f);
        backend.rmsnorm_forward(txn, trstd, tx, tnorm, rows, channels, 1e-6f);
        if (intervene) backend.add(txn, txn, txn);
        backend.matmul_epilogue(ty, txn, tw, Tensor(), rows, n, channels, false, true, false, 1.0f);
        backend.matmul_input_grad(td, tdy, tw, rows, n, channels, false);
        backend.rmsnorm_backward(tdres, tdnorm, td, tx, tnorm, trstd, rows, channels, true);
        if (intervene) backend.add(tdres, tdres, tdres);
        backend.matmul_backward(tdh, false, tdw2, Tensor(), tdres, tw2, ty, rows, channels, n);
        *quantizations = static_cast<int>(backend.fp8_quantizations());
        *maxima_taken = static_cast<int>(backend.fp8_producer_maxima_taken());
        download(backend, ty, y);
        download(backend, tdres, dres);
        download(backend, tdh, dh);
        backend.copy_to_host(dweight2, tdw2);
        backend.synchronize();
    });
}

// The q|k|v projection's fp8 backward after the pass that packs its
// gradient, through CudaBackend configured with matmul_dtype fp8, inputs
// rounded to bf16: dq [B*T, H*D], dk, dv [B*T, K*D] (attention's
// gradients; dq, dk of the rotated q, k), cos_sin [T, D/2, 2] (float32),
// x [B*T, C], the packed weight [(H + 2K) D, C]. `split` 0: qkv_backward
// (RoPE's backward, the packing and the products in one op); 1:
// qk_norm_rope_backward, then qkv_projection_backward (as with LoRA
// adapters: the packing and the products in the second op). Out: dx [B*T,
// C], dweight [(H + 2K) D, C] and dbias [(H + 2K) D] (float32, from
// zeros); *quantizations and *maxima_taken as in nanoq_emu_fp8_mlp.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_fp8_qkv_backward(
    int batch, int time, int heads, int kv_heads, int head_dim, int channels, const float* dq, const float* dk,
    const float* dv, const float* cos_sin, const float* x, const float* weight, int split, float* dx, float* dweight,
    float* dbias, int* quantizations, int* maxima_taken, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        const AttentionShape attention{batch, time, heads, kv_heads, head_dim};
        const int rows = batch * time, width = (heads + 2 * kv_heads) * head_dim;
        configure_fp8(backend, allocator, rows, channels, width, 0, &attention);
        const std::int64_t q_size = std::int64_t(rows) * heads * head_dim;
        const std::int64_t kv_size = std::int64_t(rows) * kv_heads * head_dim;
        const Tensor tdq = upload(backend, allocator, "dq", dq, q_size);
        const Tensor tdk = upload(backend, allocator, "dk", dk, kv_size);
        const Tensor tdv = upload(backend, allocator, "dv", dv, kv_size);
        const Tensor tcos_sin =
            upload(backend, allocator, "cos_sin", cos_sin, std::int64_t(time) * head_dim, DType::F32);
        const Tensor tx = upload(backend, allocator, "x", x, std::int64_t(rows) * channels);
        QkvWeights w, g;
        w.qkv = upload(backend, allocator, "qkv", weight, std::int64_t(width) * channels);
        g.qkv = allocator.allocate(Context::Activations, "dqkv_weight", DType::F32, {std::int64_t(width) * channels});
        g.qkv_bias = allocator.allocate(Context::Activations, "dqkv_bias", DType::F32, {width});
        backend.fill(g.qkv, 0.0f);
        backend.fill(g.qkv_bias, 0.0f);
        const Tensor tdx = allocator.allocate(Context::Activations, "dx", DType::BF16, {std::int64_t(rows) * channels});
        const QkvShape shape{attention, channels, 1e-6f};
        const QkvActivations a;  // no q/k norms: nothing saved is read
        if (split) {
            backend.qk_norm_rope_backward(tdq, tdk, a, w, g, tcos_sin, shape);
            backend.qkv_projection_backward(tdx, false, g, tdq, tdk, tdv, tx, w, shape);
        } else {
            backend.qkv_backward(tdx, false, g, tdq, tdk, tdv, a, tx, w, tcos_sin, shape);
        }
        *quantizations = static_cast<int>(backend.fp8_quantizations());
        *maxima_taken = static_cast<int>(backend.fp8_producer_maxima_taken());
        download(backend, tdx, dx);
        backend.copy_to_host(dweight, g.qkv);
        backend.copy_to_host(dbias, g.qkv_bias);
        backend.synchronize();
    });
}

// The stand-in's statuses for calls the real library refuses (or accepts),
// as "name=status" words: what tests/test_cublaslt.py holds them to.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_cublaslt_refusals(char* report, int report_bytes) {
    std::string out;
    auto note = [&](const char* name, int status) { out += std::string(name) + "=" + std::to_string(status) + " "; };
    cublasLtHandle_t handle = nullptr;
    cublasLtCreate(&handle);
    // A product of m x n from (op A) m x k and (op B) k x n, column-major.
    auto heuristic_of = [&](cudaDataType_t a_type, cudaDataType_t b_type, cudaDataType_t d, bool a_transposed, int m,
                            int n, int k, const std::function<void(cublasLtMatmulDesc_t)>& extra, int* returned) {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        const cublasOperation_t ta = a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
        if (extra) extra(desc);
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
        cublasLtMatrixLayoutCreate(&a, a_type, a_transposed ? k : m, a_transposed ? m : k, a_transposed ? k : m);
        cublasLtMatrixLayoutCreate(&b, b_type, k, n, k);
        cublasLtMatrixLayoutCreate(&c, d, m, n, m);
        cublasLtMatmulPreference_t preference = nullptr;
        cublasLtMatmulPreferenceCreate(&preference);
        cublasLtMatmulHeuristicResult_t results[8];
        const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, preference, 8, results,
                                                                     returned);
        cublasLtMatmulPreferenceDestroy(preference);
        cublasLtMatrixLayoutDestroy(a);
        cublasLtMatrixLayoutDestroy(b);
        cublasLtMatrixLayoutDestroy(c);
        cublasLtMatmulDescDestroy(desc);
        return static_cast<int>(status);
    };
    auto heuristic = [&](cudaDataType_t ab, cudaDataType_t d, bool a_transposed, int m, int n, int k,
                         const std::function<void(cublasLtMatmulDesc_t)>& extra, int* returned) {
        return heuristic_of(ab, ab, d, a_transposed, m, n, k, extra, returned);
    };
    int returned = 0;
    {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        const std::uint32_t relu = 2, bias = CUBLASLT_EPILOGUE_BIAS;
        note("relu_epilogue", cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &relu, sizeof(relu)));
        note("bias_epilogue", cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &bias, sizeof(bias)));
        const std::int32_t sm_count = 8;  // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET: not one the stand-in knows
        note("unknown_attribute", cublasLtMatmulDescSetAttribute(desc, static_cast<cublasLtMatmulDescAttributes_t>(15),
                                                                 &sm_count, sizeof(sm_count)));
        cublasLtMatmulDescDestroy(desc);
    }
    note("fp8_tn", heuristic(CUDA_R_8F_E4M3, CUDA_R_16BF, true, 32, 16, 48, nullptr, &returned));
    note("fp8_tn_algorithms", returned);
    note("fp8_nn", heuristic(CUDA_R_8F_E4M3, CUDA_R_16BF, false, 32, 16, 48, nullptr, &returned));
    note("fp8_m24", heuristic(CUDA_R_8F_E4M3, CUDA_R_16BF, true, 24, 16, 48, nullptr, &returned));
    note("fp8_into_fp8", heuristic(CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, true, 32, 16, 48, nullptr, &returned));
    // The backward's pairs: an e5m2 gradient with an e4m3 operand either way
    // round, into bf16 or float32; never two e5m2 operands, never off "TN".
    note("fp8_e4m3_e5m2", heuristic_of(CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF, true, 32, 16, 48, nullptr,
                                       &returned));
    note("fp8_e5m2_e4m3", heuristic_of(CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, true, 32, 16, 48, nullptr,
                                       &returned));
    note("fp8_e5m2_e5m2", heuristic_of(CUDA_R_8F_E5M2, CUDA_R_8F_E5M2, CUDA_R_16BF, true, 32, 16, 48, nullptr,
                                       &returned));
    note("fp8_e5m2_nn", heuristic_of(CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF, false, 32, 16, 48, nullptr,
                                     &returned));
    note("fp8_with_bf16", heuristic_of(CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF, true, 32, 16, 48, nullptr,
                                       &returned));
    const float one = 1.0f;
    const float* scale = &one;
    note("scale_on_bf16", heuristic(CUDA_R_16BF, CUDA_R_16BF, false, 8, 8, 8,
                                    [&](cublasLtMatmulDesc_t desc) {
                                        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                                       &scale, sizeof(scale));
                                    },
                                    &returned));
    note("fast_accum_on_bf16", heuristic(CUDA_R_16BF, CUDA_R_16BF, false, 8, 8, 8,
                                         [&](cublasLtMatmulDesc_t desc) {
                                             const std::int8_t fast = 1;
                                             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                                            &fast, sizeof(fast));
                                         },
                                         &returned));
    note("f32_bias_on_bf16", heuristic(CUDA_R_16BF, CUDA_R_16BF, false, 8, 8, 8,
                                       [&](cublasLtMatmulDesc_t desc) {
                                           const std::uint32_t bias = CUBLASLT_EPILOGUE_BIAS;
                                           const std::int32_t type = CUDA_R_32F;
                                           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &bias,
                                                                          sizeof(bias));
                                           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                                          &type, sizeof(type));
                                       },
                                       &returned));
    // Strided batches of 8 x 8 products: every layout's batch count and the
    // outputs' stride as given (A's stride 0: shared; B's and C's 64).
    auto batched = [&](std::int32_t a_count, std::int32_t d_count, std::int64_t d_stride) {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
        for (cublasLtMatrixLayout_t* layout : {&a, &b, &c, &d}) cublasLtMatrixLayoutCreate(layout, CUDA_R_32F, 8, 8, 8);
        const std::int64_t strides[4] = {0, 64, 64, d_stride};
        const std::int32_t counts[4] = {a_count, d_count, d_count, d_count};
        cublasLtMatrixLayout_t layouts[4] = {a, b, c, d};
        for (int i = 0; i < 4; ++i) {
            cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &counts[i],
                                             sizeof(counts[i]));
            cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                             sizeof(strides[i]));
        }
        cublasLtMatmulPreference_t preference = nullptr;
        cublasLtMatmulPreferenceCreate(&preference);
        cublasLtMatmulHeuristicResult_t result;
        const cublasStatus_t status =
            cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, d, preference, 1, &result, &returned);
        cublasLtMatmulPreferenceDestroy(preference);
        for (cublasLtMatrixLayout_t layout : layouts) cublasLtMatrixLayoutDestroy(layout);
        cublasLtMatmulDescDestroy(desc);
        return static_cast<int>(status);
    };
    note("batch_shared_operand", batched(2, 2, 64));
    note("batch_counts_differ", batched(1, 2, 64));
    note("batch_outputs_overlap", batched(2, 2, 63));
    {
        cublasLtMatrixLayout_t layout = nullptr;
        cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 8, 8, 8);
        const std::int64_t backwards = -64;
        note("batch_negative_stride", cublasLtMatrixLayoutSetAttribute(
                                          layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &backwards,
                                          sizeof(backwards)));
        cublasLtMatrixLayoutDestroy(layout);
    }
    {
        // The bias epilogue run without a bias pointer.
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        const std::uint32_t bias = CUBLASLT_EPILOGUE_BIAS;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &bias, sizeof(bias));
        cublasLtMatrixLayout_t layout = nullptr;
        cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 8, 8, 8);
        cublasLtMatmulPreference_t preference = nullptr;
        cublasLtMatmulPreferenceCreate(&preference);
        cublasLtMatmulHeuristicResult_t result;
        cublasLtMatmulAlgoGetHeuristic(handle, desc, layout, layout, layout, layout, preference, 1, &result, &returned);
        void* data = nullptr;
        cudaMalloc(&data, 3 * 64 * sizeof(float));
        float* m = static_cast<float*>(data);
        const float zero = 0.0f;
        note("bias_epilogue_without_bias", cublasLtMatmul(handle, desc, &one, m, layout, m + 64, layout, &zero, m + 128,
                                                          layout, m + 128, layout, &result.algo, nullptr, 0, nullptr));
        cudaDeviceSynchronize();
        cudaFree(data);
        cublasLtMatmulPreferenceDestroy(preference);
        cublasLtMatrixLayoutDestroy(layout);
        cublasLtMatmulDescDestroy(desc);
    }
    cublasLtDestroy(handle);
    std::strncpy(report, out.c_str(), report_bytes - 1);
    report[report_bytes - 1] = '\0';
    return 0;
}

// Attention over packed documents in the fused stand-in (attention "cudnn",
// packed_documents, bf16) where the documents' mask was announced for one
// positions tensor (CudaBackend::positions_changed): the forward with
// `first` (announced), then with `second` (not announced), then with
// `first` again. q, k, v: [batch, time, heads, head_dim] (one kv head per
// head), rounded to bf16; first, second: int32 [batch, time]; out: the three
// outputs in turn, each batch * time * heads * head_dim floats (read back
// from bf16); *masks: the masks written (AttentionInfo::document_masks).
extern "C" __attribute__((visibility("default"))) int nanoq_emu_document_mask_reuse(
    int batch, int time, int heads, int head_dim, const float* q, const float* k, const float* v, const int* first,
    const int* second, float* out, long long* masks, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        cuda::CudaBackend backend(0);
        NamedAllocator allocator(backend, 0);
        TrainOptions options;
        options.dtype = Precision::BF16;
        options.attention = AttentionImpl::Cudnn;
        options.packed_documents = true;
        backend.configure(options);
        const AttentionShape shape{batch, time, heads, heads, head_dim};
        ScratchShapes shapes{shape, heads * head_dim, 16, 16, 1, 0};
        shapes.attention_impl = AttentionImpl::Cudnn;
        shapes.dtype = Precision::BF16;
        shapes.packed_documents = true;
        backend.reserve_scratch(allocator, shapes);
        const std::int64_t rows = std::int64_t(batch) * time, elements = rows * heads * head_dim;
        const Tensor tq = upload(backend, allocator, "q", q, elements), tk = upload(backend, allocator, "k", k, elements),
                     tv = upload(backend, allocator, "v", v, elements);
        Tensor positions[2];
        const int* host[2] = {first, second};
        for (int i = 0; i < 2; ++i) {
            positions[i] = allocator.allocate(Context::Workspace, i ? "second" : "first", DType::I32, {batch, time});
            backend.copy_from_host(positions[i], host[i]);
        }
        const Tensor lse = allocator.allocate(Context::Activations, "lse", DType::F32, {std::int64_t(batch) * heads * time});
        const Tensor result = allocator.allocate(Context::Activations, "out", DType::BF16, {elements});
        backend.positions_changed(positions[0], shape);
        for (int call = 0; call < 3; ++call) {
            backend.attention_forward(result, lse, tq, tk, tv, positions[call == 1], shape);
            download(backend, result, out + call * elements);
        }
        *masks = backend.attention_info().document_masks;
    });
}

// One float32 matmul out[M,N] = a[M,K] @ b[K,N] whose cuBLASLt plan is
// first needed inside a CUDA graph capture (a fresh LtMatmul; the choice of
// algorithm follows NANOQ_MATMUL_AUTOTUNE): captured on a stream of its
// own (thread-local mode, as the trainer captures), then the graph launched
// once and out read back (tests/test_cublaslt.py).
extern "C" __attribute__((visibility("default"))) int nanoq_emu_matmul_planned_in_capture(
    int M, int N, int K, const float* a, const float* b, float* out, char* message, int message_bytes) {
    using namespace nanoq;
    return guarded(message, message_bytes, [&] {
        NANOQ_CUDA_CHECK(cudaSetDevice(0));
        cudaStream_t stream = nullptr;
        NANOQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const std::size_t workspace_bytes = std::size_t(4) << 20;
        void *da = nullptr, *db = nullptr, *dout = nullptr, *workspace = nullptr;
        NANOQ_CUDA_CHECK(cudaMalloc(&da, sizeof(float) * M * K));
        NANOQ_CUDA_CHECK(cudaMalloc(&db, sizeof(float) * K * N));
        NANOQ_CUDA_CHECK(cudaMalloc(&dout, sizeof(float) * M * N));
        NANOQ_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
        NANOQ_CUDA_CHECK(cudaMemcpy(da, a, sizeof(float) * M * K, cudaMemcpyHostToDevice));
        NANOQ_CUDA_CHECK(cudaMemcpy(db, b, sizeof(float) * K * N, cudaMemcpyHostToDevice));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        auto release = [&] {
            if (exec) cudaGraphExecDestroy(exec);
            if (graph) cudaGraphDestroy(graph);
            for (void* p : {da, db, dout, workspace}) cudaFree(p);
            cudaStreamDestroy(stream);
        };
        try {
            cuda::LtMatmul matmul([](cudaEvent_t event) { NANOQ_CUDA_CHECK(cudaEventSynchronize(event)); });
            NANOQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            try {
                matmul.run(Tensor(dout, DType::F32, {M, N}), Tensor(da, DType::F32, {M, K}),
                           Tensor(db, DType::F32, {K, N}), M, N, K, false, false, false, workspace, workspace_bytes,
                           stream);
            } catch (...) {
                cudaStreamEndCapture(stream, &graph);
                throw;
            }
            NANOQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
            NANOQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            NANOQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
            NANOQ_CUDA_CHECK(cudaStreamSynchronize(stream));
            NANOQ_CUDA_CHECK(cudaMemcpy(out, dout, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
        } catch (...) {
            release();
            throw;
        }
        release();
    });
}

namespace nanoq {
namespace cuda {
std::shared_ptr<CommGroup> make_nccl_group(const Topology& topology);
}  // namespace cuda
}  // namespace nanoq

namespace {

// Two "processes" of one world as two threads of this one: their
// alltoallv meet in shared memory.
struct TwoProcessMailbox {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<char> sent[2];
    std::vector<std::int64_t> send_bytes[2];
    int arrived = 0, round = 0, collected = 0;
};

class ThreadTransport final : public nanoq::ProcessTransport {
public:
    ThreadTransport(TwoProcessMailbox& box, int rank) : box_(box), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return 2; }
    void alltoallv(const void* send, const std::vector<std::int64_t>& send_bytes, void* recv,
                   const std::vector<std::int64_t>& recv_bytes) override {
        std::unique_lock<std::mutex> lock(box_.mutex);
        const int round = box_.round;
        std::int64_t total = 0;
        for (std::int64_t n : send_bytes) total += n;
        box_.sent[rank_].assign(static_cast<const char*>(send), static_cast<const char*>(send) + total);
        box_.send_bytes[rank_] = send_bytes;
        if (++box_.arrived == 2) box_.changed.notify_all();
        box_.changed.wait(lock, [&] { return box_.arrived == 2 || box_.round != round; });
        // Block q of process p's send is what p sends to q.
        char* out = static_cast<char*>(recv);
        for (int from = 0; from < 2; ++from) {
            std::int64_t offset = 0;
            for (int q = 0; q < rank_; ++q) offset += box_.send_bytes[from][q];
            std::memcpy(out, box_.sent[from].data() + offset, static_cast<std::size_t>(recv_bytes[from]));
            out += recv_bytes[from];
        }
        if (++box_.collected == 2) {
            box_.arrived = box_.collected = 0;
            ++box_.round;
            box_.changed.notify_all();
        } else {
            box_.changed.wait(lock, [&] { return box_.round != round; });
        }
    }
    void barrier() override {
        std::vector<std::int64_t> none(2, 0);
        alltoallv(nullptr, none, nullptr, none);
    }

private:
    TwoProcessMailbox& box_;
    int rank_;
};

}  // namespace

// make_nccl_group (the cuda backend's world) for two processes, played by
// two threads joined by an in-memory transport, whose world signatures are
// `signature0` and `signature1`; each process's refusal (empty: it made its
// group) is written to message0 / message1. Returns 0.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_nccl_group_of_two_processes(
    const char* signature0, const char* signature1, char* message0, char* message1, int message_bytes) {
    TwoProcessMailbox box;
    const char* signatures[2] = {signature0, signature1};
    char* messages[2] = {message0, message1};
    std::vector<std::thread> processes;
    for (int p = 0; p < 2; ++p)
        processes.emplace_back([&, p] {
            nanoq::Topology topology;
            topology.world_size = 2;
            topology.first_rank = p;
            topology.devices = 1;
            topology.signature = signatures[p];
            topology.transport = std::make_shared<ThreadTransport>(box, p);
            messages[p][0] = '\0';
            guarded(messages[p], message_bytes, [&] { nanoq::cuda::make_nccl_group(topology); });
        });
    for (std::thread& t : processes) t.join();
    return 0;
}
