// Qwen3's per-head q/k RMSNorms and RoPE in one pass over q and k.
//
// One launch covers the head rows of q and then of k (a head row is the
// head_dim values of one head at one position). A head row belongs to a
// group of `lanes` consecutive threads of a warp (a power of two, at most
// 32): lane l owns the rotated pairs [l * P, l * P + P) of the half-split
// convention, i.e. the chunks x[l * P ...] and x[D/2 + l * P ...], loaded
// with 16-byte accesses when aligned (kernel_utils.cuh). The group reduces
// its sums of squares (forward) or dot products (backward) with shuffles,
// so no barrier is needed, and every lane writes only the elements it read,
// which makes the in-place updates safe.
//
// The arithmetic, including the rounding to T between the norm and the
// rotation, is that of rmsnorm_forward followed by rope_forward (backward:
// rope_backward then rmsnorm_backward), so the fused pass differs from the
// composition only in the order of the row sums. The backward's norm weight
// gradients are deterministic: a fixed grid, partial sums reduced across the
// groups of a warp by shuffles, across warps in shared memory and across
// blocks in block order by the deterministic column sums (kernel_utils.cuh).
//
// The packed q|k|v projection (cuda_backend.cpp) runs one matmul into a
// packed [rows, (H + 2 Hkv) * D] buffer; the same passes then read their
// input from it through a row stride (forward: q, k normed and rotated, the
// raw projections and v copied out) or write their output into it (backward:
// dq, dk and dv packed for the one dgrad and one wgrad matmul). A v head
// row is a plain copy: it takes part in no norm and no rotation.
#include <algorithm>

#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / detail::kWarpSize;
constexpr int kMaxHeadDim = 256;
constexpr int kBackwardBlocks = 512;

// q, k or v. Forward: x [rows * heads, D] is the output, read from `src`
// (a position's heads at src + position * src_stride, head h at + h * D;
// src may be x itself, then updated in place), with the raw input also
// copied to raw_out where given; rstd and norm are set only with the q/k
// norms. Backward: x is the gradient, updated in place (unless the pass
// only packs), `raw` and `rstd` the saved forward values (norms only), and
// the result also stored at `packed` (with src_stride) where given.
template <class T> struct Side {
    T* x;
    const T* src;
    std::int64_t src_stride;
    T* raw_out;
    const T* raw;
    float* rstd;
    const T* norm;
    T* packed;
    int heads;
    std::int64_t head_rows;
};

// The side of a head row (q rows, then k, then v) and its row within it.
template <class T>
__device__ __forceinline__ const Side<T>& side_of(const Side<T>& q, const Side<T>& k, const Side<T>& v,
                                                  std::int64_t head_row, std::int64_t* row, int* which) {
    if (head_row < q.head_rows) {
        *row = head_row, *which = 0;
        return q;
    }
    if (head_row < q.head_rows + k.head_rows) {
        *row = head_row - q.head_rows, *which = 1;
        return k;
    }
    *row = head_row - q.head_rows - k.head_rows, *which = 2;
    return v;
}

// Where head row `row` of a side lies in its strided source (or packed target).
template <class T>
__device__ __forceinline__ std::int64_t strided_offset(const Side<T>& side, std::int64_t row, int head_dim) {
    return (row / side.heads) * side.src_stride + (row % side.heads) * head_dim;
}

template <class T> int group_lanes(int half) {
    const int chunks = (half + detail::kPack<T> - 1) / detail::kPack<T>;
    int lanes = 1;
    while (lanes < chunks) lanes *= 2;
    return lanes;
}

__device__ __forceinline__ float group_sum(float x, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(detail::kFullMask, x, offset);
    return x;
}

// Rotates (a, b) pairs by the angles of position t; direction -1 undoes it.
template <int P>
__device__ __forceinline__ void rotate(float (&a)[P], float (&b)[P], const float* cos_sin, int t, int half, int begin,
                                       float direction) {
    const float* cs = cos_sin + (static_cast<std::int64_t>(t) * half + begin) * 2;
    for (int j = 0; j < P; ++j) {
        if (begin + j >= half) break;
        const float c = cs[2 * j], s = direction * cs[2 * j + 1];
        const float x = a[j], y = b[j];
        a[j] = x * c - y * s;
        b[j] = y * c + x * s;
    }
}

