// Launchers of the CUDA kernels, one .cu file per op family (kernels_*.cu).
//
// Plain C++ declarations: pointers and sizes only, no tensors, no backend.
// Every launcher enqueues on `stream` and returns at once; none synchronizes.
// Template parameter T is the activation/weight dtype: float or bf16
// (explicitly instantiated for both in the .cu files). Accumulation is fp32.
// Weight, bias and norm gradients are fp32 and accumulated (+=); activation
// gradients are written (=) unless `accumulate` says otherwise. Every
// reduction runs in a fixed order (no float atomics), so results are bitwise
// reproducible run to run. Shapes are row-major; rows = batch * time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../stat_slots.h"

namespace nanoq {
namespace cuda {

using bf16 = __nv_bfloat16;

// Whether this build has code the current device can run: cudaSuccess, or
// the runtime's error for a kernel (cudaErrorNoKernelImageForDevice where it
// was built for other GPUs' architectures). Never leaves an error pending.
cudaError_t kernel_image_status();

// ---- elementwise (kernels_elementwise.cu) -------------------------------
// T: float, bf16, or double (the statistics).
template <class T> void fill(T* data, float value, std::int64_t n, cudaStream_t stream);
// Round-to-nearest-even casts.
void cast_f32_to_bf16(bf16* out, const float* in, std::int64_t n, cudaStream_t stream);
void cast_bf16_to_f32(float* out, const bf16* in, std::int64_t n, cudaStream_t stream);
template <class T> void add(T* out, const T* a, const T* b, std::int64_t n, cudaStream_t stream);   // out = a + b
template <class T> void accumulate(T* out, const T* a, std::int64_t n, cudaStream_t stream);       // out += a
// out = in * scale, zeroing elements dropped by dropout_keep(s, i, drop) and
// scaling kept ones by 1 / (1 - drop) when drop > 0; out may alias in. The
// mask seed s = dropout_mask_seed(seed, seed_base) (seed_base: device memory or null).
template <class T>
void scale_dropout(T* out, const T* in, float scale, float drop, std::uint64_t seed, const std::uint64_t* seed_base,
                   std::int64_t n, cudaStream_t stream);
// out[r, c] += bias[c]
template <class T> void add_bias(T* out, const T* bias, int rows, int cols, cudaStream_t stream);
// dbias[c] += sum_r dout[r, c]; `scratch` holds bias_backward_scratch_floats(rows, cols) floats.
template <class T>
void bias_backward(float* dbias, const T* dout, int rows, int cols, float* scratch, cudaStream_t stream);
std::size_t bias_backward_scratch_floats(int rows, int cols);

// ---- embedding (kernels_embedding.cu) -----------------------------------
// out[r, :] = table[tokens[r], :]
template <class T>
void embedding_forward(T* out, const std::int32_t* tokens, const T* table, int rows, int channels,
                       cudaStream_t stream);
// table_grad[tokens[r], :] += dout[r, :], each table row summing its rows in
// increasing r. `scratch` holds embedding_backward_scratch_bytes(rows, vocab) bytes.
template <class T>
void embedding_backward(float* table_grad, const T* dout, const std::int32_t* tokens, int rows, int channels,
                        int vocab, void* scratch, cudaStream_t stream);
// Index arrays and CUB's radix-sort storage, as CUB reports it for the
// current device. Where CUB cannot report it (no usable device), or with
// `ask_cub` false, an upper bound of the storage is counted and *exact (when
// given) is set to false.
std::size_t embedding_backward_scratch_bytes(int rows, int vocab, bool ask_cub = true, bool* exact = nullptr);

// ---- rmsnorm (kernels_rmsnorm.cu) ----------------------------------------
// out = weight * inp * rstd, rstd[r] = 1/sqrt(mean(inp[r]^2) + eps) (fp32).
// Channels up to 8192 chunks of 16 bytes (32768 fp32, 65536 bf16);
// InvalidArgument beyond. out_max (a device float, or null): becomes the
// larger of what it held and max|out| as stored, for fp8 (as swiglu_forward's).
template <class T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int rows, int channels, float eps,
                     float* out_max, cudaStream_t stream);
// residual_out = residual + delta (rounded to T; it may alias either), then
// rmsnorm_forward of residual_out in the same kernel, with bitwise its result.
template <class T>
void residual_rmsnorm_forward(T* residual_out, T* out, float* rstd, const T* residual, const T* delta,
                              const T* weight, int rows, int channels, float eps, float* out_max,
                              cudaStream_t stream);
// dinp (+)= d/dinp (dinp may alias dout when !accumulate); dweight += d/dweight.
// One kernel; `scratch` holds rmsnorm_backward_scratch_bytes(rows, channels)
// bytes. dinp_max as rmsnorm_forward's out_max, of dinp as written.
template <class T>
void rmsnorm_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight, const float* rstd,
                      int rows, int channels, bool accumulate, float* dinp_max, void* scratch, cudaStream_t stream);
