// fp8 operands for the cuBLASLt matmuls, with current per-tensor scaling:
// the tensor's absolute maximum is taken first, then every element is
// multiplied by scale = max / amax (the format's largest finite value, 448
// for e4m3 and 57344 for e5m2, over the maximum, so the largest element
// lands on it), rounded to the format (nearest even, saturating) and
// 1 / scale is written for cuBLASLt to dequantize with. The transposing
// variant writes x[rows, cols] as out[cols, rows] through a shared-memory
// tile, so that both the reads and the writes are coalesced: cuBLASLt's fp8
// kernels take only K-contiguous operands, and the backward's products
// consume dy, W and x along another dimension than they are stored.
//
// The maximum is an atomicMax on the float's bits (detail::block_max_into):
// exact and independent of the order the blocks run in. A NaN element is
// skipped by the maximum and stays NaN when quantized (it reaches the loss,
// whose step is then skipped); an infinite one makes the inverse scale NaN
// (fp8_inverse_scale), with the same end. Where the kernel that produced x took the
// same maximum as it wrote x (SwiGLU forward and backward: "producer
// maxima", cuda_backend.cpp), the caller says so (amax_known) and the
// maximum's pass is left out: the codes are the same, one read of x fewer.
// Each block reduces its elements first and adds one atomic, on a grid of at
// most kMaxReduceBlocks: atomics on one address are serialised, and one per
// warp of a 65536-block grid (half a million) would cost more than the pass.
// The maximum and the plain quantization read 16-byte chunks (and the plain
// one writes 8 or 4 bytes at once) where the pointers allow, element by
// element otherwise; the transposing one reads 16-byte chunks and writes 16
// bytes at once where the shape and pointers allow (those of the fp8
// products always do), else goes element by element through a 32 x 32 tile.
//
// fp8_quantize_both writes both forms of one tensor from one maximum and
// one pass: the transposing kernel's tile read also writes the plain codes.
// The backward multiplies dy as stored (dgrad) and transposed (wgrad), and
// quantizing it once for both halves dy's reads (two instead of four).
//
// The weight cache's variant (fp8_quantize_cached) launches the same kernels
// with a slot's stamp and the cache's generation: each kernel returns at
// once when they are equal, so a current slot costs a few empty launches,
// and the decision is the device's (a replayed graph makes it anew).
#include <cuda_fp8.h>

#include <algorithm>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxReduceBlocks = 1024;  // about what an H100/H200 holds at once (132 SMs x 8 blocks of 256)

// The weight cache's check (fp8_quantize_cached): with a stamp, a kernel
// does nothing when the slot is current (its stamp equals the generation).
__device__ __forceinline__ bool current(const unsigned* stamp, const unsigned* generation) {
    return stamp && *stamp == *generation;
}

