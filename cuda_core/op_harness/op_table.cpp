// The ops of the test harness, each declared once.
//
// How to add an op (after adding it to backend.h and each backend):
//   1. Add an entry below: its name (also the Python method's), one line of
//      doc, its arguments in the order of the Python call, and a body that
//      calls the Backend method with the tensors and ints by name. Shapes
//      and roles are described in op_spec.h; outputs are NaN-filled before
//      the op runs, so an element it fails to write comes back NaN.
//   2. Give it `scratch` when the backend reserves scratch for it, and
//      `check` for argument rules the shapes cannot state.
//   3. Test it in tests/test_ops.py against a float64 reference, and in
//      tests/test_cuda_emulated.py / test_gpu_ops.py against the cpu backend.
// Nothing else changes: nanoq._ops and nanoq.testing.OpRunner build the
// Python method (argument checks, output arrays, docstring) from the entry.
//
// Device dtypes: tensors take the op's `dtype` argument ("fp32" or "bf16")
// unless marked: .f32() (the interface keeps them float32 whatever the
// dtype: weight gradients, rstd, lse, cos/sin), .f64() (statistics), or
// .dtype("other_dtype_argument").
#include <algorithm>
#include <string>
#include <vector>

#include "op_harness/default_composites.h"
#include "op_harness/op_spec.h"
#include "stat_slots.h"

