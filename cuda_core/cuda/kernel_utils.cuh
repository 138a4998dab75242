// Device helpers shared by the kernels_*.cu files (private to them).
//
// Everything here is inline or a template so that each translation unit gets
// its own copy without duplicate symbols. The column-sum helper splits rows
// into a fixed number of chunks that depends only on (rows, cols): partial
// sums go to scratch and a second kernel adds them in chunk order, which keeps
// the result bitwise reproducible without atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace detail {

// ---- the one launch form, and shared memory -------------------------------
// Kernels are launched with detail::launch(kernel, grid, block, shared_bytes,
// stream, args...) and declare shared memory with NANOQ_SHARED(type, name)
// (dynamic: NANOQ_DYNAMIC_SHARED); device functions take shared memory as
// smem_ptr<T>. With nvcc these are the plain <<<>>> launch, __shared__ and
// T*; under the CPU emulator (emulator/, NANOQ_CUDA_EMULATED) the same
// source runs with every shared access bounds-checked.
#ifdef NANOQ_CUDA_EMULATED
template <class T> using smem_ptr = ::nanoq_emu::SharedPtr<T>;
using ::nanoq_emu::launch;
#else
template <class T> using smem_ptr = T*;
template <class T> using shared_type = T;
#define NANOQ_SHARED(type, name) __shared__ ::nanoq::cuda::detail::shared_type<type> name
#define NANOQ_DYNAMIC_SHARED(type, name)                              \
    extern __shared__ __align__(16) unsigned char nanoq_dynamic_shared[]; \
    type* name = reinterpret_cast<type*>(nanoq_dynamic_shared)

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
            Args&&... args) {
    kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
}
#endif

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;
// Grid-stride kernels never launch more blocks than this.
constexpr std::int64_t kMaxGridStrideBlocks = 65536;

inline int grid_stride_blocks(std::int64_t n, int threads) {
    const std::int64_t blocks = (n + threads - 1) / threads;
    return static_cast<int>(blocks < kMaxGridStrideBlocks ? blocks : kMaxGridStrideBlocks);
}

__device__ __forceinline__ std::int64_t grid_stride_begin() {
    return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride_step() {
    return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// Round-to-nearest-even conversion from fp32.
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ double from_float<double>(float x) { return x; }

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    return x;
}
__device__ __forceinline__ double warp_sum(double x) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to
// every thread. `shared` holds 32 values; the call ends with a barrier so that
// `shared` may be reused right after.
template <class V> struct same_type { using type = V; };
template <class V> __device__ __forceinline__ V block_sum(V x, smem_ptr<typename same_type<V>::type> shared) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int warps = blockDim.x / kWarpSize;
    x = warp_sum(x);
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    V total = lane < warps ? shared[lane] : V(0);
    total = warp_sum(total);
    __syncthreads();
    return total;
}

// *target = max(*target, the block's largest m) (every m >= 0 or NaN, NaN
// skipped; blockDim.x a multiple of 32), at most one atomic per block: an
// atomicMax on the float's bits, which for non-negative floats order as the
// values do, so the result is exact and independent of the order the blocks
// run in. Atomics on one address are serialised, and a grid of a block per
// row (the norms' forward) has thousands of blocks: a block whose maximum
// is not above what *target already holds (a plain read, which may only be
// behind, never ahead: the target only grows) leaves its atomic out. Every
// thread of the block calls it; `shared` holds 32 values, and the call ends
// with a barrier so that `shared` may be reused right after.
__device__ __forceinline__ void block_max_into(float* target, float m, smem_ptr<float> shared) {
    m = warp_max(m);
    if (threadIdx.x % kWarpSize == 0) shared[threadIdx.x / kWarpSize] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) m = fmaxf(m, shared[w]);
        if (m > *static_cast<volatile float*>(target))
            atomicMax(reinterpret_cast<unsigned*>(target), __float_as_uint(m));
    }
    __syncthreads();
}

__host__ __device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Stochastic rounding to bf16: `random16` (uniform in [0, 2^16)) is added to
// the low half of the fp32 bit pattern, which is then truncated.
__device__ __forceinline__ bf16 bf16_stochastic(float x, std::uint32_t random16) {
    if (isnan(x)) return __float2bfloat16_rn(x);
    const std::uint32_t bits = __float_as_uint(x) + random16;
    return __ushort_as_bfloat16(static_cast<unsigned short>(bits >> 16));
}

// ---- 16-byte vector access ------------------------------------------------
// A chunk of kPack<T> consecutive elements (4 fp32 or 8 bf16): kernels that
// stream rows map elements to threads by whole chunks, and load a chunk with
// one 16-byte access when the row's pointers are 16-byte aligned and the row
// length is a multiple of the chunk (`vector`), else element by element with
// the same mapping (so both paths compute bitwise the same). Elements past
// `end` read as 0 and are not written.
template <class T> constexpr int kPack = 16 / static_cast<int>(sizeof(T));
template <class T> struct alignas(16) Pack {
    T v[kPack<T>];
};

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

template <class T>
__device__ __forceinline__ void load_chunk(float (&out)[kPack<T>], const T* p, std::int64_t begin, std::int64_t end,
                                           bool vector) {
    if (vector) {
        const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(p + begin);
        for (int j = 0; j < kPack<T>; ++j) out[j] = to_float(pack.v[j]);
    } else {
        for (int j = 0; j < kPack<T>; ++j) out[j] = begin + j < end ? to_float(p[begin + j]) : 0.0f;
    }
}

