// Attention with grouped kv heads: tiled online-softmax forward, and a
// backward in three kernels (delta = rowsum(dO * O), dq, then dk/dv) without
// atomics. Causal by default; Layout::causal false attends every key, and
// Layout::positions (per-token positions in packed documents) narrows the
// causal window of query t to keys t - positions[t] .. t. Key tiles past
// the diagonal are skipped only in the causal case, and with positions so
// are the tile pairs that documents mask wholly (key tiles before the
// earliest document start of a query tile): packed short documents cost
// about their own squares, not the row's. A row may still see no key in a
// tile (before its document starts), which the online softmax treats as a
// no-op.
//
// Tiles are 32 queries by 32 keys, so a lane owns one key (forward, dq) or
// one query (dk/dv) of the tile when computing scores: a block stages one
// [32, head_dim] tile of K, V, Q or dO in shared memory as fp32 (rows padded
// by one float so that 32 lanes reading 32 different rows hit distinct banks),
// while each warp keeps its few rows of q/dO (or k/v) and its fp32
// accumulators in registers, distributed as value[c] = row[32 * c + lane].
// Head dims are padded with zeros up to the kernel's compile-time maximum
// (64, 128 or 256), which keeps every loop fully unrolled and exact.
// dk/dv blocks own a key tile and walk the heads of their group, then the
// query tiles, in order: the sums have a fixed order.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;

constexpr int kTile = kAttentionQueryTile;  // queries per query tile, keys per key tile: one per lane
static_assert(kTile == kWarpSize, "a lane owns one key (or query) of a tile");

template <int kMaxD> struct Shape {
    static constexpr int kRows = kMaxD > 128 ? 2 : 4;  // register rows per warp
    static constexpr int kWarps = kTile / kRows;
    static constexpr int kThreads = kWarps * kWarpSize;
    static constexpr int kChunks = kMaxD / kWarpSize;  // values per lane of a row
    static constexpr int kStride = kMaxD + 1;          // shared-memory row pitch
};

struct Layout {
    int time, heads, kv_heads, head_dim;
    float scale;
    bool causal;
    const std::int32_t* positions;  // [B, T] or null
    __device__ std::int64_t q_stride() const { return static_cast<std::int64_t>(heads) * head_dim; }
    __device__ std::int64_t kv_stride() const { return static_cast<std::int64_t>(kv_heads) * head_dim; }
    // The last key tile a query tile sees.
    __device__ int last_key_tile(int query_tile) const {
        return causal ? query_tile : (time + kTile - 1) / kTile - 1;
    }
    // The first key tile any query of query tile `query_tile` of row b
    // sees: with positions, the tile of the earliest document start among
    // its queries. Every key tile before it is masked for the whole query
    // tile, and skipping one leaves the online softmax and the gradients as
    // they were (its probabilities are all 0).
    __device__ int first_key_tile(int b, int query_tile) const {
        if (!causal || !positions) return 0;
        const std::int64_t start = earliest_start(b, query_tile);
        return start > 0 ? static_cast<int>(start / kTile) : 0;
    }
    // Whether no query of query tile `query_tile` of row b sees a key of
    // key tile `key_tile` because its document starts after that tile
    // (the causal mask aside).
    __device__ bool documents_hide(int b, int query_tile, int key_tile) const {
        return causal && positions && earliest_start(b, query_tile) >= std::int64_t(key_tile + 1) * kTile;
    }
    // The earliest document start t - positions[t] among the queries t of
    // query tile `query_tile` of row b (each lane reads one; rows past the
    // end start none), the same in every warp of a block.
    __device__ std::int64_t earliest_start(int b, int query_tile) const {
        const int query = query_tile * kTile + static_cast<int>(threadIdx.x % kWarpSize);
        std::int64_t start = query < time ? std::int64_t(query) - positions[std::int64_t(b) * time + query]
                                          : std::int64_t(time);
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
            const std::int64_t other = __shfl_xor_sync(kFullMask, start, offset);
            start = other < start ? other : start;
        }
        return start;
    }
    // Whether query `query` of row b attends key `key` (both < time, or
    // the query past the end, whose results are dropped).
    __device__ bool visible(int b, int query, int key) const {
        if (!causal) return key < time;
        if (key > query) return false;
        if (!positions || query >= time) return true;
        return key >= query - positions[static_cast<std::int64_t>(b) * time + query];
    }
};