std::size_t rmsnorm_backward_scratch_bytes(int rows, int channels);

// ---- q/k norms and rope in one pass (kernels_qk_norm_rope.cu) ---------------
// Whether the fused pass handles this head_dim (even, at most 256).
template <class T> bool qk_norm_rope_supported(int head_dim);
// q [B, T, H, D], k [B, T, Hkv, D]. With the q/k norms (q_raw given, and
// then all of k_raw, rstds and norm weights): q = rope(rmsnorm(q_raw) *
// q_norm), rstd [B*T*H] saved, likewise k; without: q, k rotated in place.
template <class T>
void qk_norm_rope_forward(T* q, T* k, float* q_rstd, float* k_rstd, const T* q_raw, const T* k_raw,
                          const T* q_norm, const T* k_norm, const float* cos_sin, int batch, int time, int heads,
                          int kv_heads, int head_dim, float eps, cudaStream_t stream);
// The packed q|k|v projection's pass after its one matmul, one launch:
// from packed [B*T, (H + 2 Hkv) * D] (the q, k and v columns of each row)
// write q [B*T, H*D], k and v [B*T, Hkv*D]. With cos_sin: q and k as
// qk_norm_rope_forward from the packed projections (with the norms, q_norm
// given, the raw projections also copied into q_raw, k_raw); without: a
// split (q, k may then be the caller's q_raw, k_raw; no norms).
template <class T>
void qkv_unpack_forward(const T* packed, T* q, T* k, T* v, T* q_raw, T* k_raw, float* q_rstd, float* k_rstd,
                        const T* q_norm, const T* k_norm, const float* cos_sin, int batch, int time, int heads,
                        int kv_heads, int head_dim, float eps, cudaStream_t stream);
// The backward, one launch. With cos_sin, in place: dq, dk (of the rotated
// q, k) become the gradients of q_raw, k_raw (of q, k before RoPE without
// norms); with the norms (q_raw given, and then k_raw, the rstds and norm
// weights) dq_norm, dk_norm += their weight gradients, using `scratch` of
// qk_norm_rope_backward_scratch_bytes(...) bytes. Then, where packed is
// given, dq, dk and dv are also stored into packed [B*T, (H + 2 Hkv) * D]
// (q, k, v columns) for the one dgrad and one wgrad matmul. Without
// cos_sin only the packing. packed and dv may be null (no packing).
// packed_max (a device float, or null; used only with packed): becomes the
// larger of what it held and max|packed| as stored, for fp8 (as
// swiglu_forward's).
template <class T>
void qkv_pack_backward(T* packed, T* dq, T* dk, const T* dv, float* dq_norm, float* dk_norm, const T* q_raw,
                       const T* k_raw, const float* q_rstd, const float* k_rstd, const T* q_norm, const T* k_norm,
                       const float* cos_sin, int batch, int time, int heads, int kv_heads, int head_dim,
                       void* scratch, float* packed_max, cudaStream_t stream);
std::size_t qk_norm_rope_backward_scratch_bytes(int batch, int time, int heads, int kv_heads, int head_dim);

// ---- rope (kernels_rope.cu) ------------------------------------------------
// In place on x[batch, time, heads, head_dim], half-split convention
// (x[i], x[i + D/2]) rotated by angle theta[t, i]; cos_sin[t, i, 0/1] = cos/sin.
// backward rotates by -theta.
template <class T>
void rope_forward(T* x, const float* cos_sin, int batch, int time, int heads, int head_dim, cudaStream_t stream);
template <class T>
void rope_backward(T* dx, const float* cos_sin, int batch, int time, int heads, int head_dim, cudaStream_t stream);