// `transform`: q and k are normed (with the norms) and rotated; else every
// side is only copied (a split of the packed projection).
template <class T>
__global__ void __launch_bounds__(kThreads)
    qk_norm_rope_forward_kernel(Side<T> q, Side<T> k, Side<T> v, const float* cos_sin, int time, int half, int lanes,
                                float eps, bool transform, bool vector) {
    constexpr int P = detail::kPack<T>;
    const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const std::int64_t head_row = thread / lanes;
    const int begin = static_cast<int>(thread % lanes) * P;
    std::int64_t row = 0;
    int which = 0;
    const Side<T> side = side_of(q, k, v, head_row, &row, &which);
    const bool active = head_row < q.head_rows + k.head_rows + v.head_rows && begin < half;
    const bool qk = transform && which < 2;
    const std::int64_t offset = row * 2 * half;
    float a[P] = {}, b[P] = {};
    if (active) {
        const T* src = side.src + strided_offset(side, row, 2 * half);
        detail::load_chunk<T>(a, src, begin, half, vector);
        detail::load_chunk<T>(b, src + half, begin, half, vector);
        if (side.raw_out) {
            detail::store_chunk<T>(side.raw_out + offset, a, begin, half, vector);
            detail::store_chunk<T>(side.raw_out + offset + half, b, begin, half, vector);
        }
    }
    if (q.norm) {  // the q/k norms (uniform over the launch: both or neither)
        float sum = 0.0f;
        for (int j = 0; j < P; ++j) sum += a[j] * a[j];
        for (int j = 0; j < P; ++j) sum += b[j] * b[j];
        sum = group_sum(sum, lanes);
        const float scale = 1.0f / sqrtf(sum / (2 * half) + eps);
        if (active && qk) {
            if (begin == 0) side.rstd[row] = scale;
            float wa[P], wb[P];
            detail::load_chunk<T>(wa, side.norm, begin, half, vector);
            detail::load_chunk<T>(wb, side.norm + half, begin, half, vector);
            for (int j = 0; j < P; ++j) {
                a[j] = detail::rounded<T>(wa[j] * (a[j] * scale));
                b[j] = detail::rounded<T>(wb[j] * (b[j] * scale));
            }
        }
    }
    if (!active) return;
    if (qk) rotate<P>(a, b, cos_sin, static_cast<int>((row / side.heads) % time), half, begin, 1.0f);
    detail::store_chunk<T>(side.x + offset, a, begin, half, vector);
    detail::store_chunk<T>(side.x + offset + half, b, begin, half, vector);
}

// Sums v over the groups of the warp (lanes with the same position in their group).
template <int P> __device__ __forceinline__ void warp_groups_sum(float (&v)[P], int lanes) {
    for (int offset = detail::kWarpSize / 2; offset >= lanes; offset /= 2)
        for (int j = 0; j < P; ++j) v[j] += __shfl_xor_sync(detail::kFullMask, v[j], offset);
}