// tile[row, d] = src[(first_row + row) * row_stride + d], zero outside time x head_dim.
template <int kMaxD, class T>
__device__ __forceinline__ void load_tile(detail::smem_ptr<float> tile, const T* src, std::int64_t row_stride, int first_row, int time,
                                          int head_dim) {
    for (int i = threadIdx.x; i < kTile * kMaxD; i += blockDim.x) {
        const int row = i / kMaxD, d = i % kMaxD;
        const int t = first_row + row;
        tile[row * Shape<kMaxD>::kStride + d] =
            t < time && d < head_dim ? detail::to_float(src[static_cast<std::int64_t>(t) * row_stride + d]) : 0.0f;
    }
}

template <int kChunks, class T>
__device__ __forceinline__ void load_row(float (&values)[kChunks], const T* row, bool valid, int head_dim) {
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int d = c * kWarpSize + lane;
        values[c] = valid && d < head_dim ? detail::to_float(row[d]) : 0.0f;
    }
}

template <int kChunks, class T>
__device__ __forceinline__ void store_row(T* row, const float (&values)[kChunks], float divisor, int head_dim) {
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int d = c * kWarpSize + lane;
        if (d < head_dim) row[d] = detail::from_float<T>(values[c] / divisor);
    }
}

// out[r] = dot(rows[r], tile[lane]): each lane gets the products of the
// warp's register rows with the tile row of its own index.
template <int kMaxD, int kRows>
__device__ __forceinline__ void dot_with_lane_row(float (&out)[kRows],
                                                  const float (&rows)[kRows][Shape<kMaxD>::kChunks],
                                                  detail::smem_ptr<const float> tile) {
    const detail::smem_ptr<const float> own_row = tile + (threadIdx.x % kWarpSize) * Shape<kMaxD>::kStride;
#pragma unroll
    for (int r = 0; r < kRows; ++r) out[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < Shape<kMaxD>::kChunks; ++c) {
#pragma unroll
        for (int src = 0; src < kWarpSize; ++src) {
            const float t = own_row[c * kWarpSize + src];
#pragma unroll
            for (int r = 0; r < kRows; ++r) out[r] += __shfl_sync(kFullMask, rows[r][c], src) * t;
        }
    }
}

// acc[r] += sum_j weights[r] (of lane j) * tile[j]: the weighted sum of the
// tile rows, in increasing j.
template <int kMaxD, int kRows>
__device__ __forceinline__ void accumulate_weighted_rows(float (&acc)[kRows][Shape<kMaxD>::kChunks],
                                                         const float (&weights)[kRows],
                                                         detail::smem_ptr<const float> tile) {
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll 4
    for (int j = 0; j < kTile; ++j) {
        const detail::smem_ptr<const float> row = tile + j * Shape<kMaxD>::kStride;
        float w[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) w[r] = __shfl_sync(kFullMask, weights[r], j);
#pragma unroll
        for (int c = 0; c < Shape<kMaxD>::kChunks; ++c) {
            const float t = row[c * kWarpSize + lane];
#pragma unroll
            for (int r = 0; r < kRows; ++r) acc[r][c] += w[r] * t;
        }
    }
}

