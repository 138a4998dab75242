// Token embedding lookup and its gradient.
//
// The backward is deterministic without atomics: the row indices are sorted
// by token with CUB's stable radix sort, so each run of equal tokens lists
// its rows in increasing order; one block per run then adds those rows, in
// that order, onto the table row's current value (the CPU backend's order).
#include <cub/device/device_radix_sort.cuh>

#include "cuda_check.h"
#include "kernel_utils.cuh"
#include "kernels.h"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kScratchAlignment = 256;

std::size_t aligned(std::size_t bytes) {
    return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// Number of low key bits that hold every token in [0, vocab).
int token_bits(int vocab) {
    int bits = 1;
    while (bits < 31 && (1u << bits) < static_cast<unsigned>(vocab)) ++bits;
    return bits;
}

// An upper bound of CUB's radix-sort storage for `rows` int32 pairs, for
// when CUB cannot be asked (it needs a device): twice the alternate key and
// value buffers (8 bytes per pair) that both of its sorts (onesweep and
// multi-pass) allocate, plus 64 KiB for digit histograms and counters. By
// our reading of CUB 2.x/3.x the histograms, lookback and spine stay well
// below 8 bytes per pair plus 64 KiB (CUB 3.0 on sm_90 asks 70143 bytes for
// 8192 pairs over 18 bits); CUB itself promises no bound, so a figure from
// here is reported as inexact.
std::size_t sort_temp_bound(int rows) {
    return 2 * 2 * sizeof(std::int32_t) * static_cast<std::size_t>(rows) + (std::size_t(64) << 10);
}

// CUB's temporary storage for the sort, as CUB reports it for the current
// device; its bound when CUB cannot report it or `ask_cub` is false.
std::size_t sort_temp_bytes(int rows, int vocab, bool ask_cub, bool* exact) {
    if (ask_cub) {
        std::size_t bytes = 0;
        const cudaError_t status = cub::DeviceRadixSort::SortPairs(
            nullptr, bytes, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
            static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), rows, 0,
            token_bits(vocab));
        if (status == cudaSuccess) return bytes;
        cudaGetLastError();  // no usable device: clear the error and count the bound
    }
    if (exact) *exact = false;
    return sort_temp_bound(rows);
}

// Scratch: sorted tokens, row indices before and after the sort, CUB temp.
struct EmbeddingScratch {
    std::int32_t* sorted_tokens;
    std::int32_t* row_ids;
    std::int32_t* sorted_rows;
    void* sort_temp;
    std::size_t sort_temp_bytes;
};

EmbeddingScratch split_scratch(void* scratch, int rows, int vocab) {
    const std::size_t index_bytes = aligned(sizeof(std::int32_t) * static_cast<std::size_t>(rows));
    char* base = static_cast<char*>(scratch);
    return {reinterpret_cast<std::int32_t*>(base), reinterpret_cast<std::int32_t*>(base + index_bytes),
            reinterpret_cast<std::int32_t*>(base + 2 * index_bytes), base + 3 * index_bytes,
            sort_temp_bytes(rows, vocab, true, nullptr)};
}

template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* tokens, const T* table, std::int64_t n,
                                         int channels) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step()) {
        const std::int64_t row = i / channels;
        const int c = static_cast<int>(i - row * channels);
        out[i] = table[static_cast<std::int64_t>(tokens[row]) * channels + c];
    }
}

__global__ void iota_kernel(std::int32_t* values, int n) {
    for (std::int64_t i = detail::grid_stride_begin(); i < n; i += detail::grid_stride_step())
        values[i] = static_cast<std::int32_t>(i);
}

// Block i handles the run of equal tokens starting at sorted position i (and
// exits when position i is not the start of a run).
template <class T>
__global__ void embedding_backward_kernel(float* table_grad, const T* dout, const std::int32_t* sorted_tokens,
                                          const std::int32_t* sorted_rows, int rows, int channels) {
    const int run_begin = blockIdx.x;
    const std::int32_t token = sorted_tokens[run_begin];
    if (run_begin > 0 && sorted_tokens[run_begin - 1] == token) return;
    // The run ends at the first later position with another token.
    NANOQ_SHARED(int, first_other);
    if (threadIdx.x == 0) first_other = rows;
    __syncthreads();
    for (int base = run_begin + 1; base < rows; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool other = i < rows && sorted_tokens[i] != token;
        if (other) atomicMin(&first_other, i);
        if (__syncthreads_or(other)) break;
    }
    const int run_end = first_other;
    float* grad_row = table_grad + static_cast<std::int64_t>(token) * channels;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        float acc = grad_row[c];
        for (int i = run_begin; i < run_end; ++i)
            acc += detail::to_float(dout[static_cast<std::int64_t>(sorted_rows[i]) * channels + c]);
        grad_row[c] = acc;
    }
}

}  // namespace

template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* table, int rows, int channels,
                       cudaStream_t stream) {
    const std::int64_t n = static_cast<std::int64_t>(rows) * channels;
    if (n <= 0) return;
    detail::launch(embedding_forward_kernel<T>, detail::grid_stride_blocks(n, kThreads), kThreads, 0, stream, out, tokens, table,
                                                                                                  n, channels);
}

template <class T>
void embedding_backward(float* table_grad, const T* dout, const std::int32_t* tokens, int rows, int channels,
                        int vocab, void* scratch, cudaStream_t stream) {
    if (rows <= 0 || channels <= 0) return;
    EmbeddingScratch s = split_scratch(scratch, rows, vocab);
    detail::launch(iota_kernel, detail::grid_stride_blocks(rows, kThreads), kThreads, 0, stream, s.row_ids, rows);
    // Its status too: a temporary storage found too small is returned, not left for cudaGetLastError.
    NANOQ_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.sort_temp, s.sort_temp_bytes, tokens, s.sorted_tokens,
                                                     s.row_ids, s.sorted_rows, rows, 0, token_bits(vocab), stream));
    detail::launch(embedding_backward_kernel<T>, rows, kThreads, 0, stream, table_grad, dout, s.sorted_tokens, s.sorted_rows,
                                                                rows, channels);
}

std::size_t embedding_backward_scratch_bytes(int rows, int vocab, bool ask_cub, bool* exact) {
    if (rows <= 0) return 0;
    return 3 * aligned(sizeof(std::int32_t) * static_cast<std::size_t>(rows)) +
           sort_temp_bytes(rows, vocab, ask_cub, exact);
}

#define NANOQ_INSTANTIATE(T)                                                                                   \
    template void embedding_forward<T>(T*, const std::int32_t*, const T*, int, int, cudaStream_t);             \
    template void embedding_backward<T>(float*, const T*, const std::int32_t*, int, int, int, void*, cudaStream_t);
NANOQ_INSTANTIATE(float)
NANOQ_INSTANTIATE(bf16)
#undef NANOQ_INSTANTIATE

}  // namespace cuda
}  // namespace nanoq