// `transform`: dq and dk are rotated back and (with the norms) taken
// through the norms, in place; else every side is only copied (packed).
// packed_max (with packed sides only): the largest magnitude of what the
// launch stores into packed, as stored (for fp8, kernels.h).
template <class T>
__global__ void __launch_bounds__(kThreads)
    qk_norm_rope_backward_kernel(Side<T> q, Side<T> k, Side<T> v, float* dq_norm, float* dk_norm,
                                 const float* cos_sin, int time, int half, int lanes, bool transform, bool vector,
                                 float* partials, float* packed_max) {
    NANOQ_SHARED(float[kWarps][2][kMaxHeadDim], warp_sums);
    NANOQ_SHARED(float[detail::kWarpSize], maxima);
    constexpr int P = detail::kPack<T>;
    const int head_dim = 2 * half;
    const bool norms = q.raw != nullptr;
    const int begin = static_cast<int>(threadIdx.x % lanes) * P;
    const int groups = blockDim.x / lanes;
    const std::int64_t total = q.head_rows + k.head_rows + v.head_rows;
    // The norm weight gradient partials of this lane's columns: q then k,
    // first half (a) then second half (b).
    float dqa[P] = {}, dqb[P] = {}, dka[P] = {}, dkb[P] = {};
    float m = 0.0f;  // the largest magnitude this thread stored into packed
    // The loop bound depends on the block only, so whole warps iterate together (shuffles).
    for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * groups; first < total;
         first += static_cast<std::int64_t>(gridDim.x) * groups) {
        const std::int64_t head_row = first + threadIdx.x / lanes;
        std::int64_t row = 0;
        int which = 0;
        const Side<T> side = side_of(q, k, v, head_row, &row, &which);
        const bool active = head_row < total && begin < half;
        const bool qk = transform && which < 2;
        const std::int64_t offset = row * head_dim;
        float a[P] = {}, b[P] = {};
        if (active) {
            detail::load_chunk<T>(a, side.x + offset, begin, half, vector);
            detail::load_chunk<T>(b, side.x + offset + half, begin, half, vector);
            if (qk) {
                rotate<P>(a, b, cos_sin, static_cast<int>((row / side.heads) % time), half, begin, -1.0f);
                for (int j = 0; j < P; ++j) {
                    a[j] = detail::rounded<T>(a[j]);
                    b[j] = detail::rounded<T>(b[j]);
                }
            }
        }
        if (norms) {
            float xa[P] = {}, xb[P] = {}, wa[P] = {}, wb[P] = {};
            float scale = 0.0f, dot = 0.0f;
            if (active && qk) {
                detail::load_chunk<T>(xa, side.raw + offset, begin, half, vector);
                detail::load_chunk<T>(xb, side.raw + offset + half, begin, half, vector);
                detail::load_chunk<T>(wa, side.norm, begin, half, vector);
                detail::load_chunk<T>(wb, side.norm + half, begin, half, vector);
                scale = side.rstd[row];
                for (int j = 0; j < P; ++j) dot += a[j] * wa[j] * xa[j] * scale;
                for (int j = 0; j < P; ++j) dot += b[j] * wb[j] * xb[j] * scale;
            }
            dot = group_sum(dot, lanes) / head_dim;
            auto add_weight_grad = [&](float (&dwa)[P], float (&dwb)[P]) {
                for (int j = 0; j < P; ++j) {
                    dwa[j] += a[j] * xa[j] * scale;
                    dwb[j] += b[j] * xb[j] * scale;
                }
            };
            if (active && qk) {
                if (which == 1) add_weight_grad(dka, dkb);
                else add_weight_grad(dqa, dqb);
                for (int j = 0; j < P; ++j) {
                    a[j] = scale * (a[j] * wa[j] - xa[j] * scale * dot);
                    b[j] = scale * (b[j] * wb[j] - xb[j] * scale * dot);
                }
            }
        }
        if (active && qk) {
            detail::store_chunk<T>(side.x + offset, a, begin, half, vector);
            detail::store_chunk<T>(side.x + offset + half, b, begin, half, vector);
        }
        if (active && side.packed) {
            T* packed = side.packed + strided_offset(side, row, head_dim);
            detail::store_chunk<T>(packed, a, begin, half, vector);
            detail::store_chunk<T>(packed + half, b, begin, half, vector);
            if (packed_max) m = detail::chunk_max<T>(detail::chunk_max<T>(m, a, half - begin), b, half - begin);
        }
    }
    if (packed_max) detail::block_max_into(packed_max, m, maxima);  // the launch's: all threads or none
    if (!norms) return;
    warp_groups_sum<P>(dqa, lanes);
    warp_groups_sum<P>(dqb, lanes);
    warp_groups_sum<P>(dka, lanes);
    warp_groups_sum<P>(dkb, lanes);
    const int warp = threadIdx.x / detail::kWarpSize;
    if (static_cast<int>(threadIdx.x % detail::kWarpSize) < lanes)  // the warp's first group holds its sums
        for (int j = 0; j < P && begin + j < half; ++j) {
            warp_sums[warp][0][begin + j] = dqa[j];
            warp_sums[warp][0][half + begin + j] = dqb[j];
            warp_sums[warp][1][begin + j] = dka[j];
            warp_sums[warp][1][half + begin + j] = dkb[j];
        }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * head_dim; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < kWarps; ++w) sum += warp_sums[w][c / head_dim][c % head_dim];
        partials[static_cast<std::int64_t>(blockIdx.x) * 2 * head_dim + c] = sum;
    }
}


template <class T> bool sides_vectorizable(const Side<T>& q, const Side<T>& k, const Side<T>& v, int half) {
    if (half % detail::kPack<T> != 0) return false;
    for (const Side<T>* side : {&q, &k, &v}) {
        if (side->src_stride % detail::kPack<T> != 0) return false;
        for (const void* p : {static_cast<const void*>(side->x), static_cast<const void*>(side->src),
                              static_cast<const void*>(side->raw_out), static_cast<const void*>(side->raw),
                              static_cast<const void*>(side->norm), static_cast<const void*>(side->packed)})
            if (p && !detail::aligned16(p)) return false;
    }
    return true;
}