// Grid (query tiles from first_tile on, heads, batch); a warp owns kRows
// consecutive queries.
template <class T, int kMaxD>
__global__ void __launch_bounds__(Shape<kMaxD>::kThreads)
    attention_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, Layout layout, int first_tile) {
    using S = Shape<kMaxD>;
    NANOQ_SHARED(float[kTile * S::kStride], tile);
    const int query_tile = first_tile + gridDim.x - 1 - blockIdx.x;  // the longest blocks start first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kv_head = h / (layout.heads / layout.kv_heads);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const std::int64_t q_stride = layout.q_stride(), kv_stride = layout.kv_stride();
    const std::int64_t q_offset = static_cast<std::int64_t>(b) * layout.time * q_stride +
                                  static_cast<std::int64_t>(h) * layout.head_dim;
    const std::int64_t kv_offset = static_cast<std::int64_t>(b) * layout.time * kv_stride +
                                   static_cast<std::int64_t>(kv_head) * layout.head_dim;
    const int first_query = query_tile * kTile + warp * S::kRows;

    float q_rows[S::kRows][S::kChunks], acc[S::kRows][S::kChunks], row_max[S::kRows], row_sum[S::kRows];
#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_query + r;
        load_row(q_rows[r], q + q_offset + t * q_stride, t < layout.time, layout.head_dim);
#pragma unroll
        for (int c = 0; c < S::kChunks; ++c) acc[r][c] = 0.0f;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }

    for (int key_tile = layout.first_key_tile(b, query_tile); key_tile <= layout.last_key_tile(query_tile);
         ++key_tile) {
        const int key = key_tile * kTile + lane;
        __syncthreads();
        load_tile<kMaxD>(tile, k + kv_offset, kv_stride, key_tile * kTile, layout.time, layout.head_dim);
        __syncthreads();
        float p[S::kRows];
        dot_with_lane_row<kMaxD>(p, q_rows, tile);
#pragma unroll
        for (int r = 0; r < S::kRows; ++r) {
            const float score = layout.visible(b, first_query + r, key) ? p[r] * layout.scale : -INFINITY;
            const float new_max = fmaxf(row_max[r], detail::warp_max(score));
            // Without positions, key tile 0 is visible to every query, so
            // new_max is finite; a row whose document starts later sees no key yet.
            const bool none_yet = new_max == -INFINITY;
            const float correction = none_yet ? 1.0f : expf(row_max[r] - new_max);
            p[r] = none_yet ? 0.0f : expf(score - new_max);
            row_sum[r] = row_sum[r] * correction + detail::warp_sum(p[r]);
#pragma unroll
            for (int c = 0; c < S::kChunks; ++c) acc[r][c] *= correction;
            row_max[r] = new_max;
        }
        __syncthreads();
        load_tile<kMaxD>(tile, v + kv_offset, kv_stride, key_tile * kTile, layout.time, layout.head_dim);
        __syncthreads();
        accumulate_weighted_rows<kMaxD>(acc, p, tile);
    }

    float* lse_head = lse + (static_cast<std::int64_t>(b) * layout.heads + h) * layout.time;
#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_query + r;
        if (t >= layout.time) continue;
        store_row(out + q_offset + t * q_stride, acc[r], row_sum[r], layout.head_dim);
        if (lane == 0) lse_head[t] = row_max[r] + logf(row_sum[r]);
    }
}

// delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d]; one warp per (b, t, h).
template <class T>
__global__ void attention_delta_kernel(float* delta, const T* dout, const T* out, std::int64_t rows, int time,
                                       int heads, int head_dim) {
    const int lane = threadIdx.x % kWarpSize;
    const std::int64_t warps = detail::grid_stride_step() / kWarpSize;
    for (std::int64_t row = detail::grid_stride_begin() / kWarpSize; row < rows; row += warps) {
        const T* o = out + row * head_dim;
        const T* d_o = dout + row * head_dim;
        float acc = 0.0f;
        for (int i = lane; i < head_dim; i += kWarpSize) acc += detail::to_float(d_o[i]) * detail::to_float(o[i]);
        acc = detail::warp_sum(acc);
        if (lane == 0) {
            const int h = static_cast<int>(row % heads);
            const std::int64_t bt = row / heads;
            const std::int64_t b = bt / time, t = bt % time;
            delta[(b * heads + h) * time + t] = acc;
        }
    }
}