// Where the chunked loops stop: every element before it is in a whole
// 16-byte chunk (none with `vector` false).
template <class T> __device__ __forceinline__ std::int64_t chunked_end(std::int64_t n, bool vector) {
    return vector ? n / detail::kPack<T> * detail::kPack<T> : 0;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    absmax_kernel(float* amax, const T* x, std::int64_t n, bool vector, const unsigned* stamp,
                  const unsigned* generation) {
    NANOQ_SHARED(float[detail::kWarpSize], warp_maxima);
    if (current(stamp, generation)) return;  // the whole grid returns: no thread waits at the barrier
    constexpr int P = detail::kPack<T>;
    const std::int64_t split = chunked_end<T>(n, vector);
    float m = 0.0f;
    for (std::int64_t c = detail::grid_stride_begin(); c * P < split; c += detail::grid_stride_step()) {
        float v[P];
        detail::load_chunk<T>(v, x, c * P, split, true);
        for (int j = 0; j < P; ++j) m = fmaxf(m, fabsf(v[j]));
    }
    for (std::int64_t i = split + detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        m = fmaxf(m, fabsf(detail::to_float(x[i])));
    detail::block_max_into(amax, m, warp_maxima);
}

// P fp8 codes side by side: 8 bytes for 8 bf16 inputs, 4 for 4 fp32.
template <int P> struct alignas(P) Codes {
    std::uint8_t v[P];
};

// The scale for a maximum: 1 where there is nothing to scale (all zeros) or
// the maximum is not finite; at most 2^126, so that a maximum below
// largest / FLT_MAX (bf16 and fp32 hold such values) does not make it
// infinite (0 * inf would be NaN) and 1 / scale stays a normal float.
__device__ __forceinline__ float fp8_scale(float amax, Fp8Format format) {
    const float largest = format == Fp8Format::E4M3 ? kE4m3Max : kE5m2Max;
    return amax > 0.0f && isfinite(amax) ? fminf(largest / amax, 0x1p126f) : 1.0f;
}

// The inverse scale cuBLASLt dequantizes with: 1 / scale, or NaN where the
// maximum is infinite (an overflow in x). Saturating conversion would turn
// the infinities into the format's largest value and the product would come
// out finite; a NaN scale makes it NaN, as the bf16 product would be
// non-finite, so that the loss shows it and the step is skipped.
__device__ __forceinline__ float fp8_inverse_scale(float amax, float scale) {
    return isinf(amax) ? __int_as_float(0x7fc00000) : 1.0f / scale;
}

__device__ __forceinline__ std::uint8_t to_fp8(float scaled, Fp8Format format) {
    return __nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, format == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <class T>
__global__ void quantize_kernel(std::uint8_t* out, float* inverse_scale, const float* amax, const T* x,
                                std::int64_t n, bool vector, Fp8Format format, const unsigned* stamp,
                                const unsigned* generation, float* amax_copy) {
    if (current(stamp, generation)) return;
    constexpr int P = detail::kPack<T>;
    const float scale = fp8_scale(*amax, format);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *inverse_scale = fp8_inverse_scale(*amax, scale);
        if (amax_copy) *amax_copy = *amax;
    }
    const std::int64_t split = chunked_end<T>(n, vector);
    for (std::int64_t c = detail::grid_stride_begin(); c * P < split; c += detail::grid_stride_step()) {
        float v[P];
        detail::load_chunk<T>(v, x, c * P, split, true);
        Codes<P> codes;
        for (int j = 0; j < P; ++j) codes.v[j] = to_fp8(v[j] * scale, format);
        *reinterpret_cast<Codes<P>*>(out + c * P) = codes;
    }
    for (std::int64_t i = split + detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        out[i] = to_fp8(detail::to_float(x[i]) * scale, format);
}

// The two passes' grids and whether they read whole chunks.
struct QuantizeLaunch {
    int reduce_blocks, blocks;
    bool vector;
};
template <class T> QuantizeLaunch quantize_launch(const std::uint8_t* out, const T* x, std::int64_t n) {
    constexpr int P = detail::kPack<T>;
    const bool vector = detail::aligned16(x) && reinterpret_cast<std::uintptr_t>(out) % P == 0;
    // Work items: chunks where vectorised (plus the tail, done by the same threads), else elements.
    const std::int64_t items = vector ? (n + P - 1) / P : n;
    const int blocks = std::max(1, detail::grid_stride_blocks(items, kThreads));
    return {std::min(blocks, kMaxReduceBlocks), blocks, vector};
}

// One kTile x kTile tile per block, kTile x kTileLanes threads: each reads
// kTile / kTileLanes rows of the tile (consecutive threads, consecutive
// columns) and writes as many of its transpose (consecutive rows).
constexpr int kTile = 32, kTileLanes = 8;

// With `plain` (not null) the kernel writes x's codes as stored there too.
template <class T>
__global__ void __launch_bounds__(kTile * kTileLanes)
    quantize_transposed_kernel(std::uint8_t* out, std::uint8_t* plain, float* inverse_scale, const float* amax,
                               const T* x, int rows, int cols, Fp8Format format, const unsigned* stamp,
                               const unsigned* generation) {
    NANOQ_SHARED(float[kTile * (kTile + 1)], tile);  // +1: no bank conflicts on the transposed reads
    if (current(stamp, generation)) return;  // the whole block returns: no thread waits at the barrier
    const float scale = fp8_scale(*amax, format);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0)
        *inverse_scale = fp8_inverse_scale(*amax, scale);
    const int first_col = blockIdx.x * kTile, first_row = blockIdx.y * kTile;
    for (int i = threadIdx.y; i < kTile; i += kTileLanes) {
        const int r = first_row + i, c = first_col + threadIdx.x;
        if (r < rows && c < cols) {
            const std::int64_t at = std::int64_t(r) * cols + c;
            const float v = detail::to_float(x[at]);
            tile[i * (kTile + 1) + threadIdx.x] = v;
            if (plain) plain[at] = to_fp8(v * scale, format);
        }
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTile; i += kTileLanes) {
        const int c = first_col + i, r = first_row + threadIdx.x;  // out[c, r] = x[r, c]
        if (r < rows && c < cols)
            out[std::int64_t(c) * rows + r] = to_fp8(tile[threadIdx.x * (kTile + 1) + i] * scale, format);
    }
}

// The vectorised transposing kernel, for the shapes the fp8 products take
// (rows % 16 == 0, cols % 8 == 0, every pointer 16-byte aligned: their M, N
// and K are multiples of 16 and the fp8 buffers 256-byte aligned; other
// shapes take the kernel above). A block of kVecThreads takes a tile of
// kVecRows x kVecCols. First each thread reads 16-byte chunks of the tile's
// rows (a warp: 4 rows of 8 bf16 chunks), writes their plain codes with one
// store when asked, and keeps the codes in shared memory as words of 4;
// then thread (c4, seg) takes the words of columns [4 c4, 4 c4 + 4) in rows
// [16 seg, 16 seg + 16), transposes those 4 x 16 bytes in registers and
// writes 16 bytes to each of the 4 output rows (a warp: 16 output rows, 32
// consecutive bytes each). Rows of the shared tile are kVecStride words
// apart, 17: the second phase's two halves of a warp read other banks.
// The codes are computed as above, element by element: bitwise the same.
constexpr int kVecThreads = 256, kVecRows = 256, kVecCols = 64, kVecStride = kVecCols / 4 + 1;

struct alignas(16) Bytes16 {
    unsigned words[4];
};

template <class T>
__global__ void __launch_bounds__(kVecThreads)
    quantize_transposed_vector_kernel(std::uint8_t* out, std::uint8_t* plain, float* inverse_scale, const float* amax,
                                      const T* x, int rows, int cols, Fp8Format format, const unsigned* stamp,
                                      const unsigned* generation) {
    NANOQ_SHARED(unsigned[kVecRows * kVecStride], tile);
    if (current(stamp, generation)) return;  // the whole block returns: no thread waits at the barrier
    constexpr int P = detail::kPack<T>, kChunks = kVecCols / P;
    const float scale = fp8_scale(*amax, format);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inverse_scale = fp8_inverse_scale(*amax, scale);
    const int first_col = blockIdx.x * kVecCols, first_row = blockIdx.y * kVecRows;
    const int tile_cols = cols - first_col < kVecCols ? cols - first_col : kVecCols;
    const int tile_rows = rows - first_row < kVecRows ? rows - first_row : kVecRows;
    for (int q = threadIdx.x; q < kVecRows * kChunks; q += kVecThreads) {
        const int r = q / kChunks, c = q % kChunks * P;
        if (r >= tile_rows || c >= tile_cols) continue;  // cols % 8 == 0: a chunk is all in or all out
        const std::int64_t at = std::int64_t(first_row + r) * cols + first_col + c;
        float v[P];
        detail::load_chunk<T>(v, x, at, at + P, true);
        Codes<P> codes;
        for (int j = 0; j < P; ++j) codes.v[j] = to_fp8(v[j] * scale, format);
        if (plain) *reinterpret_cast<Codes<P>*>(plain + at) = codes;
        for (int w = 0; w < P / 4; ++w)
            tile[r * kVecStride + c / 4 + w] = unsigned(codes.v[4 * w]) | unsigned(codes.v[4 * w + 1]) << 8 |
                                               unsigned(codes.v[4 * w + 2]) << 16 | unsigned(codes.v[4 * w + 3]) << 24;
    }
    __syncthreads();
    const int c4 = threadIdx.x % (kVecCols / 4), seg = threadIdx.x / (kVecCols / 4);
    if (4 * c4 >= tile_cols || 16 * seg >= tile_rows) return;  // rows % 16 == 0: a segment is all in or all out
    unsigned w[16];
    for (int i = 0; i < 16; ++i) w[i] = tile[(16 * seg + i) * kVecStride + c4];
    for (int k = 0; k < 4; ++k) {  // output row first_col + 4 c4 + k: byte k of each word, in row order
        Bytes16 bytes;
        for (int m = 0; m < 4; ++m) {
            unsigned word = 0;
            for (int b = 0; b < 4; ++b) word |= (w[4 * m + b] >> (8 * k) & 0xffu) << (8 * b);
            bytes.words[m] = word;
        }
        *reinterpret_cast<Bytes16*>(out + std::int64_t(first_col + 4 * c4 + k) * rows + first_row + 16 * seg) = bytes;
    }
}

template <class T> bool vector_transpose(const std::uint8_t* out, const std::uint8_t* plain, const T* x, int rows,
                                         int cols) {
    return rows > 0 && cols > 0 && rows % 16 == 0 && cols % 8 == 0 && detail::aligned16(out) && (!plain || detail::aligned16(plain)) &&
           detail::aligned16(x);
}

// One thread: a stale slot's maximum restarts from 0.
__global__ void restart_kernel(float* amax, const unsigned* stamp, const unsigned* generation) {
    if (!current(stamp, generation)) *amax = 0.0f;
}

// One thread, after the slot's quantization: the slot is current. A kernel
// of its own, so that no block of the quantization sees the new stamp early.
__global__ void stamp_kernel(unsigned* stamp, const unsigned* generation) { *stamp = *generation; }

__global__ void advance_kernel(unsigned* generation) { *generation += 1; }

// Transposed into `out`, and with `plain` as stored there as well (one
// maximum, one pass); else as stored into `out`.
template <class T>
void quantize(std::uint8_t* out, std::uint8_t* plain, float* amax, float* inverse_scale, const T* x, int rows,
              int cols, bool transposed, Fp8Format format, const unsigned* stamp, const unsigned* generation,
              bool amax_known, cudaStream_t stream) {
    const std::int64_t n = std::int64_t(rows) * cols;
    const QuantizeLaunch grid_of = quantize_launch<T>(out, x, n);
    if (n > 0 && !amax_known)
        detail::launch(absmax_kernel<T>, grid_of.reduce_blocks, kThreads, 0, stream, amax, x, n, grid_of.vector, stamp,
                       generation);
    if (transposed && vector_transpose<T>(out, plain, x, rows, cols)) {
        const dim3 grid((cols + kVecCols - 1) / kVecCols, (rows + kVecRows - 1) / kVecRows);
        detail::launch(quantize_transposed_vector_kernel<T>, grid, kVecThreads, 0, stream, out, plain, inverse_scale,
                       static_cast<const float*>(amax), x, rows, cols, format, stamp, generation);
    } else if (transposed) {
        const dim3 grid(std::max(1, (cols + kTile - 1) / kTile), std::max(1, (rows + kTile - 1) / kTile));
        detail::launch(quantize_transposed_kernel<T>, grid, dim3(kTile, kTileLanes), 0, stream, out, plain,
                       inverse_scale, static_cast<const float*>(amax), x, rows, cols, format, stamp, generation);
    } else {
        detail::launch(quantize_kernel<T>, grid_of.blocks, kThreads, 0, stream, out, inverse_scale,
                       static_cast<const float*>(amax), x, n, grid_of.vector, format, stamp, generation, nullptr);
    }
}

}  // namespace

template <class T>
void fp8_quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, std::int64_t n, Fp8Format format,
                  bool amax_known, float* amax_copy, cudaStream_t stream) {
    // One row of n (the plain kernel never looks at rows and cols apart).
    const QuantizeLaunch grid_of = quantize_launch<T>(out, x, n);
    if (n > 0 && !amax_known)
        detail::launch(absmax_kernel<T>, grid_of.reduce_blocks, kThreads, 0, stream, amax, x, n, grid_of.vector,
                       nullptr, nullptr);
    detail::launch(quantize_kernel<T>, grid_of.blocks, kThreads, 0, stream, out, inverse_scale,
                   static_cast<const float*>(amax), x, n, grid_of.vector, format, nullptr, nullptr, amax_copy);
}