// ---- attention (kernels_attention.cu) ------------------------------------
// softmax(q k^T / sqrt(D)) v with grouped kv heads (head h uses kv
// head h / (heads / kv_heads)). q, out: [B, T, H, D]; k, v: [B, T, Hkv, D];
// lse: [B, H, T] fp32 natural-log log-sum-exp of the scaled scores.
// head_dim <= 256 and even. Tiled online softmax; fp32 accumulation.
// causal: query t attends keys <= t, and with `positions` ([B, T], each
// token's position in its document; null: none) only keys >= t -
// positions[t]; not causal: every key. With first_query > 0 only queries
// from the query tile of first_query on are computed (out and lse of the
// earlier rows are left as they were): generation's one new query attends
// its cached keys at the cost of one query tile, not of all.
template <class T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, int batch, int time, int heads,
                       int kv_heads, int head_dim, bool causal, const std::int32_t* positions, cudaStream_t stream,
                       int first_query = 0);
// The queries of a query tile: with first_query, the rows of q from
// first_query / kAttentionQueryTile * kAttentionQueryTile on are read.
constexpr int kAttentionQueryTile = 32;
// dq, dk, dv are written (=). dk/dv sum over the heads of a group in a fixed
// order. `scratch` holds attention_backward_scratch_bytes(...) bytes.
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const float* lse, const T* q,
                        const T* k, const T* v, int batch, int time, int heads, int kv_heads, int head_dim,
                        bool causal, const std::int32_t* positions, void* scratch, cudaStream_t stream);
std::size_t attention_backward_scratch_bytes(int batch, int time, int heads, int kv_heads, int head_dim);
// The additive mask of packed documents for a fused attention library that
// takes a bias (cuDNN's SDPA): bias [B, 1, T, T] (row-major, one [T, T]
// matrix per row of the batch) is 0 where query i sees key j (j <= i and j
// >= i - positions[b, i], the keys of its own document up to itself) and
// kAttentionMasked elsewhere, from `positions` as in attention_forward.
// The masked value is finite, far below any score, so that exp() of it is
// exactly 0 in fp32 and no online softmax meets inf - inf.
constexpr float kAttentionMasked = -1.0e30f;
void document_mask_bias(bf16* bias, const std::int32_t* positions, int batch, int time, cudaStream_t stream);

// ---- swiglu (kernels_swiglu.cu) --------------------------------------------
// Elementwise with 16-byte accesses where aligned. Each *_max (a device
// float, or null for none) becomes the larger of what it held and the
// largest magnitude of its output as stored (after rounding to T; NaN
// skipped): the maximum fp8's current scaling takes (fp8_quantize's
// amax_known), so that its own pass over the output is left out.
template <class T>
void swiglu_forward(T* out, const T* gate, const T* up, std::int64_t n, float* out_max, cudaStream_t stream);
// dgate may alias dout.
template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, std::int64_t n, float* dgate_max,
                     float* dup_max, cudaStream_t stream);

// ---- fp8 operands (kernels_fp8.cu) -----------------------------------------
// The two fp8 formats' largest finite values: e4m3 (more precision: weights
// and activations) and e5m2 (more range: gradients).
constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
enum class Fp8Format { E4M3, E5M2 };
// Current per-tensor scaling of x[n]: amax (which must hold 0 on entry)
// becomes max|x|, out[i] = fp8(x[i] * scale) with scale = max / amax (max
// the format's largest finite value; 1 when amax is 0 or not finite),
// rounded to nearest even and saturated to +-max, and inverse_scale[0] =
// 1 / scale, the factor cuBLASLt multiplies the product by. amax and
// inverse_scale are device floats. With amax_known, *amax holds max|x|
// already (the producing kernel's, e.g. swiglu_forward's out_max) and no
// pass over x computes it. With amax_copy (a device float, or null) the
// quantization also stores max|x| there (for a later quantization of the
// same values: the cuda backend's forward maxima).
template <class T>
void fp8_quantize(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, std::int64_t n, Fp8Format format,
                  bool amax_known, float* amax_copy, cudaStream_t stream);
// The same of x[rows, cols] written transposed: out[c * rows + r] = fp8(x[r, c] * scale).
template <class T>
void fp8_quantize_transposed(std::uint8_t* out, float* amax, float* inverse_scale, const T* x, int rows, int cols,
                             Fp8Format format, bool amax_known, cudaStream_t stream);
// Both of them of x[rows, cols] from one maximum and one pass over x, with
// one scale: plain[r * cols + c] and transposed[c * rows + r] hold the codes
// the two calls above would write.
template <class T>
void fp8_quantize_both(std::uint8_t* plain, std::uint8_t* transposed, float* amax, float* inverse_scale, const T* x,
                       int rows, int cols, Fp8Format format, bool amax_known, cudaStream_t stream);