// Grid (query tiles, heads, batch): dq of a warp's kRows queries, over the
// key tiles up to the diagonal, recomputing the probabilities from lse.
template <class T, int kMaxD>
__global__ void __launch_bounds__(Shape<kMaxD>::kThreads)
    attention_backward_dq_kernel(T* dq, const T* dout, const float* lse, const float* delta, const T* q, const T* k,
                                 const T* v, Layout layout) {
    using S = Shape<kMaxD>;
    NANOQ_SHARED(float[kTile * S::kStride], tile);
    const int query_tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kv_head = h / (layout.heads / layout.kv_heads);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const std::int64_t q_stride = layout.q_stride(), kv_stride = layout.kv_stride();
    const std::int64_t q_offset = static_cast<std::int64_t>(b) * layout.time * q_stride +
                                  static_cast<std::int64_t>(h) * layout.head_dim;
    const std::int64_t kv_offset = static_cast<std::int64_t>(b) * layout.time * kv_stride +
                                   static_cast<std::int64_t>(kv_head) * layout.head_dim;
    const std::int64_t lse_offset = (static_cast<std::int64_t>(b) * layout.heads + h) * layout.time;
    const int first_query = query_tile * kTile + warp * S::kRows;

    float q_rows[S::kRows][S::kChunks], dout_rows[S::kRows][S::kChunks], dq_acc[S::kRows][S::kChunks];
    float row_lse[S::kRows], row_delta[S::kRows];
#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_query + r;
        const bool valid = t < layout.time;
        load_row(q_rows[r], q + q_offset + t * q_stride, valid, layout.head_dim);
        load_row(dout_rows[r], dout + q_offset + t * q_stride, valid, layout.head_dim);
#pragma unroll
        for (int c = 0; c < S::kChunks; ++c) dq_acc[r][c] = 0.0f;
        row_lse[r] = valid ? lse[lse_offset + t] : 0.0f;
        row_delta[r] = valid ? delta[lse_offset + t] : 0.0f;
    }

    for (int key_tile = layout.first_key_tile(b, query_tile); key_tile <= layout.last_key_tile(query_tile);
         ++key_tile) {
        const int key = key_tile * kTile + lane;
        __syncthreads();
        load_tile<kMaxD>(tile, k + kv_offset, kv_stride, key_tile * kTile, layout.time, layout.head_dim);
        __syncthreads();
        float p[S::kRows];
        dot_with_lane_row<kMaxD>(p, q_rows, tile);
#pragma unroll
        for (int r = 0; r < S::kRows; ++r)
            p[r] = layout.visible(b, first_query + r, key) ? expf(p[r] * layout.scale - row_lse[r]) : 0.0f;
        __syncthreads();
        load_tile<kMaxD>(tile, v + kv_offset, kv_stride, key_tile * kTile, layout.time, layout.head_dim);
        __syncthreads();
        float dscore[S::kRows];
        dot_with_lane_row<kMaxD>(dscore, dout_rows, tile);
#pragma unroll
        for (int r = 0; r < S::kRows; ++r) dscore[r] = p[r] * (dscore[r] - row_delta[r]) * layout.scale;
        __syncthreads();
        load_tile<kMaxD>(tile, k + kv_offset, kv_stride, key_tile * kTile, layout.time, layout.head_dim);
        __syncthreads();
        accumulate_weighted_rows<kMaxD>(dq_acc, dscore, tile);
    }

#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_query + r;
        if (t < layout.time) store_row(dq + q_offset + t * q_stride, dq_acc[r], 1.0f, layout.head_dim);
    }
}

