"""Proves that the cuda_emulated tests bite: each mutation below is injected,
one at a time, into a scratch copy of the CUDA sources; the emulated backend
is rebuilt from it and the tests of that kernel family are run against it.
Every mutation must make a test fail. Not part of the test suite (it
rebuilds the library once per mutation: about 20-40 s each on two cores).

    python tests/mutations/emulator_mutations.py            # all of them
    python tests/mutations/emulator_mutations.py -k barrier # names containing "barrier"
    python tests/mutations/emulator_mutations.py -k 'swiglu|q/k' # -k is a regular expression

Needs nanoq installed (the tests run against a copy of the installed
package with the mutated library swapped in) and cmake + ninja.
Prints one line per mutation and exits non-zero if any survived.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = "cuda_core/cuda"
ATTENTION_TESTS = "test_gpu_ops.py -k attention"
# (file, which tests to run) per family; the tests are always -m cuda_emulated.
FAMILIES = {
    "kernels_attention.cu": ATTENTION_TESTS,
    "kernels_classifier.cu": "test_gpu_ops.py -k cross_entropy",
    "kernels_embedding.cu": "test_gpu_ops.py -k embedding",
    "kernel_utils.cuh": "test_gpu_ops.py test_cuda_emulated.py test_composites.py test_fp8.py "
                        "-k 'rmsnorm or bias or sum_squares or block or nearest or fused or mlp_products or norm_kernels'",
    "kernels_elementwise.cu": "test_gpu_ops.py -k 'copy or fill or add or bias or dropout'",
    "kernels_optimizer.cu": "test_gpu_ops.py test_cuda_emulated.py test_adamw_shard.py -k 'adamw or sum_squares'",
    # The fused attention's host path and the emulator's stand-in for cuDNN.
    "fused_attention.cpp": "test_fused_attention.py",
    "emulator/emu_attention.cpp": "test_fused_attention.py",
    "kernels_rmsnorm.cu": "test_gpu_ops.py test_composites.py test_fp8.py "
                          "-k 'rmsnorm or deterministic or norm_kernels or producer_maxima'",
    "kernels_qk_norm_rope.cu": "test_composites.py test_fp8.py -k 'qk_norm or qkv or fused_qk or deterministic'",
    "kernels_swiglu.cu": "test_gpu_ops.py test_composites.py test_fp8.py -k 'swiglu or producer_maxima'",
    "kernels_fp8.cu": "test_fp8.py",
    # The cuda backend's host path: the fp8 products, and the packed projections (one matmul for q|k|v, a batch
    # of two for gate|up).
    "cuda_backend.cpp": "test_fp8.py test_composites.py test_packed_projections.py",
    "cuda_backend.h": "test_fp8.py",
    "cublaslt_matmul.cpp": "test_fp8.py test_cublaslt.py",
}


# A barrier commented so orders a block's writes before other blocks read
# them: the emulator runs a launch's blocks one after another, so only a GPU
# can show what its removal breaks.
CROSS_BLOCK_BARRIER = "only a GPU can check it"


def barrier_mutations():
    """One mutation per __syncthreads() of the attention kernels, the block
    reductions and every other kernel that has one: that barrier removed
    (except the cross-block ones)."""
    out = []
    for name in FAMILIES:
        text = open(os.path.join(ROOT, CUDA, name)).read()
        for i, match in enumerate(re.finditer(r"__syncthreads\(\);", text)):
            line = text.count("\n", 0, match.start()) + 1
            if CROSS_BLOCK_BARRIER in text.splitlines()[line - 1]:
                continue
            out.append((f"barrier {name}:{line} removed", name, i, "__syncthreads();", ";"))
    return out


# Packed documents in the fused attention: the mask kernel, the stand-in and the backend's routing.
PACKED_TESTS = "test_fused_attention.py -k packed"

# (name, file, occurrence (None: all), old, new[, the tests to run instead of the file's family])
EDITS = [
    # The forward, dq and dk/dv passes share one mask (Layout::visible).
    ("causal mask off by one", "kernels_attention.cu", 0,
     "if (key > query) return false;", "if (key >= query) return false;"),
    ("GQA heads mapped wrongly (forward)", "kernels_attention.cu", 0,
     "h / (layout.heads / layout.kv_heads)", "h % layout.kv_heads"),
    ("GQA heads mapped wrongly (dk/dv group walk)", "kernels_attention.cu", 0,
     "for (int h = kv_head * group; h < (kv_head + 1) * group; ++h)",
     "for (int h = kv_head; h < layout.heads; h += layout.kv_heads)"),
    ("bf16 rounding: truncation instead of nearest even", "kernel_utils.cuh", 0,
     "return __float2bfloat16_rn(x); }", "return __float2bfloat16_rz(x); }"),
    ("bf16 cast kernel: truncation", "kernels_elementwise.cu", 0,
     "out[i] = __float2bfloat16_rn(in[i]);", "out[i] = __float2bfloat16_rz(in[i]);"),
    ("tail bounds check dropped (attention store_row)", "kernels_attention.cu", 0,
     "if (d < head_dim) row[d]", "row[d]"),
    ("tail bounds check dropped (column sums total)", "kernel_utils.cuh", 0,
     "    if (c >= cols) return;\n    float total", "    float total"),
    ("tail bounds check off by one (grid-stride add)", "kernels_elementwise.cu", 0,
     "i < n; i += detail::grid_stride_step())\n        out[i] = detail::from_float<T>(detail::to_float(a[i]) + ",
     "i <= n; i += detail::grid_stride_step())\n        out[i] = detail::from_float<T>(detail::to_float(a[i]) + "),
    ("stochastic rounding draws the wrong bits for m", "kernels_optimizer.cu", 0,
     "(random >> 16) & 0xffffu", "(random >> 15) & 0xffffu"),
    ("adamw_shard: a chunk's rounding seed off by one", "kernels_optimizer.cu", 0,
     "adamw_stream_key(seed + static_cast<std::uint64_t>(chunk_begin), step)",
     "adamw_stream_key(seed + static_cast<std::uint64_t>(chunk_begin) + 1, step)"),
    ("adamw_shard: weight decay on the other segments", "kernels_optimizer.cu", 0,
     "kAdamWSegmentDecay] != 0.0", "kAdamWSegmentDecay] == 0.0"),
    ("cross_entropy packs: the target's -1 one logit late", "kernels_classifier.cu", 0,
     "if (j * L + k == target) grad -= 1.0f;", "if (j * L + k == target + 1) grad -= 1.0f;"),
    ("embedding backward: run end off by one", "kernels_embedding.cu", 0,
     "for (int i = run_begin; i < run_end; ++i)", "for (int i = run_begin; i <= run_end && i < rows; ++i)"),
    ("fused attention: plans keyed without the pass (backward reuses the forward's)", "fused_attention.cpp", 0,
     "static_cast<int>(dtype),\n               static_cast<int>(pass), bias,",
     "static_cast<int>(dtype),\n               0, bias,"),
    ("fused attention: plans keyed without the bias", "fused_attention.cpp", 0,
     "static_cast<int>(pass), bias, built_deterministic", "static_cast<int>(pass), false, built_deterministic"),
    ("fused attention: a library's own std::exception escapes as it is", "fused_attention.cpp", 0,
     "    } catch (const std::exception& e) {\n        // NanoqError,",
     "    } catch (const NanoqError& e) {\n        // NanoqError,", "test_fused_attention.py -k throws"),
    ("fused attention: \"auto\" falls back silently where the library fails", "fused_attention.cpp", 0,
     "if (refused && !required) *refused = why;", "(void)refused;", "test_fused_attention.py -k throws"),
    ("fused attention: any shape runs fused (plans built for every prompt length)", "cuda_backend.cpp", 0,
     "dtype != fused_dtype_ || (documents && !fused_documents_))\n        return false;",
     "dtype != fused_dtype_ || (documents && !fused_documents_))\n        (void)0;",
     "test_fused_attention.py -k 'generation_runs or bidirectional or matches_native'"),
    ("fused attention: packed documents fused at any seq_len (mask rows off 16 bytes)", "cuda_backend.cpp", 0,
     "if (s.attention.time % 8 != 0) {", "if (false) {", "test_fused_attention.py -k multiple_of_8"),
    ("fused attention: the unasked bound without the deterministic backward's dP", "fused_attention.cpp", 0,
     "return flash + dp + (std::size_t(4) << 20);", "return flash + (std::size_t(4) << 20);",
     "test_fused_attention.py -k bound"),
    ("fused attention: attention_deterministic never reaches the backend", "cuda_backend.cpp", 0,
     "attention_deterministic_ = s.attention_deterministic;", "attention_deterministic_ = true;",
     "test_fused_attention.py -k non_deterministic"),
    ("fused attention: the backward's plan always deterministic", "fused_attention.cpp", 0,
     "built = engine_->build(s, dtype, pass, bias, deterministic);",
     "built = engine_->build(s, dtype, pass, bias, true);", "test_fused_attention.py -k non_deterministic"),
    ("fused attention: an engine (and its plans) started anew at every call", "cuda_backend.cpp", 0,
     "    if (!attention) {\n        try {", "    if (true) {\n        try {",
     "test_fused_attention.py -k plans_once"),
    ("fp8: an output off 16 bytes runs fp8 anyway", "cuda_backend.cpp", 0,
     " || !aligned_16(out) || !aligned_16(bias))", " || !aligned_16(bias))", "test_fp8.py -k off_16_bytes"),
    ("fp8: a bias off 16 bytes runs fp8 anyway", "cuda_backend.cpp", 0,
     " || !aligned_16(out) || !aligned_16(bias))", " || !aligned_16(out))", "test_fp8.py -k off_16_bytes"),
    ("fp8: an input gradient off 16 bytes runs fp8 anyway", "cuda_backend.cpp", 0,
     "weight.dtype == DType::BF16 && aligned_16(dx);", "weight.dtype == DType::BF16;",
     "test_fp8.py -k off_16_bytes"),
    ("fp8: a weight gradient off 16 bytes runs fp8 anyway", "cuda_backend.cpp", 0,
     "dweight.dtype == DType::F32) && aligned_16(dweight);", "dweight.dtype == DType::F32);",
     "test_fp8.py -k off_16_bytes"),
    ("CUDA graphs: kept until the backend goes (after NCCL's finalize)", "cuda_backend.cpp", 0,
     "void CudaBackend::release_captured() {\n", "void CudaBackend::release_captured() {\n    return;\n",
     "test_cuda_graphs.py -k uncaptured_ones"),
    ("cuBLASLt: a plan first needed inside a capture is timed there", "cublaslt_matmul.cpp", 0,
     "} else if (capture != cudaStreamCaptureStatusNone) {", "} else if (false) {",
     "test_cublaslt.py -k capture"),
    ("fp8 scale: unbounded for a tiny maximum", "kernels_fp8.cu", 0,
     "fminf(largest / amax, 0x1p126f)", "largest / amax", "test_fp8.py -k quantize"),
    ("fp8 scale: an infinite maximum dequantizes by 1", "kernels_fp8.cu", 0,
     "return isinf(amax) ? __int_as_float(0x7fc00000) : 1.0f / scale;", "return 1.0f / scale;",
     "test_fp8.py -k quantize"),
    ("attention decode: the first query tile computed instead of the last", "kernels_attention.cu", 0,
     "const int query_tile = first_tile + gridDim.x - 1 - blockIdx.x;",
     "const int query_tile = gridDim.x - 1 - blockIdx.x;", "test_gpu_ops.py -k attention_decode"),
    # Tile pairs the documents mask wholly are skipped (Layout::first_key_tile, Layout::documents_hide).
    ("document tiles: forward and dq start one key tile late", "kernels_attention.cu", 0,
     "return start > 0 ? static_cast<int>(start / kTile) : 0;",
     "return start > 0 ? static_cast<int>(start / kTile) + 1 : 1;"),
    ("document tiles: dk/dv skip the key tile a document starts in", "kernels_attention.cu", 0,
     "earliest_start(b, query_tile) >= std::int64_t(key_tile + 1) * kTile",
     "earliest_start(b, query_tile) >= std::int64_t(key_tile) * kTile"),
    ("document tiles: the earliest start of half the tile's queries", "kernels_attention.cu", 0,
     "for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {\n            const std::int64_t other",
     "for (int offset = kWarpSize / 4; offset > 0; offset /= 2) {\n            const std::int64_t other"),
    ("document tiles: the tile's last query's start", "kernels_attention.cu", 0,
     "start = other < start ? other : start;", "start = other > start ? other : start;"),
    ("document mask: a document's first key masked", "kernels_attention.cu", 0,
     "key <= query && key >= first", "key <= query && key > first", PACKED_TESTS),
    ("document mask: every row masked by the first row's positions", "kernels_attention.cu", 0,
     "const int first = query - positions[row];", "const int first = query - positions[row % time];",
     PACKED_TESTS),
    ("document mask: never written", "cuda_backend.cpp", 0,
     "    cuda::document_mask_bias(static_cast<bf16*>(attention_mask_.data), positions.i32(), s.batch, s.time, stream_);\n",
     "", PACKED_TESTS),
    ("document mask: written by the first call only", "cuda_backend.cpp", 0,
     "    cuda::document_mask_bias(static_cast<bf16*>",
     "    static int calls = 0;\n    if (calls++ == 0) cuda::document_mask_bias(static_cast<bf16*>", "test_fused_attention.py -k packed_training"),
    ("document mask: not written when a batch's positions are loaded", "cuda_backend.cpp", 0,
     "    const OpScope op(*this);\n    write_document_mask(positions, s);\n    mask_positions_ = positions.data;",
     "    mask_positions_ = positions.data;", "test_fused_attention.py -k packed_training"),
    ("document mask: rewritten by every attention call", "cuda_backend.cpp", 0,
     "if (positions.data != mask_positions_ || s.batch != mask_batch_ || s.time != mask_time_) {",
     "if (true) {", "test_fused_attention.py -k packed_training"),
    ("document mask: announced for another shape", "cuda_backend.cpp", 0,
     "    mask_batch_ = s.batch;", "    mask_batch_ = s.batch + 1;", "test_fused_attention.py -k packed_training"),
    ("document mask: a call with other positions leaves the announced ones standing", "cuda_backend.cpp", 0,
     "        mask_positions_ = nullptr;  // it no longer holds the announced positions\n", "",
     "test_fused_attention.py -k announced_mask"),
    ("packed documents: the fused forward without their mask", "cuda_backend.cpp", 0,
     "positions.data ? attention_mask_ : Tensor()", "Tensor()", PACKED_TESTS),
    ("packed documents: the fused backward without their mask", "cuda_backend.cpp", 1,
     "positions.data ? attention_mask_ : Tensor()", "Tensor()", PACKED_TESTS),
    ("packed documents: attention=\"cudnn\" runs them natively where the library refuses", "cuda_backend.cpp", 0,
     "if (s.attention_impl == AttentionImpl::Cudnn)\n                        throw InvalidArgument",
     "if (false)\n                        throw InvalidArgument", "test_fused_attention.py -k refuses"),
    ("packed documents: no mask reserved", "cuda_backend.cpp", 0,
     "        if (choice.documents)\n            plan.push_back", "        if (false)\n            plan.push_back",
     PACKED_TESTS),
    ("fused attention stand-in: the bias left out of the backward", "emulator/emu_attention.cpp", 0,
     "std::exp(dot * scale + bias_at(s, t, b, i, j) - row_lse)", "std::exp(dot * scale - row_lse)", PACKED_TESTS),
    ("fused attention: attention=\"cudnn\" falls back silently", "fused_attention.cpp", 0,
     "if (required) throw InvalidArgument", "if (false) throw InvalidArgument"),
    ("fused attention stand-in: GQA heads mapped wrongly (forward)", "emulator/emu_attention.cpp", 0,
     "kv.at(b, j, h / group, d)", "kv.at(b, j, h % s.kv_heads, d)"),
    ("fused attention stand-in: causal mask off by one (backward)", "emulator/emu_attention.cpp", 0,
     "for (int j = 0; j <= last_key(s, i); ++j) {\n                    const int g",
     "for (int j = 0; j < last_key(s, i); ++j) {\n                    const int g"),
    ("fused attention stand-in: auto picks it", "emulator/emu_attention.cpp", 0,
     "return preferred && !std::strcmp(preferred, \"1\");", "return true;"),
    ("rmsnorm weight gradient: the block partials summed one column off", "kernels_rmsnorm.cu", 0,
     "detail::MatrixColumns{partials, channels, 0}", "detail::MatrixColumns{partials, channels, 1}"),
    ("k norm weight gradient: the q columns of the partials summed into it", "kernels_qk_norm_rope.cu", 0,
     "detail::MatrixColumns{partials, 2 * head_dim, head_dim}", "detail::MatrixColumns{partials, 2 * head_dim, 0}"),
    ("adamw_shard: a thread skips every other element of its block's range", "kernels_optimizer.cu", 0,
     "i < block_end; i += threads)", "i < block_end; i += 2 * threads)"),
    ("fp8 maximum: only each block's first warp counted", "kernel_utils.cuh", 0,
     "for (int w = 1; w < static_cast<int>(blockDim.x) / kWarpSize; ++w)", "for (int w = 1; w < 1; ++w)"),
    ("fp8 quantize: the tail past the last whole chunk left unwritten", "kernels_fp8.cu", 0,
     "i < n; i += detail::grid_stride_step())\n        out[i] = to_fp8(",
     "i < split; i += detail::grid_stride_step())\n        out[i] = to_fp8("),
    ("residual add not rounded before the norm", "kernels_rmsnorm.cu", 0,
     "x[k][j] = detail::rounded<T>(x[k][j] + d[j]);", "x[k][j] = x[k][j] + d[j];"),
    ("rmsnorm backward: a block skips every other row of its stride", "kernels_rmsnorm.cu", 0,
     "r += gridDim.x", "r += 2 * gridDim.x"),
    ("q/k norm: mean over half the head", "kernels_qk_norm_rope.cu", 0,
     "sum / (2 * half) + eps", "sum / half + eps"),
    ("fused RoPE backward rotates forwards", "kernels_qk_norm_rope.cu", 0,
     "half, begin, -1.0f);", "half, begin, 1.0f);"),
    ("q/k groups reduce over half their lanes", "kernels_qk_norm_rope.cu", 0,
     "for (int offset = lanes / 2; offset > 0;", "for (int offset = lanes / 4; offset > 0;"),
    ("k norm weight gradient: partials dropped", "kernels_qk_norm_rope.cu", 0,
     "warp_sums[warp][1][begin + j] = dka[j];", "warp_sums[warp][1][begin + j] = 0.0f;"),
    ("q/k norm weight gradient: only the warp's first group counted", "kernels_qk_norm_rope.cu", 0,
     "offset >= lanes; offset /= 2)", "offset >= 2 * detail::kWarpSize; offset /= 2)"),
    ("packed q|k|v split: rows read at the q width, not the packed width", "kernels_qk_norm_rope.cu", 0,
     "const Side<T> qs{q, packed, stride,", "const Side<T> qs{q, packed, q_width,"),
    ("packed q|k|v split: v read from k's columns", "kernels_qk_norm_rope.cu", 0,
     "const Side<T> vs{v, packed + q_width + kv_width, stride,", "const Side<T> vs{v, packed + q_width, stride,"),
    ("packed q|k|v backward: dv packed into k's columns", "kernels_qk_norm_rope.cu", 0,
     "at(q_width + kv_width),", "at(q_width),"),
    ("packed q|k|v backward: the v rows left out of the pass", "kernels_qk_norm_rope.cu", 0,
     "kv_heads, dv ? s.rows * kv_heads : 0};", "kv_heads, 0};"),
    ("gate|up batch: both products read the gate rows of the weight", "cuda_backend.cpp", 0,
     "const LtMatmul::Batch batch{2, 0, std::int64_t(intermediate) * channels, distance};",
     "const LtMatmul::Batch batch{2, 0, 0, distance};"),
    ("gate|up weight gradient batch: both products read dgate", "cuda_backend.cpp", 0,
     "const LtMatmul::Batch batch{2, distance, 0, block};", "const LtMatmul::Batch batch{2, 0, 0, block};"),
    ("packed q|k|v backward: the wgrad skipped", "cuda_backend.cpp", 0,
     "matmul_backward(dx, accumulate, g.qkv, g.qkv_bias, dqkv,", "matmul_backward(dx, accumulate, Tensor(), g.qkv_bias, dqkv,"),
    ("swiglu: the partial last chunk dropped", "kernels_swiglu.cu", 0,
     "detail::grid_stride_begin() * P; i < n;", "detail::grid_stride_begin() * P; i + P <= n;"),
    ("fp8: e5m2 scaled to e4m3's largest value", "kernels_fp8.cu", 0,
     "format == Fp8Format::E4M3 ? kE4m3Max : kE5m2Max", "kE4m3Max"),
    ("fp8 transposing quantize: the tile read untransposed", "kernels_fp8.cu", 0,
     "tile[threadIdx.x * (kTile + 1) + i]", "tile[i * (kTile + 1) + threadIdx.x]"),
    ("fp8 dgrad: dy in e4m3 instead of e5m2", "cuda_backend.cpp", 0,
     "fp8_operand(dy, rows, n, false, Fp8Format::E5M2)", "fp8_operand(dy, rows, n, false, Fp8Format::E4M3)"),
    ("fp8 dgrad: dy in e4m3, and multiplied as e4m3", "cuda_backend.cpp", 0,
     """fp8_operand(dy, rows, n, false, Fp8Format::E5M2);
    const Fp8Operand wt8 = fp8_weight(weight, n, k, true);
    matmul_->run_fp8(dx, dy8.codes, CUDA_R_8F_E5M2""",
     """fp8_operand(dy, rows, n, false, Fp8Format::E4M3);
    const Fp8Operand wt8 = fp8_weight(weight, n, k, true);
    matmul_->run_fp8(dx, dy8.codes, CUDA_R_8F_E4M3"""),
    ("fp8 wgrad overwrites the gradient instead of adding to it", "cuda_backend.cpp", 0,
     "n, k, rows, true, Tensor(), false, matmul_workspace_.data",
     "n, k, rows, false, Tensor(), false, matmul_workspace_.data"),
    ("fp8 weight cache: never stale again once a slot is used", "cuda_backend.cpp", 0,
     "if (!fp8_weight_cache_.data) return;\n    cuda::fp8_advance_generation",
     "if (!fp8_weight_cache_.data || !fp8_cache_slots_.empty()) return;\n    cuda::fp8_advance_generation"),
    ("fp8 weight cache: a slot's stamp checked without the generation", "kernels_fp8.cu", 0,
     "return stamp && *stamp == *generation;", "return stamp && *stamp != 0;"),
    ("fp8 weight cache: slots keyed without the layout", "cuda_backend.cpp", 0,
     "rows, cols, transposed);\n    auto it", "rows, cols, false);\n    auto it"),
    ("fp8 reuse: a composite's operands keyed without the layout", "cuda_backend.h", 0,
     "cols == o.cols && transposed == o.transposed &&", "cols == o.cols &&"),
    ("fp8 reuse: each product of a composite starts the buffer afresh", "cuda_backend.cpp", 0,
     "if (fp8_reuse_depth_ > 0 && fp8_reuse_begun_) return;", ""),
    ("fp8 reuse: gate|up's forward quantizes x for each product", "cuda_backend.cpp", 0,
     "Fp8Reuse reuse(*this);  // fp8: x quantized once for both", ""),
    ("fp8 reuse: gate|up's backward prepares dgate twice and dup not at all", "cuda_backend.cpp", 0,
     "fp8_both_forms(dup, rows, intermediate,", "fp8_both_forms(dgate, rows, intermediate,"),
    ("fp8 both forms: the plain codes written unscaled", "kernels_fp8.cu", 0,
     "if (plain) plain[at] = to_fp8(v * scale, format);", "if (plain) plain[at] = to_fp8(v, format);"),
    ("vectorised transpose: the bytes of a word in reverse order", "kernels_fp8.cu", 0,
     "word |= (w[4 * m + b] >> (8 * k) & 0xffu) << (8 * b);",
     "word |= (w[4 * m + b] >> (8 * k) & 0xffu) << (24 - 8 * b);"),
    ("vectorised transpose: the plain codes left unwritten", "kernels_fp8.cu", 0,
     "if (plain) *reinterpret_cast<Codes<P>*>(plain + at) = codes;", ""),
    ("vectorised transpose: a part tile's last rows left out", "kernels_fp8.cu", 0,
     "16 * seg >= tile_rows) return;", "16 * seg >= tile_rows - 16) return;"),
    ("producer maximum: of the values before rounding", "kernel_utils.cuh", 0,
     "m = fmaxf(m, fabsf(rounded<T>(v[j])))", "m = fmaxf(m, fabsf(v[j]))"),
    ("producer maximum: dup's taken of dgate", "kernels_swiglu.cu", 0,
     "mu = detail::chunk_max<T>(mu, du, n - i)", "mu = detail::chunk_max<T>(mu, dg, n - i)"),
    ("producer maximum: half the forward's", "kernels_swiglu.cu", 0,
     "detail::block_max_into(out_max, m, maxima)", "detail::block_max_into(out_max, 0.5f * m, maxima)"),
    ("producer maximum: half the norm forward's", "kernels_rmsnorm.cu", 0,
     "detail::block_max_into(out_max, m, reduce_space)", "detail::block_max_into(out_max, 0.5f * m, reduce_space)"),
    ("producer maximum: the norm backward's of each block's first row only", "kernels_rmsnorm.cu", 0,
     "if (dinp_max) m = detail::chunk_max", "if (dinp_max && r == static_cast<int>(blockIdx.x)) m = detail::chunk_max"),
    ("producer maximum: the packed q|k|v gradient's of the first halves only", "kernels_qk_norm_rope.cu", 0,
     "m = detail::chunk_max<T>(detail::chunk_max<T>(m, a, half - begin), b, half - begin)",
     "m = detail::chunk_max<T>(m, a, half - begin)"),
    ("producer maximum: the packed q|k|v gradient's without v", "kernels_qk_norm_rope.cu", 0,
     "if (packed_max) m = detail::chunk_max", "if (packed_max && which < 2) m = detail::chunk_max"),
    ("producer maximum: the packing pass's last block left out", "kernels_qk_norm_rope.cu", 0,
     "if (packed_max) detail::block_max_into(packed_max, m, maxima);",
     "if (packed_max && blockIdx.x + 1 < gridDim.x) detail::block_max_into(packed_max, m, maxima);"),
    ("producer maxima: records outlive the next op", "cuda_backend.cpp", 0,
     "fp8_produced_before_ = std::move(fp8_produced_);",
     "fp8_produced_before_.insert(fp8_produced_before_.end(), fp8_produced_.begin(), fp8_produced_.end());"),
    ("producer maxima: the elementwise add opens no OpScope", "cuda_backend.cpp", 0,
     "void CudaBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {\n    const OpScope op(*this);",
     "void CudaBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {"),
    ("fp8 fast accumulation: never set on the descriptor", "cublaslt_matmul.cpp", 0,
     "const std::int8_t fast = x.fast_accumulation ? 1 : 0;", "const std::int8_t fast = 0;"),
    ("fp8 fast accumulation: the dgrad products too", "cuda_backend.cpp", 0,
     "rows, k, n, accumulate, Tensor(), false,", "rows, k, n, accumulate, Tensor(), fp8_fast_forward_,"),
    ("fp8 fast accumulation: no fallback where the library has no such kernel", "cublaslt_matmul.cpp", 0,
     "if (usable == 0 && fast) {", "if (usable < 0 && fast) {"),
    ("forward maxima: the backward takes another layer's slot", "cuda_backend.cpp", 0,
     "+ kFp8CodesStart) + fp8_site_;",
     "+ kFp8CodesStart) + (defining ? fp8_site_ : (fp8_site_ + kProjectionSites) % int(fp8_site_known_.size()));"),
    ("forward maxima: the kept copy is half the maximum", "kernels_fp8.cu", 0,
     "if (amax_copy) *amax_copy = *amax;", "if (amax_copy) *amax_copy = 0.5f * *amax;"),
    ("forward maxima: a backward takes a site its forward did not keep", "cuda_backend.cpp", 0,
     "(!defining && !fp8_site_known_[std::size_t(fp8_site_)])", "false"),
    ("fp8 fast accumulation: the switch ignored", "cuda_backend.cpp", 0,
     'fp8_fast_forward_ = env_switch("NANOQ_FP8_FAST_ACCUM");', "fp8_fast_forward_ = true;"),
    # The collective time limit: host waits on work that includes collectives, and the calls on the communicator.
    ("collective time limit: host waits never give up", "nccl_communicator.cpp", 0,
     "if (collective_limit_ > 0 && waited > collective_limit_)", "if (false)",
     "test_cuda_emulated_faults.py -k stops_without_failing"),
    ("collective time limit: the host waits' clock never runs", "cuda_backend.cpp", 0,
     "if (check) check(waited());", "if (check) check(0.0);", "test_cuda_emulated_faults.py -k stops_without_failing"),
]


def run(cmd, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), **kw)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="only mutations whose name matches this regular expression")
    args = parser.parse_args()

    import nanoq

    package = os.path.dirname(nanoq.__file__)
    scratch = tempfile.mkdtemp(prefix="nanoq-mutations-")
    src, build, site = (os.path.join(scratch, d) for d in ("src", "build", "site"))
    os.makedirs(src)
    for item in ("CMakeLists.txt", "cmake", "cuda_core", "pylib"):
        path = os.path.join(ROOT, item)
        (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, os.path.join(src, item))
    shutil.copytree(package, os.path.join(site, "nanoq"))
    configure = ["cmake", "-G", "Ninja", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}"]
    if run(configure, capture_output=True).returncode:
        sys.exit("cmake configure failed")

    mutations = [m for m in barrier_mutations() + EDITS if re.search(args.k, m[0])]
    survivors = []
    for name, file, occurrence, old, new, *instead in mutations:
        path = os.path.join(src, CUDA, file)
        pristine = open(path).read()
        starts = [m.start() for m in re.finditer(re.escape(old), pristine)]
        if not starts or (occurrence is not None and occurrence >= len(starts)):
            print(f"?? {name}: pattern not found in {file}")
            survivors.append(name)
            continue
        at = starts[occurrence]
        open(path, "w").write(pristine[:at] + new + pristine[at + len(old):])
        began = time.time()
        try:
            built = run(["ninja", "-C", build, "nanoq_cuda_emulated"], capture_output=True, text=True)
            if built.returncode:
                print(f"!! {name}: the mutant does not compile (counts as caught)\n{built.stdout[-400:]}")
                continue
            shutil.copy(os.path.join(build, "libnanoq_cuda_emulated.so"), os.path.join(site, "nanoq"))
            tests = " ".join(os.path.join(ROOT, "tests", t) if t.endswith(".py") else t
                             for t in (instead[0] if instead else FAMILIES[file]).split(" "))
            env = dict(os.environ, PYTHONPATH=site)
            result = run(f"{sys.executable} -m pytest -q -x -p no:cacheprovider -m cuda_emulated {tests}",
                         env=env, capture_output=True, text=True, cwd=os.path.join(ROOT, "tests"))
            # 1: a test failed. A crash of the test process (a signal) fails
            # the run too, but is reported as such; the shell that runs
            # pytest reports a signal as 128 + its number.
            died = -result.returncode if result.returncode < 0 else result.returncode - 128
            caught = result.returncode == 1 or died > 0
            failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
            if died > 0:
                failed = [f"FAILED (the test process died of signal {died})"]
            verdict = "caught  " if caught else "SURVIVED"
            print(f"{verdict} {name} ({time.time() - began:.0f}s): {failed[0][7:120] if failed else result.stdout[-200:]}",
                  flush=True)
            if not caught:
                survivors.append(name)
        finally:
            open(path, "w").write(pristine)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{len(mutations) - len(survivors)} of {len(mutations)} mutations caught")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