// The weight cache's e4m3 quantization of x[rows, cols] (transposed or
// not) into a slot whose out, amax and inverse_scale persist between calls:
// it does nothing when *stamp == *generation (the slot holds this
// generation's quantization of x already); else it quantizes as above and
// sets *stamp = *generation. Every check is on the device, so a captured
// graph replays it. stamp and generation are device words.
template <class T>
void fp8_quantize_cached(std::uint8_t* out, float* amax, float* inverse_scale, unsigned* stamp,
                         const unsigned* generation, const T* x, int rows, int cols, bool transposed,
                         cudaStream_t stream);
// *generation += 1 on the stream: every slot stamped before is stale.
void fp8_advance_generation(unsigned* generation, cudaStream_t stream);

// ---- fused classifier (kernels_classifier.cu) ------------------------------
// For rows with target != -100: lse = logsumexp(logits[r]), loss = lse -
// logits[r, target]; adds into the float64 stats[kStatCount] (slots of
// stat_slots.h; sums in row order, lse max), counting
// positions (first_position + r) % time < 1024 into the 1k slots. With
// `with_grad`, logits[r] is overwritten by
// softmax(logits[r]) * (1 + 2 * z_loss * lse) - onehot(target), and ignored
// rows by zeros. `scratch` holds classifier_scratch_floats(rows) floats.
template <class T>
void cross_entropy(T* logits, const std::int32_t* targets, StatValue* stats, int rows, int vocab, int first_position,
                   int time, float z_loss, bool with_grad, float* scratch, cudaStream_t stream);
std::size_t classifier_scratch_floats(int rows);

// ---- optimizer (kernels_optimizer.cu) --------------------------------------
// out[0] (float64) += sum(x^2) in a fixed order. `scratch` holds sum_squares_scratch_floats(n).
void sum_squares(StatValue* out, const float* x, std::int64_t n, float* scratch, cudaStream_t stream);
std::size_t sum_squares_scratch_floats(std::int64_t n);
// The optimizer's scale from the statistics of all ranks, without a host
// round trip. gathered: [ranks, stride] float64 where row r holds rank r's
// classifier stats (slots above) followed at index kStatCount by its sum of
// squared (summed-loss) gradients. Writes out[0] = clip / tokens (the factor
// applied to stored gradients) and out[1] = grad norm of the mean loss,
// where norm = sqrt(sum of squares) / tokens and clip = min(1, grad_clip /
// norm) when grad_clip > 0 (else 1); tokens = 0 gives out = {0, 0}; and
// out[2] = 1 when the summed loss or the sum of squares is not finite (the
// update must be skipped), else 0. grad_clip[0] (float64, on the device) is
// read by the kernel, so that a captured launch replays with new values.
void optimizer_scale(float* out, const StatValue* gathered, int ranks, int stride, const double* grad_clip,
                     cudaStream_t stream);
// AdamW on n elements (PyTorch semantics: param *= 1 - lr*wd; m, v moments;
// bias-corrected step lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps)).
// The gradient used is grad[i] * grad_scale[0], grad_scale living on the
// device; nothing is written when grad_scale[2] != 0 (a skipped update). TParam/TState are float or bf16; bf16 values are written with
// stochastic rounding from a counter-based hash of (seed, step, index).
template <class TParam, class TState>
void adamw(TParam* param, const float* grad, TState* m, TState* v, std::int64_t n, float lr, float beta1,
           float beta2, float eps, float weight_decay, int step, const float* grad_scale, std::uint64_t seed,
           cudaStream_t stream);
// AdamW over a whole shard of n elements in one launch, bitwise as adamw()
// called per segment and per chunk of `chunk` elements from each segment's
// start, with the seed step_values' seed + the chunk's first element, and
// then weights (nullptr: none) written from the stored parameters.
// step_values and segments are the float64 tables of adamw_slots.h (on the
// device, read when the kernel runs); elements in no segment are untouched.
template <class TParam, class TState, class TWeight>
void adamw_shard(TParam* param, TWeight* weights, const float* grad, TState* m, TState* v, std::int64_t n,
                 const double* step_values, const double* segments, int segment_count, std::int64_t chunk,
                 const float* grad_scale, cudaStream_t stream);

}  // namespace cuda
}  // namespace nanoq