// Grid (key tiles, kv heads, batch): dk and dv of a warp's kRows keys, over
// the heads of the group in order and, for each, the query tiles from the
// diagonal on; a lane owns one query of the staged tile.
template <class T, int kMaxD>
__global__ void __launch_bounds__(Shape<kMaxD>::kThreads)
    attention_backward_dkdv_kernel(T* dk, T* dv, const T* dout, const float* lse, const float* delta, const T* q,
                                   const T* k, const T* v, Layout layout) {
    using S = Shape<kMaxD>;
    NANOQ_SHARED(float[kTile * S::kStride], tile);
    const int key_tile = blockIdx.x;
    const int kv_head = blockIdx.y, b = blockIdx.z;
    const int group = layout.heads / layout.kv_heads;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const std::int64_t q_stride = layout.q_stride(), kv_stride = layout.kv_stride();
    const std::int64_t kv_offset = static_cast<std::int64_t>(b) * layout.time * kv_stride +
                                   static_cast<std::int64_t>(kv_head) * layout.head_dim;
    const int first_key = key_tile * kTile + warp * S::kRows;
    const int query_tiles = (layout.time + kTile - 1) / kTile;

    float k_rows[S::kRows][S::kChunks], v_rows[S::kRows][S::kChunks];
    float dk_acc[S::kRows][S::kChunks], dv_acc[S::kRows][S::kChunks];
#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_key + r;
        const bool valid = t < layout.time;
        load_row(k_rows[r], k + kv_offset + t * kv_stride, valid, layout.head_dim);
        load_row(v_rows[r], v + kv_offset + t * kv_stride, valid, layout.head_dim);
#pragma unroll
        for (int c = 0; c < S::kChunks; ++c) dk_acc[r][c] = dv_acc[r][c] = 0.0f;
    }

    for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        const std::int64_t q_offset = static_cast<std::int64_t>(b) * layout.time * q_stride +
                                      static_cast<std::int64_t>(h) * layout.head_dim;
        const std::int64_t lse_offset = (static_cast<std::int64_t>(b) * layout.heads + h) * layout.time;
        for (int query_tile = layout.causal ? key_tile : 0; query_tile < query_tiles; ++query_tile) {
            if (layout.documents_hide(b, query_tile, key_tile)) continue;  // the same in every warp
            const int query = query_tile * kTile + lane;
            const bool valid_query = query < layout.time;
            const float query_lse = valid_query ? lse[lse_offset + query] : 0.0f;
            const float query_delta = valid_query ? delta[lse_offset + query] : 0.0f;
            __syncthreads();
            load_tile<kMaxD>(tile, q + q_offset, q_stride, query_tile * kTile, layout.time, layout.head_dim);
            __syncthreads();
            float p[S::kRows];
            dot_with_lane_row<kMaxD>(p, k_rows, tile);
#pragma unroll
            for (int r = 0; r < S::kRows; ++r)
                p[r] = valid_query && layout.visible(b, query, first_key + r) ? expf(p[r] * layout.scale - query_lse)
                                                                              : 0.0f;
            __syncthreads();
            load_tile<kMaxD>(tile, dout + q_offset, q_stride, query_tile * kTile, layout.time, layout.head_dim);
            __syncthreads();
            float dscore[S::kRows];
            dot_with_lane_row<kMaxD>(dscore, v_rows, tile);
#pragma unroll
            for (int r = 0; r < S::kRows; ++r) dscore[r] = p[r] * (dscore[r] - query_delta) * layout.scale;
            accumulate_weighted_rows<kMaxD>(dv_acc, p, tile);
            __syncthreads();
            load_tile<kMaxD>(tile, q + q_offset, q_stride, query_tile * kTile, layout.time, layout.head_dim);
            __syncthreads();
            accumulate_weighted_rows<kMaxD>(dk_acc, dscore, tile);
        }
    }

#pragma unroll
    for (int r = 0; r < S::kRows; ++r) {
        const int t = first_key + r;
        if (t >= layout.time) continue;
        store_row(dk + kv_offset + t * kv_stride, dk_acc[r], 1.0f, layout.head_dim);
        store_row(dv + kv_offset + t * kv_stride, dv_acc[r], 1.0f, layout.head_dim);
    }
}

// Calls launch(std::integral_constant<int, kMaxD>) with the smallest
// compiled maximum head dim that fits.
template <class Launch> void with_max_head_dim(int head_dim, Launch launch) {
    if (head_dim <= 64)
        launch(std::integral_constant<int, 64>());
    else if (head_dim <= 128)
        launch(std::integral_constant<int, 128>());
    else
        launch(std::integral_constant<int, 256>());
}

Layout make_layout(int time, int heads, int kv_heads, int head_dim, bool causal, const std::int32_t* positions) {
    return {time, heads, kv_heads, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim)), causal, positions};
}