// Stores the chunk rounded to T (round to nearest even).
template <class T>
__device__ __forceinline__ void store_chunk(T* p, const float (&in)[kPack<T>], std::int64_t begin, std::int64_t end,
                                            bool vector) {
    if (vector) {
        Pack<T> pack;
        for (int j = 0; j < kPack<T>; ++j) pack.v[j] = from_float<T>(in[j]);
        *reinterpret_cast<Pack<T>*>(p + begin) = pack;
    } else {
        for (int j = 0; j < kPack<T>; ++j)
            if (begin + j < end) p[begin + j] = from_float<T>(in[j]);
    }
}

// x rounded to T and back: what a kernel that stores x and reloads it sees.
template <class T> __device__ __forceinline__ float rounded(float x) { return to_float(from_float<T>(x)); }

// The larger of m and the largest magnitude of a chunk's first `count`
// values as stored (rounded to T), NaN skipped: what a kernel that writes
// the chunk adds to its output's maximum.
template <class T>
__device__ __forceinline__ float chunk_max(float m, const float (&v)[kPack<T>], std::int64_t count) {
    for (int j = 0; j < kPack<T>; ++j)
        if (j < count) m = fmaxf(m, fabsf(rounded<T>(v[j])));
    return m;
}

// ---- deterministic column sums -------------------------------------------
constexpr int kColumnTile = 32;      // columns per block (one per lane)
constexpr int kColumnRowLanes = 8;   // rows handled in parallel inside a block
constexpr int kMinRowsPerChunk = 64;
constexpr int kMaxColumnChunks = 2048;

inline int column_rows_per_chunk(int rows) {
    const int spread = (rows + kMaxColumnChunks - 1) / kMaxColumnChunks;
    return spread > kMinRowsPerChunk ? spread : kMinRowsPerChunk;
}
inline int column_chunks(int rows) {
    const int per_chunk = column_rows_per_chunk(rows);
    return (rows + per_chunk - 1) / per_chunk;
}
// An upper bound of column_chunks(rows) * cols that never decreases with rows,
// so that scratch reserved for the largest shape fits every smaller one.
inline std::size_t column_sums_scratch_floats(int rows, int cols) {
    if (rows <= 0 || cols <= 0) return 0;
    const int chunks = (rows + kMinRowsPerChunk - 1) / kMinRowsPerChunk;
    return static_cast<std::size_t>(chunks < kMaxColumnChunks ? chunks : kMaxColumnChunks) *
           static_cast<std::size_t>(cols);
}

// partial[chunk, c] = sum over the chunk's rows of term(r, c).
template <class Term>
__global__ void __launch_bounds__(kColumnTile * kColumnRowLanes)
    column_chunk_sums_kernel(float* partial, int rows, int cols, int rows_per_chunk, Term term) {
    NANOQ_SHARED(float[kColumnRowLanes][kColumnTile], lane_sums);
    const int c = blockIdx.x * kColumnTile + threadIdx.x;
    const int row_begin = blockIdx.y * rows_per_chunk;
    const int row_end = min(rows, row_begin + rows_per_chunk);
    float acc = 0.0f;
    if (c < cols)
        for (int r = row_begin + threadIdx.y; r < row_end; r += kColumnRowLanes) acc += term(r, c);
    lane_sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float total = 0.0f;
        for (int lane = 0; lane < kColumnRowLanes; ++lane) total += lane_sums[lane][threadIdx.x];
        partial[static_cast<std::int64_t>(blockIdx.y) * cols + c] = total;
    }
}

// out[c] += sum over chunks of partial[chunk, c], chunks in order. A template
// (on the caller's Term) so that it is instantiated only where used.
template <class Term>
__global__ void column_chunks_total_kernel(float* out, const float* partial, int chunks, int cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float total = 0.0f;
    for (int chunk = 0; chunk < chunks; ++chunk) total += partial[static_cast<std::int64_t>(chunk) * cols + c];
    out[c] += total;
}

// A column_sums term: columns first.. of a row-major float matrix with
// `stride` floats per row (blocks' partial sums, one row per block).
struct MatrixColumns {
    const float* data;
    int stride, first;
    __device__ float operator()(int r, int c) const { return data[static_cast<std::int64_t>(r) * stride + first + c]; }
};

// out[c] += sum_r term(r, c) with `scratch` of column_sums_scratch_floats(rows, cols).
template <class Term>
void column_sums(float* out, int rows, int cols, float* scratch, Term term, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return;
    const int per_chunk = column_rows_per_chunk(rows);
    const int chunks = column_chunks(rows);
    const dim3 grid((cols + kColumnTile - 1) / kColumnTile, chunks);
    const dim3 block(kColumnTile, kColumnRowLanes);
    launch(column_chunk_sums_kernel<Term>, grid, block, 0, stream, scratch, rows, cols, per_chunk, term);
    const int threads = 256;
    launch(column_chunks_total_kernel<Term>, (cols + threads - 1) / threads, threads, 0, stream, out, scratch, chunks,
           cols);
}

}  // namespace detail
}  // namespace cuda
}  // namespace nanoq