int backward_blocks(std::int64_t head_rows, int lanes) {
    const std::int64_t groups = kThreads / lanes;
    return static_cast<int>(std::min<std::int64_t>((head_rows + groups - 1) / groups, kBackwardBlocks));
}

// The rows and heads of a packed q|k|v layout.
struct SideShape {
    std::int64_t rows;
    int heads, kv_heads, head_dim;
    std::int64_t packed_stride() const { return std::int64_t(heads + 2 * kv_heads) * head_dim; }
};

template <class T>
void launch_forward(const Side<T>& q, const Side<T>& k, const Side<T>& v, const float* cos_sin, int time,
                    int head_dim, float eps, bool transform, cudaStream_t stream) {
    const int half = head_dim / 2, lanes = group_lanes<T>(half);
    const std::int64_t threads = (q.head_rows + k.head_rows + v.head_rows) * lanes;
    if (threads <= 0) return;
    detail::launch(qk_norm_rope_forward_kernel<T>, static_cast<int>((threads + kThreads - 1) / kThreads), kThreads, 0,
                   stream, q, k, v, cos_sin, time, half, lanes, eps, transform, sides_vectorizable(q, k, v, half));
}

template <class T>
void launch_backward(const Side<T>& q, const Side<T>& k, const Side<T>& v, float* dq_norm, float* dk_norm,
                     const float* cos_sin, int time, int head_dim, bool transform, void* scratch, float* packed_max,
                     cudaStream_t stream) {
    const int half = head_dim / 2, lanes = group_lanes<T>(half);
    const std::int64_t head_rows = q.head_rows + k.head_rows + v.head_rows;
    if (head_rows <= 0) return;
    const int blocks = backward_blocks(head_rows, lanes);
    float* partials = q.raw ? static_cast<float*>(scratch) : nullptr;  // [blocks, 2 head_dim], then the sums'
    detail::launch(qk_norm_rope_backward_kernel<T>, blocks, kThreads, 0, stream, q, k, v, dq_norm, dk_norm, cos_sin,
                   time, half, lanes, transform, sides_vectorizable(q, k, v, half), partials,
                   q.packed ? packed_max : nullptr);
    if (!partials) return;
    // The partials' q columns into dq_norm, then the k columns into dk_norm
    // (in stream order: they share the sums' scratch).
    float* sums = partials + static_cast<std::int64_t>(blocks) * 2 * head_dim;
    detail::column_sums(dq_norm, blocks, head_dim, sums, detail::MatrixColumns{partials, 2 * head_dim, 0}, stream);
    detail::column_sums(dk_norm, blocks, head_dim, sums, detail::MatrixColumns{partials, 2 * head_dim, head_dim},
                        stream);
}

}  // namespace

template <class T> bool qk_norm_rope_supported(int head_dim) {
    return head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim &&
           group_lanes<T>(head_dim / 2) <= detail::kWarpSize;
}

template <class T>
void qk_norm_rope_forward(T* q, T* k, float* q_rstd, float* k_rstd, const T* q_raw, const T* k_raw,
                          const T* q_norm, const T* k_norm, const float* cos_sin, int batch, int time, int heads,
                          int kv_heads, int head_dim, float eps, cudaStream_t stream) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * time;
    const std::int64_t q_width = std::int64_t(heads) * head_dim, kv_width = std::int64_t(kv_heads) * head_dim;
    const Side<T> qs{q, q_raw ? q_raw : q, q_width, nullptr, nullptr, q_rstd, q_norm, nullptr, heads, rows * heads};
    const Side<T> ks{k, k_raw ? k_raw : k, kv_width, nullptr, nullptr, k_rstd, k_norm, nullptr, kv_heads,
                     rows * kv_heads};
    const Side<T> none{nullptr, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 0};
    launch_forward(qs, ks, none, cos_sin, time, head_dim, eps, true, stream);
}