// One block per row r of the [B*T, T] mask (r = b * T + i: query i of batch
// row b), its threads over the keys in chunks of 8 (16-byte stores where the
// row starts aligned, T % 8 == 0): no division per element.
__global__ void document_mask_bias_kernel(bf16* bias, const std::int32_t* positions, int time, bool vector) {
    constexpr int P = detail::kPack<bf16>;
    const std::int64_t row = blockIdx.x;
    const int query = static_cast<int>(row % time);
    const int first = query - positions[row];  // the first key of the query's document
    bf16* out = bias + row * time;
    for (int k0 = threadIdx.x * P; k0 < time; k0 += blockDim.x * P) {
        float value[P];
        for (int j = 0; j < P; ++j) {
            const int key = k0 + j;
            value[j] = key <= query && key >= first ? 0.0f : kAttentionMasked;
        }
        detail::store_chunk<bf16>(out, value, k0, time, vector && k0 + P <= time);
    }
}

}  // namespace

void document_mask_bias(bf16* bias, const std::int32_t* positions, int batch, int time, cudaStream_t stream) {
    if (batch <= 0 || time <= 0) return;
    const int threads = 128;
    detail::launch(document_mask_bias_kernel, dim3(static_cast<unsigned>(std::int64_t(batch) * time)), threads, 0,
                   stream, bias, positions, time, time % detail::kPack<bf16> == 0 && detail::aligned16(bias));
}

template <class T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, int batch, int time, int heads,
                       int kv_heads, int head_dim, bool causal, const std::int32_t* positions, cudaStream_t stream,
                       int first_query) {
    if (batch <= 0 || time <= 0 || heads <= 0 || head_dim <= 0) return;
    const Layout layout = make_layout(time, heads, kv_heads, head_dim, causal, positions);
    const int tiles = (time + kTile - 1) / kTile;
    const int first_tile = std::min(std::max(first_query, 0), time - 1) / kTile;
    const dim3 grid(tiles - first_tile, heads, batch);
    with_max_head_dim(head_dim, [&](auto max_dim) {
        constexpr int kMaxD = decltype(max_dim)::value;
        detail::launch(attention_forward_kernel<T, kMaxD>, grid, Shape<kMaxD>::kThreads, 0, stream, out, lse, q, k, v, layout,
                       first_tile);
    });
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q,
                        const T* k, const T* v, int batch, int time, int heads, int kv_heads, int head_dim,
                        bool causal, const std::int32_t* positions, void* scratch, cudaStream_t stream) {
    if (batch <= 0 || time <= 0 || heads <= 0 || head_dim <= 0) return;
    const Layout layout = make_layout(time, heads, kv_heads, head_dim, causal, positions);
    float* delta = static_cast<float*>(scratch);
    const std::int64_t rows = static_cast<std::int64_t>(batch) * time * heads;
    const int threads = 256;
    detail::launch(attention_delta_kernel<T>, detail::grid_stride_blocks(rows * kWarpSize, threads), threads, 0, stream, delta, dout, out, rows, time, heads, head_dim);
    const int tiles = (time + kTile - 1) / kTile;
    with_max_head_dim(head_dim, [&](auto max_dim) {
        constexpr int kMaxD = decltype(max_dim)::value;
        constexpr int kThreads = Shape<kMaxD>::kThreads;
        detail::launch(attention_backward_dq_kernel<T, kMaxD>, dim3(tiles, heads, batch), kThreads, 0, stream, dq, dout, lse, delta, q, k, v, layout);
        detail::launch(attention_backward_dkdv_kernel<T, kMaxD>, dim3(tiles, kv_heads, batch), kThreads, 0, stream, dk, dv, dout, lse, delta, q, k, v, layout);
    });
}

std::size_t attention_backward_scratch_bytes(int batch, int time, int heads, int /*kv_heads*/, int /*head_dim*/) {
    if (batch <= 0 || time <= 0 || heads <= 0) return 0;
    return sizeof(float) * static_cast<std::size_t>(batch) * time * heads;
}

#define NANOQ_INSTANTIATE(T)                                                                                        \
    template void attention_forward<T>(T*, float*, const T*, const T*, const T*, int, int, int, int, int, bool,    \
                                       const std::int32_t*, cudaStream_t, int);                                    \
    template void attention_backward<T>(T*, T*, T*, const T*, const T*, const float*, const T*, const T*, const T*, \
                                        int, int, int, int, int, bool, const std::int32_t*, void*, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