template <class T>
void fp8_quantize_transposed(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, int rows, int cols,
                             Fp8Format format, bool amax_known, cudaStream_t stream) {
    quantize<T>(out, nullptr, amax, inverse_scale, x, rows, cols, true, format, nullptr, nullptr, amax_known, stream);
}

template <class T>
void fp8_quantize_both(std::uint8_t* plain, std::uint8_t* transposed, float* amax, float* inverse_scale, const T* x,
                       int rows, int cols, Fp8Format format, bool amax_known, cudaStream_t stream) {
    quantize<T>(transposed, plain, amax, inverse_scale, x, rows, cols, true, format, nullptr, nullptr, amax_known,
                stream);
}

template <class T>
void fp8_quantize_cached(std::uint8_t* out, float* amax, float* inverse_scale, unsigned* stamp,
                         const unsigned* generation, const T* x, int rows, int cols, bool transposed,
                         cudaStream_t stream) {
    detail::launch(restart_kernel, 1, 1, 0, stream, amax, static_cast<const unsigned*>(stamp), generation);
    quantize<T>(out, nullptr, amax, inverse_scale, x, rows, cols, transposed, Fp8Format::E4M3, stamp, generation,
                false, stream);
    detail::launch(stamp_kernel, 1, 1, 0, stream, stamp, generation);
}

void fp8_advance_generation(unsigned* generation, cudaStream_t stream) {
    detail::launch(advance_kernel, 1, 1, 0, stream, generation);
}

#define NANOQ_INSTANTIATE(T)                                                                                    \
    template void fp8_quantize<T>(std::uint8_t*, float*, float*, const T*, std::int64_t, Fp8Format, bool,       \
                                  float*, cudaStream_t);                                                        \
    template void fp8_quantize_transposed<T>(std::uint8_t*, float*, float*, const T*, int, int, Fp8Format, bool, \
                                             cudaStream_t);                                                     \
    template void fp8_quantize_both<T>(std::uint8_t*, std::uint8_t*, float*, float*, const T*, int, int,        \
                                       Fp8Format, bool, cudaStream_t);                                          \
    template void fp8_quantize_cached<T>(std::uint8_t*, float*, float*, unsigned*, const unsigned*, const T*,   \
                                         int, int, bool, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
