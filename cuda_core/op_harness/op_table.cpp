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
#include <string>

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

ScratchShapes attention_scratch(const OpCall& c) {
    ScratchShapes s = no_scratch();
    s.attention = attention(c);
    return s;
}

void check_attention(const OpCall& c) {
    require(c.i("heads") % c.i("kv_heads") == 0, "heads (" + std::to_string(c.i("heads")) +
                                                     ") must be a multiple of kv_heads (" +
                                                     std::to_string(c.i("kv_heads")) + ")");
    require(c.i("head_dim") % 2 == 0, "head_dim must be even, got " + std::to_string(c.i("head_dim")));
}

const char* const kAttention = "batch,time,heads,head_dim";
const char* const kAttentionKV = "batch,time,kv_heads,head_dim";

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
         [](OpCall& c) { c.backend().scale_dropout(c["out"], c["x"], c.f("scale"), c.f("drop"), c.seed("seed")); },
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
         "(out, lse): causal softmax(q k^T / sqrt(D)) v with grouped kv heads; q, out [B, T, H, D], "
         "k, v [B, T, Hkv, D], lse [B, H, T] float32",
         {input("q", kAttention), input("k", kAttentionKV), input("v", kAttentionKV), output("out", kAttention),
          output("lse", "batch,heads,time").f32()},
         {},
         [](OpCall& c) { c.backend().attention_forward(c["out"], c["lse"], c["q"], c["k"], c["v"], attention(c)); },
         attention_scratch, check_attention},
        {"attention_backward", "(dq, dk, dv) of attention_forward; shapes as there",
         {input("dout", kAttention), input("out", kAttention), input("lse", "batch,heads,time").f32(),
          input("q", kAttention), input("k", kAttentionKV), input("v", kAttentionKV), output("dq", kAttention),
          output("dk", kAttentionKV), output("dv", kAttentionKV)},
         {},
         [](OpCall& c) {
             c.backend().attention_backward(c["dq"], c["dk"], c["dv"], c["dout"], c["out"], c["lse"], c["q"], c["k"],
                                            c["v"], attention(c));
         },
         attention_scratch, check_attention},
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
         [](OpCall& c) { c.backend().optimizer_scale(c["out"], c["gathered"], c.i("ranks"), c.f("grad_clip")); },
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