template <class T>
void qkv_unpack_forward(const T* packed, T* q, T* k, T* v, T* q_raw, T* k_raw, float* q_rstd, float* k_rstd,
                        const T* q_norm, const T* k_norm, const float* cos_sin, int batch, int time, int heads,
                        int kv_heads, int head_dim, float eps, cudaStream_t stream) {
    const SideShape s{static_cast<std::int64_t>(batch) * time, heads, kv_heads, head_dim};
    const std::int64_t stride = s.packed_stride(), q_width = std::int64_t(heads) * head_dim;
    const std::int64_t kv_width = std::int64_t(kv_heads) * head_dim;
    const bool transform = cos_sin != nullptr, norms = transform && q_norm;
    const Side<T> qs{q, packed, stride, norms ? q_raw : nullptr, nullptr, q_rstd, norms ? q_norm : nullptr, nullptr,
                     heads, s.rows * heads};
    const Side<T> ks{k, packed + q_width, stride, norms ? k_raw : nullptr, nullptr, k_rstd,
                     norms ? k_norm : nullptr, nullptr, kv_heads, s.rows * kv_heads};
    const Side<T> vs{v, packed + q_width + kv_width, stride, nullptr, nullptr, nullptr, nullptr, nullptr, kv_heads,
                     s.rows * kv_heads};
    launch_forward(qs, ks, vs, cos_sin, time, head_dim, eps, transform, stream);
}

template <class T>
void qkv_pack_backward(T* packed, T* dq, T* dk, const T* dv, float* dq_norm, float* dk_norm, const T* q_raw,
                       const T* k_raw, const float* q_rstd, const float* k_rstd, const T* q_norm, const T* k_norm,
                       const float* cos_sin, int batch, int time, int heads, int kv_heads, int head_dim,
                       void* scratch, float* packed_max, cudaStream_t stream) {
    const SideShape s{static_cast<std::int64_t>(batch) * time, heads, kv_heads, head_dim};
    const std::int64_t stride = s.packed_stride(), q_width = std::int64_t(heads) * head_dim;
    const std::int64_t kv_width = std::int64_t(kv_heads) * head_dim;
    const bool transform = cos_sin != nullptr, norms = transform && q_raw;
    auto at = [&](std::int64_t column) { return packed ? packed + column : nullptr; };
    // rstd is only read here; dv too (the v side is only copied).
    const Side<T> qs{dq, nullptr, stride, nullptr, norms ? q_raw : nullptr, const_cast<float*>(q_rstd), q_norm,
                     at(0), heads, s.rows * heads};
    const Side<T> ks{dk, nullptr, stride, nullptr, norms ? k_raw : nullptr, const_cast<float*>(k_rstd), k_norm,
                     at(q_width), kv_heads, s.rows * kv_heads};
    const Side<T> vs{const_cast<T*>(dv), nullptr, stride, nullptr, nullptr, nullptr, nullptr, at(q_width + kv_width),
                     kv_heads, dv ? s.rows * kv_heads : 0};
    launch_backward(qs, ks, vs, dq_norm, dk_norm, cos_sin, time, head_dim, transform, scratch, packed_max, stream);
}

std::size_t qk_norm_rope_backward_scratch_bytes(int batch, int time, int heads, int kv_heads, int head_dim) {
    // The head rows of q, k and v (qkv_pack_backward's launch covers v too).
    const std::int64_t head_rows = static_cast<std::int64_t>(batch) * time * (heads + 2 * kv_heads);
    if (head_rows <= 0 || head_dim <= 0) return 0;
    // More lanes per group (fp32) make more blocks.
    const int lanes = std::max(group_lanes<float>(head_dim / 2), group_lanes<bf16>(head_dim / 2));
    const int blocks = backward_blocks(head_rows, lanes);
    return sizeof(float) * (static_cast<std::size_t>(blocks) * 2 * head_dim +
                            detail::column_sums_scratch_floats(blocks, head_dim));
}

#define NANOQ_INSTANTIATE(T)                                                                                          \
    template bool qk_norm_rope_supported<T>(int);                                                                    \
    template void qk_norm_rope_forward<T>(T*, T*, float*, float*, const T*, const T*, const T*, const T*,            \
                                          const float*, int, int, int, int, int, float, cudaStream_t);               \
    template void qkv_unpack_forward<T>(const T*, T*, T*, T*, T*, T*, float*, float*, const T*, const T*,            \
                                        const float*, int, int, int, int, int, float, cudaStream_t);                 \
    template void qkv_pack_backward<T>(T*, T*, T*, const T*, float*, float*, const T*, const T*, const float*,       \
                                       const float*, const T*, const T*, const float*, int, int, int, int, int,      \
                                       void*, float*, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