namespace nanoq::ops {
namespace {

void require(bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument(what);
}

AttentionShape attention(const OpCall& c) {
    return AttentionShape{c.i("batch"), c.i("time"), c.i("heads"), c.i("kv_heads"), c.i("head_dim")};
}

// The shape of attention_forward/backward, with their `causal` flag.
AttentionShape masked_attention(const OpCall& c) {
    AttentionShape s = attention(c);
    s.causal = c.b("causal");
    return s;
}

ScratchShapes attention_shapes(const OpCall& c) {
    ScratchShapes s = no_scratch();
    s.attention = attention(c);
    s.attention_impl = AttentionImpl::Native;
    return s;
}

// With `fused` the backend must run the attention in its fused library
// (attention "cudnn"; an error where it has none), else in its own kernels;
// a call with positions reserves what packed documents need there
// (TrainOptions::packed_documents).
ScratchShapes attention_scratch(const OpCall& c) {
    ScratchShapes s = attention_shapes(c);
    s.attention = masked_attention(c);  // the fused plans are the call's, causal or not
    s.dtype = c.dtype("dtype") == DType::BF16 ? Precision::BF16 : Precision::FP32;
    if (c.b("fused")) s.attention_impl = AttentionImpl::Cudnn;
    s.packed_documents = c.given("positions");
    return s;
}

// The backward's also says which algorithm the fused library runs
// (TrainOptions::attention_deterministic).
ScratchShapes attention_backward_scratch(const OpCall& c) {
    ScratchShapes s = attention_scratch(c);
    s.attention_deterministic = c.b("deterministic");
    return s;
}

void check_attention(const OpCall& c) {
    require(c.i("heads") % c.i("kv_heads") == 0, "heads (" + std::to_string(c.i("heads")) +
                                                     ") must be a multiple of kv_heads (" +
                                                     std::to_string(c.i("kv_heads")) + ")");
    require(c.i("head_dim") % 2 == 0, "head_dim must be even, got " + std::to_string(c.i("head_dim")));
}

void check_masked_attention(const OpCall& c) {
    check_attention(c);
    require(c.b("causal") || !c.given("positions"), "positions (packed documents) need a causal attention");
}

const char* const kAttention = "batch,time,heads,head_dim";
const char* const kAttentionKV = "batch,time,kv_heads,head_dim";

// `op` on the call's backend: its own implementation, or with use_default
// the interface's default body, with the default bodies of the composites
// it calls in turn (DefaultComposites), over the backend's primitives.
#define NANOQ_COMPOSITE(call, op, ...)                                                          \
    ((call).b("use_default") ? ::nanoq::ops::DefaultComposites((call).backend()).op(__VA_ARGS__) \
                             : (call).backend().op(__VA_ARGS__))

// The packed q/k/v ops: activations [rows, heads, head_dim] (rows = batch *
// time), the packed weight [packed, hidden] with packed = (heads + 2
// kv_heads) * head_dim, and the q/k norms when q_norm and k_norm are given.
const char* const kQ = "rows,heads,head_dim";
const char* const kK = "rows,kv_heads,head_dim";
const char* const kQRows = "rows,heads";
const char* const kKRows = "rows,kv_heads";
const char* const kCosSin = "time,head_dim/2,2";

// The arguments every q/k/v op takes, then `tensors`; `packed`: the op
// takes the packed weight (and bias), not only the q/k norms.
std::vector<ArgSpec> qkv_args(bool packed, std::vector<ArgSpec> tensors) {
    std::vector<ArgSpec> args = {integer("batch").at_least(1), integer("time").at_least(1),
                                 integer("heads").at_least(1), integer("kv_heads").at_least(1),
                                 integer("head_dim").at_least(2)};
    if (packed) {
        args.push_back(input("qkv", "packed,hidden"));
        args.push_back(input("qkv_bias", "packed").optional());
    }
    for (ArgSpec a : {input("q_norm", "head_dim").optional(), input("k_norm", "head_dim").optional(),
                      real("eps", 1e-6), flag("use_default", false)})
        args.push_back(a);
    args.insert(args.end(), tensors.begin(), tensors.end());
    return args;
}

void check_qkv(const OpCall& c) {
    check_attention(c);
    require(c.i("rows") == c.i("batch") * c.i("time"), "rows (" + std::to_string(c.i("rows")) +
                                                           ") must be batch * time");
    require(c.given("q_norm") == c.given("k_norm"), "give q_norm and k_norm together");
}

void check_packed_qkv(const OpCall& c) {
    check_qkv(c);
    require(c.i("packed") == (c.i("heads") + 2 * c.i("kv_heads")) * c.i("head_dim"),
            "qkv must have (heads + 2 kv_heads) * head_dim rows, got " + std::to_string(c.i("packed")));
}

ScratchShapes qkv_scratch(const OpCall& c) {
    ScratchShapes s = attention_shapes(c);
    s.hidden = c.i("hidden");
    return s;
}

QkvShape qkv_shape(const OpCall& c) { return QkvShape{attention(c), c.i("hidden"), c.f("eps")}; }
// The norm-and-RoPE halves see no projection: hidden is 0.
QkvShape qk_norm_shape(const OpCall& c) { return QkvShape{attention(c), 0, c.f("eps")}; }

Tensor if_declared(const OpCall& c, const char* name) { return c.has(name) ? c[name] : Tensor(); }

QkvWeights qkv_weights(const OpCall& c) {
    return QkvWeights{if_declared(c, "qkv"), if_declared(c, "qkv_bias"), c["q_norm"], c["k_norm"]};
}

// The gradients: empty when frozen; the bias's only with a bias, the norms'
// only with the norms.
QkvWeights qkv_grads(const OpCall& c) {
    QkvWeights g;
    if (c.has("dqkv") && !c.b("frozen")) {
        g.qkv = c["dqkv"];
        if (c.given("qkv_bias")) g.qkv_bias = c["dqkv_bias"];
    }
    if (c.given("q_norm") && c.has("dq_norm")) {
        g.q_norm = c["dq_norm"];
        g.k_norm = c["dk_norm"];
    }
    return g;
}

// The activations an op declares (the others empty); without the norms q_raw
// and k_raw are not the op's.
QkvActivations qkv_activations(const OpCall& c) {
    auto get = [&](const char* name) { return if_declared(c, name); };
    QkvActivations a{get("q"), get("k"), get("v"), Tensor(), Tensor(), Tensor(), Tensor()};
    if (c.given("q_norm")) {
        a.q_raw = get("q_raw");
        a.k_raw = get("k_raw");
        a.q_rstd = get("q_rstd");
        a.k_rstd = get("k_rstd");
    }
    return a;
}

ScratchShapes gate_up_scratch(const OpCall& c) {
    ScratchShapes s = row_scratch(c.i("rows"));
    s.hidden = c.i("channels");
    s.intermediate = c.i("intermediate");
    return s;
}

std::vector<OpSpec> make_table() {
    return {
        {"copy", "out = x converted on the device from src_dtype to dst_dtype",
         {input("x", "*n").dtype("src_dtype"), dtype_arg("src_dtype"), dtype_arg("dst_dtype"),
          output("out", "*n").dtype("dst_dtype")},
         {},
         [](OpCall& c) { c.backend().copy(c["out"], c["x"]); }},
        {"fill", "out[n] = value",
         {integer("n").at_least(1), real("value"), output("out", "n")},
         {},
         [](OpCall& c) { c.backend().fill(c["out"], c.f("value")); }},
        {"matmul",
         "op(a) @ op(b) [M, N] (+ accumulate_into, on the device); a is [M, K] ([K, M] with trans_a), "
         "b [K, N] ([N, K] with trans_b); out_dtype is the output's device dtype",
         {input("a", "trans_a?K,M:M,K"), input("b", "trans_b?N,K:K,N"), flag("trans_a", false),
          flag("trans_b", false), in_out("accumulate_into", "M,N").or_output().sets("accumulate").dtype("out_dtype"),
          dtype_arg("dtype"), dtype_arg("out_dtype", "dtype")},
         {},
         [](OpCall& c) {
             c.backend().matmul(c["accumulate_into"], c["a"], c["b"], c.i("M"), c.i("N"), c.i("K"), c.b("trans_a"),
                                c.b("trans_b"), c.b("accumulate"));
         }},
        {"add_bias", "out [rows, cols] + bias [cols]",
         {in_out("out", "rows,cols"), input("bias", "cols")},
         {},
         [](OpCall& c) { c.backend().add_bias(c["out"], c["bias"], c.i("rows"), c.i("cols")); }},
        {"bias_backward", "dbias [cols] (float32, default zeros) + column sums of dout [rows, cols]",
         {input("dout", "rows,cols"), in_out("dbias", "cols").f32().or_zeros()},
         {},
         [](OpCall& c) { c.backend().bias_backward(c["dbias"], c["dout"], c.i("rows"), c.i("cols")); },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("cols");
             return s;
         }},
        {"add", "a + b, elementwise",
         {input("a", "*n"), input("b", "*n"), output("out", "*n")},
         {},
         [](OpCall& c) { c.backend().add(c["out"], c["a"], c["b"]); }},
        {"accumulate", "out + a, computed in place on the device",
         {in_out("out", "*n"), input("a", "*n")},
         {},
         [](OpCall& c) { c.backend().accumulate(c["out"], c["a"]); }},
        {"scale_dropout",
         "x * scale with dropout: elements whose mask draw (seed, flat index) is below drop become 0, "
         "the others are scaled by 1 / (1 - drop)",
         {input("x", "*n"), real("scale"), real("drop"), seed("seed"), output("out", "*n")},
         {},
         [](OpCall& c) { c.backend().scale_dropout(c["out"], c["x"], c.f("scale"), c.f("drop"), c.seed("seed"), Tensor());
         },
         nullptr,
         [](const OpCall& c) { require(c.f("drop") >= 0.0f && c.f("drop") < 1.0f, "drop must be in [0, 1)"); }},
        {"embedding_forward", "table [vocab, channels] rows picked by tokens (any shape)",
         {tokens("tokens", "*rows", "vocab"), input("table", "vocab,channels"), output("out", "*rows,channels")},
         {},
         [](OpCall& c) {
             c.backend().embedding_forward(c["out"], c["tokens"], c["table"], c.i("rows"), c.i("channels"));
         }},
        {"embedding_backward",
         "table_grad [vocab, channels] (float32) + dout [*tokens.shape, channels] scattered by tokens",
         {input("dout", "*rows,channels"), tokens("tokens", "*rows", "vocab"),
          in_out("table_grad", "vocab,channels").f32()},
         {},
         [](OpCall& c) {
             c.backend().embedding_backward(c["table_grad"], c["dout"], c["tokens"], c.i("rows"), c.i("channels"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.vocab = c.i("vocab");
             return s;
         }},
        {"rmsnorm_forward", "(out, rstd): out = inp * rstd * weight over the last axis; rstd [rows] float32",
         {input("inp", "*rows,channels"), input("weight", "channels"), real("eps", 1e-6),
          output("out", "*rows,channels"), output("rstd", "rows").f32()},
         {},
         [](OpCall& c) {
             c.backend().rmsnorm_forward(c["out"], c["rstd"], c["inp"], c["weight"], c.i("rows"), c.i("channels"),
                                         c.f("eps"));
         }},
        {"rmsnorm_backward",
         "(dinp, dweight): dinp = d/dinp (+ dinp_accumulate_into), dweight [channels] (float32, default "
         "zeros) + d/dweight; with alias the op gets one device tensor as both dout and dinp",
         {input("dout", "*rows,channels"), input("inp", "*rows,channels"), input("weight", "channels"),
          input("rstd", "rows").f32(), in_out("dweight", "channels").f32().or_zeros(),
          in_out("dinp_accumulate_into", "*rows,channels").or_output().sets("accumulate"),
          flag("alias", false).aliases("dinp_accumulate_into", "dout")},
         {"dinp_accumulate_into", "dweight"},
         [](OpCall& c) {
             c.backend().rmsnorm_backward(c["dinp_accumulate_into"], c["dweight"], c["dout"], c["inp"], c["weight"],
                                          c["rstd"], c.i("rows"), c.i("channels"), c.b("accumulate"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("channels");
             return s;
         }},
        {"rope_forward", "x [B, T, H, D] rotated (pairs (i, i + D/2)) by the angles of cos_sin [T, D/2, 2] (cos, sin)",
         {in_out("x", kAttention), input("cos_sin", "time,head_dim/2,2").f32()},
         {},
         [](OpCall& c) {
             c.backend().rope_forward(c["x"], c["cos_sin"], c.i("batch"), c.i("time"), c.i("heads"), c.i("head_dim"));
         }},
        {"rope_backward", "dx [B, T, H, D] rotated by the opposite angles (the gradient of rope_forward)",
         {in_out("dx", kAttention), input("cos_sin", "time,head_dim/2,2").f32()},
         {},
         [](OpCall& c) {
             c.backend().rope_backward(c["dx"], c["cos_sin"], c.i("batch"), c.i("time"), c.i("heads"), c.i("head_dim"));
         }},
        {"attention_forward",
         "(out, lse): softmax(q k^T / sqrt(D)) v with grouped kv heads, causal unless causal=False; q, out "
         "[B, T, H, D], k, v [B, T, Hkv, D], lse [B, H, T] float32; positions [B, T] int32 (each token's "
         "position in its document): query t attends keys t - positions[t] .. t; fused: in the backend's "
         "fused library (cuDNN)",
         {input("q", kAttention), input("k", kAttentionKV), input("v", kAttentionKV),
          tokens("positions", "batch,time", "time").optional(), output("out", kAttention),
          output("lse", "batch,heads,time").f32(), flag("causal", true), flag("fused", false)},
         {},
         [](OpCall& c) {
             c.backend().attention_forward(c["out"], c["lse"], c["q"], c["k"], c["v"], c["positions"], masked_attention(c));
         },
         attention_scratch, check_masked_attention},
        {"attention_backward",
         "(dq, dk, dv) of attention_forward; shapes, positions and causal as there; deterministic: the fused "
         "library's deterministic algorithm (else dq accumulated with atomics)",
         {input("dout", kAttention), input("out", kAttention), input("lse", "batch,heads,time").f32(),
          input("q", kAttention), input("k", kAttentionKV), input("v", kAttentionKV),
          tokens("positions", "batch,time", "time").optional(), output("dq", kAttention),
          output("dk", kAttentionKV), output("dv", kAttentionKV), flag("causal", true), flag("fused", false),
          flag("deterministic", true)},
         {},
         [](OpCall& c) {
             c.backend().attention_backward(c["dq"], c["dk"], c["dv"], c["dout"], c["out"], c["lse"], c["q"], c["k"],
                                            c["v"], c["positions"], masked_attention(c));
         },
         attention_backward_scratch, check_masked_attention},
        {"attention_decode",
         "out [H, D]: the query [H, D] of position time-1 attending to the cached keys, values [time, Hkv, D] "
         "(batch 1, as attention_forward's last row)",
         {input("query", "heads,head_dim"), input("keys", "time,kv_heads,head_dim"),
          input("values", "time,kv_heads,head_dim"), output("out", "heads,head_dim")},
         {},
         [](OpCall& c) {
             const AttentionShape shape{1, c.i("time"), c.i("heads"), c.i("kv_heads"), c.i("head_dim")};
             const std::int64_t width = std::int64_t(shape.heads) * shape.head_dim;
             const Tensor workspace = c.workspace(2 * shape.time * width, "dtype", "decode-workspace");
             const Tensor lse = c.upload(std::vector<float>(std::size_t(shape.heads) * shape.time, 0.0f),
                                         "decode-lse-workspace");
             c.backend().attention_decode(c["out"], c["query"], c["keys"], c["values"], shape, workspace, lse);
         },
         [](const OpCall& c) {
             ScratchShapes s = no_scratch();
             s.attention = AttentionShape{1, c.i("time"), c.i("heads"), c.i("kv_heads"), c.i("head_dim")};
             s.attention_impl = AttentionImpl::Native;
             return s;
         },
         check_attention},
        {"swiglu_forward", "silu(gate) * up, elementwise",
         {input("gate", "*n"), input("up", "*n"), output("out", "*n")},
         {},
         [](OpCall& c) { c.backend().swiglu_forward(c["out"], c["gate"], c["up"]); }},
        {"swiglu_backward",
         "(dgate, dup) of swiglu_forward; with alias the op gets one device tensor as both dout and dgate",
         {input("dout", "*n"), input("gate", "*n"), input("up", "*n"), flag("alias", false).aliases("dgate", "dout"),
          output("dgate", "*n"), output("dup", "*n")},
         {},
         [](OpCall& c) { c.backend().swiglu_backward(c["dgate"], c["dup"], c["dout"], c["gate"], c["up"]); }},
        {"cross_entropy",
         "(logits, stats) of the fused classifier on logits [rows, vocab] with targets [rows] (-100 = "
         "ignored): logits becomes the gradient of sum(CE + z_loss * lse^2) when with_grad; stats "
         "[slots] float64 (default: empty statistics) plus this chunk's; row r is at position "
         "(first_position + r) % time (time default: rows)",
         {in_out("logits", "rows,vocab"), targets("targets", "rows", "vocab"),
          in_out("stats", "slots").f64().or_stat_init(),
          integer("first_position", 0).at_least(0), integer_like("time", "rows").at_least(1), real("z_loss", 0.0),
          flag("with_grad", true)},
         {},
         [](OpCall& c) {
             c.backend().cross_entropy(c["logits"], c["targets"], c["stats"], c.i("rows"), c.i("vocab"),
                                       c.i("first_position"), c.i("time"), c.f("z_loss"), c.b("with_grad"));
         },
         [](const OpCall& c) {
             ScratchShapes s = no_scratch();
             s.classifier_rows = c.i("rows");
             s.vocab = c.i("vocab");
             return s;
         },
         nullptr,
         {{"slots", kStatCount}}},
        {"sum_squares", "out [1] (float64, default 0) + sum(x^2) of a float32 x",
         {input("x", "*n").f32(), in_out("out", "1").f64().or_zeros()},
         {},
         [](OpCall& c) { c.backend().sum_squares(c["out"], c["x"]); },
         [](const OpCall& c) {
             ScratchShapes s = no_scratch();
             s.max_reduce = c.i("n");
             return s;
         }},
        {"optimizer_scale", "[scale, grad_norm, skip] (float32) from gathered [ranks, stride] float64",
         {input("gathered", "ranks,stride").f64(), real("grad_clip"), output("out", "3").f32()},
         {},
         [](OpCall& c) {
             // The clip reaches the op as update() passes it: a float64 on the device.
             const Tensor clip = c.upload_f64({double(c.f("grad_clip"))}, "grad-clip");
             c.backend().optimizer_scale(c["out"], c["gathered"], c.i("ranks"), clip);
         },
         nullptr,
         nullptr,
         {{"stride", kGatherStride}}},
        {"adamw",
         "(param, m, v) after one AdamW step with gradient grad * scale (grad float32); m and v have "
         "device dtype state_dtype (default: dtype); bf16 values are stochastically rounded from seed",
         {in_out("param", "*n"), input("grad", "*n").f32(), in_out("m", "*n").dtype("state_dtype"),
          in_out("v", "*n").dtype("state_dtype"), real("lr"), real("scale", 1.0), real("beta1", 0.9),
          real("beta2", 0.999), real("eps", 1e-8), real("weight_decay", 0.0), integer("step", 1).at_least(1),
          seed("seed", 0), dtype_arg("dtype"), dtype_arg("state_dtype", "dtype")},
         {},
         [](OpCall& c) {
             // The scale reaches adamw as optimizer_scale writes it: [scale, norm, skip].
             const Tensor scale = c.upload({c.f("scale"), 0.0f, 0.0f}, "scale");
             c.backend().adamw(c["param"], c["grad"], c["m"], c["v"], scale,
                               AdamWStep{c.f("lr"), c.f("beta1"), c.f("beta2"), c.f("eps"), c.f("weight_decay"),
                                         c.i("step"), c.seed("seed")});
         }},
        {"adamw_shard",
         "(master, m, v, weights) after one AdamW step over a whole shard: segments [count, 3] float64 rows "
         "(first element, elements, decayed 0/1), each updated as adamw on successive chunks of `chunk` "
         "elements with seed + the chunk's first element; weights (given: with_weights) gets the updated "
         "master in weight_dtype",
         {in_out("master", "*n"), input("grad", "*n").f32(), in_out("m", "*n").dtype("state_dtype"),
          in_out("v", "*n").dtype("state_dtype"),
          in_out("weights", "*n").dtype("weight_dtype").or_zeros().sets("with_weights"),
          input("segments", "segments,3").f64(), real("lr"), real("scale", 1.0), real("beta1", 0.9),
          real("beta2", 0.999), real("eps", 1e-8), real("weight_decay", 0.0), integer("step", 1).at_least(1),
          seed("seed", 0), integer("chunk", 4096).at_least(1), flag("use_default", false), dtype_arg("dtype"),
          dtype_arg("state_dtype", "dtype"), dtype_arg("weight_dtype", "dtype")},
         {},
         [](OpCall& c) {
             const Tensor scale = c.upload({c.f("scale"), 0.0f, 0.0f}, "scale");
             const AdamWStep step{c.f("lr"), c.f("beta1"), c.f("beta2"), c.f("eps"), c.f("weight_decay"),
                                  c.i("step"), 0};
             const Tensor values = c.upload_f64(adamw_step_values(step, c.seed("seed")), "step-values");
             const AdamWShard shard{c["master"], c.b("with_weights") ? c["weights"] : Tensor(), c["grad"], c["m"],
                                    c["v"], scale, values, c["segments"], c.i("chunk")};
             NANOQ_COMPOSITE(c, adamw_shard, shard);
         }},
        // ---- Composite ops (backend.h). Each takes use_default: run the
        // interface's default body (its composition of primitives) even where
        // the backend overrides the op, the reference an override is tested
        // against (tests/test_composites.py).
        {"matmul_epilogue",
         "scale * op(a) @ op(b) + bias [M, N] (+ out when given, then scale must be 1); out_dtype is the "
         "output's (and bias's) device dtype",
         {input("a", "trans_a?K,M:M,K"), input("b", "trans_b?N,K:K,N"), input("bias", "N").optional().dtype("out_dtype"),
          flag("trans_a", false), flag("trans_b", false),
          in_out("out", "M,N").or_output().sets("accumulate").dtype("out_dtype"), real("scale", 1.0),
          flag("use_default", false), dtype_arg("dtype"), dtype_arg("out_dtype", "dtype")},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, matmul_epilogue, c["out"], c["a"], c["b"], c["bias"], c.i("M"), c.i("N"),
                             c.i("K"), c.b("trans_a"), c.b("trans_b"), c.b("accumulate"), c.f("scale"));
         }},
        {"matmul_input_grad",
         "dx [rows, k] = dy @ weight (+ dx when given): the input gradient of y = x @ weight^T",
         {input("dy", "rows,n"), input("weight", "n,k"), in_out("dx", "rows,k").or_output().sets("accumulate"),
          flag("use_default", false)},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, matmul_input_grad, c["dx"], c["dy"], c["weight"], c.i("rows"), c.i("n"), c.i("k"),
                             c.b("accumulate"));
         }},
        {"matmul_weight_grad",
         "(dweight, dbias): dweight [n, k] + dy^T x and, when dbias is given, dbias [n] + column sums of dy "
         "(float32, default zeros)",
         {input("dy", "rows,n"), input("x", "rows,k"), in_out("dweight", "n,k").f32().or_zeros(),
          in_out("dbias", "n").f32().or_zeros().sets("with_bias"), flag("use_default", false)},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, matmul_weight_grad, c["dweight"], c.b("with_bias") ? c["dbias"] : Tensor(), c["dy"],
                             c["x"], c.i("rows"), c.i("n"), c.i("k"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("n");
             return s;
         }},
        {"matmul_backward",
         "(dx, dweight, dbias): a projection's backward, matmul_input_grad then (unless frozen: dweight and dbias "
         "come back as given) matmul_weight_grad",
         {input("dy", "rows,n"), input("weight", "n,k"), input("x", "rows,k"),
          in_out("dx", "rows,k").or_output().sets("accumulate"), in_out("dweight", "n,k").f32().or_zeros(),
          in_out("dbias", "n").f32().or_zeros().sets("with_bias"), flag("frozen", false), flag("use_default", false)},
         {},
         [](OpCall& c) {
             const bool frozen = c.b("frozen");
             NANOQ_COMPOSITE(c, matmul_backward, c["dx"], c.b("accumulate"), frozen ? Tensor() : c["dweight"],
                             c.b("with_bias") && !frozen ? c["dbias"] : Tensor(), c["dy"], c["weight"], c["x"],
                             c.i("rows"), c.i("n"), c.i("k"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("n");
             return s;
         }},
        {"residual_rmsnorm_forward",
         "(residual_out, out, rstd): residual_out = residual + delta, out = rmsnorm(residual_out) * weight; "
         "with into_delta the sum is written over delta's device tensor",
         {input("residual", "*rows,channels"), input("delta", "*rows,channels"), input("weight", "channels"),
          real("eps", 1e-6), flag("into_delta", false).aliases("residual_out", "delta"), flag("use_default", false),
          output("residual_out", "*rows,channels"), output("out", "*rows,channels"), output("rstd", "*rows").f32()},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, residual_rmsnorm_forward, c["residual_out"], c["out"], c["rstd"], c["residual"],
                             c["delta"], c["weight"], c.i("rows"), c.i("channels"), c.f("eps"));
         }},
        {"residual_rmsnorm_backward",
         "(dresidual, dweight): dresidual [rows, channels] + the norm's input gradient of dout, dweight "
         "(float32, default zeros) + its weight gradient",
         {input("dout", "*rows,channels"), input("residual_out", "*rows,channels"), input("weight", "channels"),
          input("rstd", "*rows").f32(), in_out("dresidual", "*rows,channels").or_zeros(),
          in_out("dweight", "channels").f32().or_zeros(), flag("use_default", false)},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, residual_rmsnorm_backward, c["dresidual"], c["dweight"], c["dout"], c["residual_out"],
                             c["weight"], c["rstd"], c.i("rows"), c.i("channels"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("channels");
             return s;
         }},
        {"qkv_projection",
         "(q, k, v, q_raw, k_raw): x [rows, hidden] by the packed qkv [(heads + 2 kv_heads) head_dim, hidden] "
         "(+ qkv_bias); with q_norm/k_norm given the q and k projections go to q_raw, k_raw (else q, k)",
         qkv_args(true, {input("x", "rows,hidden"), output("q", kQ), output("k", kK), output("v", kK),
                         output("q_raw", kQ), output("k_raw", kK)}),
         {},
         [](OpCall& c) { NANOQ_COMPOSITE(c, qkv_projection, qkv_activations(c), c["x"], qkv_weights(c), qkv_shape(c)); },
         qkv_scratch, check_packed_qkv},
        {"qk_norm_rope_forward",
         "(q, k, q_rstd, k_rstd): with q_norm/k_norm the per-head norms of q_raw, k_raw into q, k, then RoPE "
         "on q and k in place (without norms q and k are in/out)",
         qkv_args(false, {input("q_raw", kQ).optional(), input("k_raw", kK).optional(),
                          in_out("q", kQ).or_output(), in_out("k", kK).or_output(), output("q_rstd", kQRows).f32(),
                          output("k_rstd", kKRows).f32(), input("cos_sin", kCosSin).f32()}),
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, qk_norm_rope_forward, qkv_activations(c), qkv_weights(c), c["cos_sin"],
                             qk_norm_shape(c));
         },
         attention_shapes, check_qkv},
        {"qkv_forward",
         "(q, k, v, q_raw, k_raw, q_rstd, k_rstd): qkv_projection then qk_norm_rope_forward",
         qkv_args(true, {input("x", "rows,hidden"), input("cos_sin", kCosSin).f32(), output("q", kQ),
                         output("k", kK), output("v", kK), output("q_raw", kQ), output("k_raw", kK),
                         output("q_rstd", kQRows).f32(), output("k_rstd", kKRows).f32()}),
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, qkv_forward, qkv_activations(c), c["x"], qkv_weights(c), c["cos_sin"], qkv_shape(c));
         },
         qkv_scratch, check_packed_qkv},
        {"qk_norm_rope_backward",
         "(dq, dk, dq_norm, dk_norm): the gradients of the rotated q, k turned into those of the projections, in "
         "place; with q_norm/k_norm (and the saved q_raw, k_raw, q_rstd, k_rstd) the norm weight gradients "
         "(float32, default zeros) added",
         qkv_args(false, {in_out("dq", kQ), in_out("dk", kK), input("q_raw", kQ).optional(),
                          input("k_raw", kK).optional(), input("q_rstd", kQRows).f32().optional(),
                          input("k_rstd", kKRows).f32().optional(), input("cos_sin", kCosSin).f32(),
                          in_out("dq_norm", "head_dim").f32().or_zeros(),
                          in_out("dk_norm", "head_dim").f32().or_zeros()}),
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, qk_norm_rope_backward, c["dq"], c["dk"], qkv_activations(c), qkv_weights(c),
                             qkv_grads(c), c["cos_sin"], qk_norm_shape(c));
         },
         attention_shapes, check_qkv},
        {"qkv_projection_backward",
         "(dx, dqkv, dqkv_bias): dx [rows, hidden] = [dq dk dv] qkv (+ dx when given); unless frozen, "
         "dqkv + [dq dk dv]^T x and, with qkv_bias, dqkv_bias + column sums (float32, default zeros)",
         qkv_args(true, {input("dq", kQ), input("dk", kK), input("dv", kK), input("x", "rows,hidden"),
                         in_out("dx", "rows,hidden").or_output().sets("accumulate"), flag("frozen", false),
                         in_out("dqkv", "packed,hidden").f32().or_zeros(),
                         in_out("dqkv_bias", "packed").f32().or_zeros()}),
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, qkv_projection_backward, c["dx"], c.b("accumulate"), qkv_grads(c), c["dq"], c["dk"],
                             c["dv"], c["x"], qkv_weights(c), qkv_shape(c));
         },
         qkv_scratch, check_packed_qkv},
        {"qkv_backward",
         "(dx, dq, dk, dqkv, dqkv_bias, dq_norm, dk_norm): qk_norm_rope_backward then qkv_projection_backward",
         qkv_args(true, {in_out("dq", kQ), in_out("dk", kK), input("dv", kK), input("x", "rows,hidden"),
                         input("q_raw", kQ).optional(), input("k_raw", kK).optional(),
                         input("q_rstd", kQRows).f32().optional(), input("k_rstd", kKRows).f32().optional(),
                         input("cos_sin", kCosSin).f32(), in_out("dx", "rows,hidden").or_output().sets("accumulate"),
                         flag("frozen", false), in_out("dqkv", "packed,hidden").f32().or_zeros(),
                         in_out("dqkv_bias", "packed").f32().or_zeros(),
                         in_out("dq_norm", "head_dim").f32().or_zeros(),
                         in_out("dk_norm", "head_dim").f32().or_zeros()}),
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, qkv_backward, c["dx"], c.b("accumulate"), qkv_grads(c), c["dq"], c["dk"], c["dv"],
                             qkv_activations(c), c["x"], qkv_weights(c), c["cos_sin"], qkv_shape(c));
         },
         qkv_scratch, check_packed_qkv},
        {"gate_up_projection", "(gate, up): x [rows, channels] by the packed gate_up [2, intermediate, channels]",
         {input("x", "rows,channels"), input("gate_up", "2,intermediate,channels"), flag("use_default", false),
          output("gate", "rows,intermediate"), output("up", "rows,intermediate")},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, gate_up_projection, c["gate"], c["up"], c["x"], c["gate_up"], c.i("rows"),
                             c.i("intermediate"), c.i("channels"));
         },
         gate_up_scratch},
        {"gate_up_swiglu_forward", "(gate, up, out): gate_up_projection, then out = silu(gate) * up",
         {input("x", "rows,channels"), input("gate_up", "2,intermediate,channels"), flag("use_default", false),
          output("gate", "rows,intermediate"), output("up", "rows,intermediate"), output("out", "rows,intermediate")},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, gate_up_swiglu_forward, c["out"], c["gate"], c["up"], c["x"], c["gate_up"],
                             c.i("rows"), c.i("intermediate"), c.i("channels"));
         },
         gate_up_scratch},
        {"gate_up_projection_backward",
         "(dx, dgate_up): dx [rows, channels] = dgate Wg + dup Wu (+ dx when given); unless frozen, "
         "dgate_up (float32, default zeros) + the weight gradient",
         {input("dgate", "rows,intermediate"), input("dup", "rows,intermediate"), input("x", "rows,channels"),
          input("gate_up", "2,intermediate,channels"),
          in_out("dx", "rows,channels").or_output().sets("accumulate"), flag("frozen", false),
          in_out("dgate_up", "2,intermediate,channels").f32().or_zeros(), flag("use_default", false)},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, gate_up_projection_backward, c["dx"], c.b("accumulate"),
                             c.b("frozen") ? Tensor() : c["dgate_up"], c["dgate"], c["dup"], c["x"], c["gate_up"],
                             c.i("rows"), c.i("intermediate"), c.i("channels"));
         },
         gate_up_scratch},
        {"swiglu_gate_up_backward",
         "(dx, dgate, dup, dgate_up): the SwiGLU backward of dout into dgate, dup (with alias dout's device "
         "tensor is dgate's), then gate_up_projection_backward",
         {input("dout", "rows,intermediate"), input("gate", "rows,intermediate"), input("up", "rows,intermediate"),
          input("x", "rows,channels"), input("gate_up", "2,intermediate,channels"),
          in_out("dx", "rows,channels").or_output().sets("accumulate"), flag("frozen", false),
          in_out("dgate_up", "2,intermediate,channels").f32().or_zeros(),
          flag("alias", false).aliases("dgate", "dout"), flag("use_default", false),
          output("dgate", "rows,intermediate"), output("dup", "rows,intermediate")},
         {},
         [](OpCall& c) {
             NANOQ_COMPOSITE(c, swiglu_gate_up_backward, c["dx"], c.b("accumulate"),
                             c.b("frozen") ? Tensor() : c["dgate_up"], c["dgate"], c["dup"], c["dout"], c["gate"],
                             c["up"], c["x"], c["gate_up"], c.i("rows"), c.i("intermediate"), c.i("channels"));
         },
         gate_up_scratch},
        {"classifier",
         "(stats, dhidden, dlm_head): logits = hidden [rows, channels] lm_head [vocab, channels]^T in chunks of "
         "chunk_rows rows, the cross-entropy statistics (row r at position r % time) added to stats and, "
         "with_grad, dhidden and dlm_head (float32, default zeros) + the gradients of sum(CE + z_loss lse^2)",
         {input("hidden", "rows,channels"), input("lm_head", "vocab,channels"), targets("targets", "rows", "vocab"),
          in_out("stats", "slots").f64().or_stat_init(), integer("chunk_rows").at_least(1),
          integer_like("time", "rows").at_least(1), real("z_loss", 0.0), flag("with_grad", true),
          in_out("dlm_head", "vocab,channels").f32().or_zeros(), flag("use_default", false),
          output("dhidden", "rows,channels")},
         {},
         [](OpCall& c) {
             const int rows = c.i("rows"), vocab = c.i("vocab"), chunk = std::min(c.i("chunk_rows"), rows);
             const Tensor workspace = c.workspace(std::int64_t(chunk) * vocab, "dtype", "logits");
             const bool grad = c.b("with_grad");
             NANOQ_COMPOSITE(c, classifier, c["hidden"], c["lm_head"], c["targets"], c["stats"],
                             grad ? c["dhidden"] : Tensor(), grad ? c["dlm_head"] : Tensor(), workspace, rows,
                             c.i("channels"), vocab, c.i("time"), c.f("z_loss"));
         },
         [](const OpCall& c) {
             ScratchShapes s = row_scratch(c.i("rows"));
             s.hidden = c.i("channels");
             s.vocab = c.i("vocab");
             s.classifier_rows = std::min(c.i("chunk_rows"), c.i("rows"));
             return s;
         },
         nullptr,
         {{"slots", kStatCount}}},
    };
}

}  // namespace

const std::vector<OpSpec>& op_table() {
    static const std::vector<OpSpec> table = [] {
        std::vector<OpSpec> t = make_table();
        validate_table(t);
        return t;
    }();
    return table;
}

}  // namespace nanoq::ops
