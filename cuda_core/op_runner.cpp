// OpRunner: one backend op per call on host arrays (see nanoq/op_runner.h).
//
// Each call is an OpCall: a fresh NamedAllocator whose scratch is reserved
// for the shapes of that call only, the device tensors staged from the host,
// and the list of tensors to copy back. Reserving per call keeps every op
// independent of the others' sizes; in particular ops that are not attention
// reserve rows as batch = rows, time = 1, because the cpu backend's attention
// scratch grows with time^2.
#include "nanoq/op_runner.h"

#include <algorithm>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>

#include "allocator.h"
#include "backend.h"

namespace nanoq {
namespace {

static_assert(std::is_same<StatValue, double>::value, "nanoq/op_runner.h passes statistics as double");

constexpr int kIgnoreIndex = -100;

void require(bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument(what);
}

void require_positive(std::int64_t value, const char* name) {
    require(value > 0, std::string(name) + " must be positive, got " + std::to_string(value));
}

DType device_dtype(OpDType dtype) { return dtype == OpDType::BF16 ? DType::BF16 : DType::F32; }

ScratchShapes no_scratch() { return ScratchShapes{AttentionShape{0, 0, 0, 0, 0}, 0, 0, 0, 0, 0}; }

ScratchShapes row_scratch(int rows) {
    ScratchShapes s = no_scratch();
    s.attention.batch = rows;
    s.attention.time = 1;
    return s;
}

// One op invocation: its allocator, its staged tensors and the copies back.
class OpCall {
public:
    OpCall(Backend& backend, int device, const ScratchShapes& scratch) : backend_(backend), allocator_(backend, device) {
        backend_.reserve_scratch(allocator_, scratch);
    }

    // Host float32 values as a device tensor of `dtype` (cast on the device).
    Tensor input(const float* host, std::int64_t n, DType dtype, const std::string& name) {
        Tensor staged = allocator_.allocate(Context::Workspace, name + "-float32", DType::F32, {n});
        backend_.copy_from_host(staged, host);
        if (dtype == DType::F32) return staged;
        Tensor tensor = allocator_.allocate(Context::Workspace, name, dtype, {n});
        backend_.copy(tensor, staged);
        return tensor;
    }

    Tensor input(const std::int32_t* host, std::int64_t n, const std::string& name) {
        return raw_input(host, n, DType::I32, name);
    }
    Tensor input(const StatValue* host, std::int64_t n, const std::string& name) {
        return raw_input(host, n, kStatDType, name);
    }

    // A tensor the op overwrites: NaN until then, copied back by finish().
    Tensor output(float* host, std::int64_t n, DType dtype, const std::string& name) {
        Tensor tensor = allocator_.allocate(Context::Workspace, name, dtype, {n});
        backend_.fill(tensor, std::numeric_limits<float>::quiet_NaN());
        download(host, tensor);
        return tensor;
    }

    // A tensor the op reads and updates: uploaded, and copied back by finish().
    Tensor in_out(float* host, std::int64_t n, DType dtype, const std::string& name) {
        Tensor tensor = input(host, n, dtype, name);
        download(host, tensor);
        return tensor;
    }
    Tensor in_out(StatValue* host, std::int64_t n, const std::string& name) {
        Tensor tensor = input(host, n, name);
        download(host, tensor);
        return tensor;
    }

    // Host arrays are float32 for float32 and bf16 tensors, float64 for statistics.
    void download(void* host, const Tensor& tensor) { downloads_.push_back(Download{host, tensor}); }

    // Copies every download back and waits for the device.
    void finish() {
        for (const Download& d : downloads_) {
            Tensor source = d.tensor;
            if (source.dtype == DType::BF16) {
                source = allocator_.allocate(Context::Workspace, "download-float32", DType::F32, {d.tensor.numel()});
                backend_.copy(source, d.tensor);
            }
            backend_.copy_to_host(d.host, source);
        }
        backend_.synchronize();
    }

private:
    Tensor raw_input(const void* host, std::int64_t n, DType dtype, const std::string& name) {
        Tensor tensor = allocator_.allocate(Context::Workspace, name, dtype, {n});
        backend_.copy_from_host(tensor, host);
        return tensor;
    }

    struct Download {
        void* host;
        Tensor tensor;
    };
    Backend& backend_;
    NamedAllocator allocator_;
    std::vector<Download> downloads_;
};

}  // namespace

struct OpRunner::Impl {
    std::string name;
    int device = 0;
    std::unique_ptr<Backend> backend;
    std::mutex mutex;  // one op at a time: the backend's scratch is shared

    // Checks `dtype` for this backend and returns its device dtype.
    DType dtype(OpDType d) const {
        require(d == OpDType::F32 || d == OpDType::BF16, "dtype must be fp32 or bf16");
        require(!(d == OpDType::BF16 && name == "cpu"), "the cpu backend computes in float32 only; use dtype fp32");
        return device_dtype(d);
    }
};

OpRunner::OpRunner(const std::string& backend, int device, int threads) : impl_(std::make_unique<Impl>()) {
    const BackendPlugin& plugin = find_backend(backend);
    const int devices = plugin.device_count();
    require(device >= 0 && device < devices, "device " + std::to_string(device) + " of the " + backend +
                                                 " backend asked for, but it has " + std::to_string(devices) +
                                                 " usable device(s)");
    if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    impl_->name = backend;
    impl_->device = device;
    impl_->backend = plugin.create_backend(device, threads);
}

OpRunner::~OpRunner() = default;

const std::string& OpRunner::backend_name() const { return impl_->name; }
int OpRunner::device() const { return impl_->device; }

std::vector<std::string> OpRunner::stat_slots() {
#define NANOQ_STAT_NAME(id, name) name,
    return {NANOQ_STAT_SLOTS(NANOQ_STAT_NAME)};
#undef NANOQ_STAT_NAME
}

int OpRunner::gather_stride() { return kGatherStride; }

void OpRunner::copy(float* out, const float* x, std::int64_t n, OpDType src, OpDType dst) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor from = call.input(x, n, impl_->dtype(src), "x");
    Tensor to = call.output(out, n, impl_->dtype(dst), "out");
    impl_->backend->copy(to, from);
    call.finish();
}

void OpRunner::fill(float* out, std::int64_t n, float value, OpDType dtype) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    // Filled from zeros, so that a fill which writes nothing is seen.
    std::vector<float> zeros(static_cast<std::size_t>(n), 0.0f);
    Tensor t = call.input(zeros.data(), n, impl_->dtype(dtype), "out");
    call.download(out, t);
    impl_->backend->fill(t, value);
    call.finish();
}

void OpRunner::matmul(float* out, const float* a, const float* b, int M, int N, int K, bool trans_a, bool trans_b,
                      bool accumulate, OpDType dtype, OpDType out_dtype) {
    require_positive(M, "M");
    require_positive(N, "N");
    require_positive(K, "K");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype), out_t = impl_->dtype(out_dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    const std::int64_t out_n = std::int64_t(M) * N;
    Tensor o = accumulate ? call.in_out(out, out_n, out_t, "out") : call.output(out, out_n, out_t, "out");
    Tensor ta = call.input(a, std::int64_t(M) * K, t, "a");
    Tensor tb = call.input(b, std::int64_t(K) * N, t, "b");
    impl_->backend->matmul(o, ta, tb, M, N, K, trans_a, trans_b, accumulate);
    call.finish();
}

void OpRunner::add_bias(float* out, const float* bias, int rows, int cols, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(cols, "cols");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.in_out(out, std::int64_t(rows) * cols, t, "out");
    impl_->backend->add_bias(o, call.input(bias, cols, t, "bias"), rows, cols);
    call.finish();
}

void OpRunner::bias_backward(float* dbias, const float* dout, int rows, int cols, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(cols, "cols");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    ScratchShapes scratch = row_scratch(rows);
    scratch.hidden = cols;
    OpCall call(*impl_->backend, impl_->device, scratch);
    Tensor db = call.in_out(dbias, cols, DType::F32, "dbias");
    impl_->backend->bias_backward(db, call.input(dout, std::int64_t(rows) * cols, t, "dout"), rows, cols);
    call.finish();
}

void OpRunner::add(float* out, const float* a, const float* b, std::int64_t n, OpDType dtype) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.output(out, n, t, "out");
    impl_->backend->add(o, call.input(a, n, t, "a"), call.input(b, n, t, "b"));
    call.finish();
}

void OpRunner::accumulate(float* out, const float* a, std::int64_t n, OpDType dtype) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.in_out(out, n, t, "out");
    impl_->backend->accumulate(o, call.input(a, n, t, "a"));
    call.finish();
}

void OpRunner::scale_dropout(float* out, const float* in, std::int64_t n, float scale, float drop,
                             std::uint64_t seed, OpDType dtype) {
    require_positive(n, "n");
    require(drop >= 0.0f && drop < 1.0f, "drop must be in [0, 1)");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.output(out, n, t, "out");
    impl_->backend->scale_dropout(o, call.input(in, n, t, "in"), scale, drop, seed);
    call.finish();
}

namespace {

void check_tokens(const std::int32_t* tokens, int rows, int vocab, bool allow_ignore, const char* name) {
    for (int r = 0; r < rows; ++r) {
        const std::int32_t token = tokens[r];
        if (allow_ignore && token == kIgnoreIndex) continue;
        require(token >= 0 && token < vocab, std::string(name) + "[" + std::to_string(r) + "] = " +
                                                 std::to_string(token) + " is outside [0, vocab_size " +
                                                 std::to_string(vocab) + ")" + (allow_ignore ? " and not -100" : ""));
    }
}

}  // namespace

void OpRunner::embedding_forward(float* out, const std::int32_t* tokens, const float* table, int rows, int channels,
                                 int vocab, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(channels, "channels");
    require_positive(vocab, "vocab");
    check_tokens(tokens, rows, vocab, false, "tokens");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.output(out, std::int64_t(rows) * channels, t, "out");
    impl_->backend->embedding_forward(o, call.input(tokens, rows, "tokens"),
                                      call.input(table, std::int64_t(vocab) * channels, t, "table"), rows, channels);
    call.finish();
}

void OpRunner::embedding_backward(float* table_grad, const float* dout, const std::int32_t* tokens, int rows,
                                  int channels, int vocab, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(channels, "channels");
    require_positive(vocab, "vocab");
    check_tokens(tokens, rows, vocab, false, "tokens");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    ScratchShapes scratch = row_scratch(rows);
    scratch.vocab = vocab;
    OpCall call(*impl_->backend, impl_->device, scratch);
    Tensor g = call.in_out(table_grad, std::int64_t(vocab) * channels, DType::F32, "table-grad");
    impl_->backend->embedding_backward(g, call.input(dout, std::int64_t(rows) * channels, t, "dout"),
                                       call.input(tokens, rows, "tokens"), rows, channels);
    call.finish();
}

void OpRunner::rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int rows,
                               int channels, float eps, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(channels, "channels");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    const std::int64_t n = std::int64_t(rows) * channels;
    Tensor o = call.output(out, n, t, "out");
    Tensor rs = call.output(rstd, rows, DType::F32, "rstd");
    impl_->backend->rmsnorm_forward(o, rs, call.input(inp, n, t, "inp"), call.input(weight, channels, t, "weight"),
                                    rows, channels, eps);
    call.finish();
}

void OpRunner::rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                                const float* rstd, int rows, int channels, bool accumulate, bool dinp_aliases_dout,
                                OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(channels, "channels");
    require(!(accumulate && dinp_aliases_dout), "dinp may alias dout only when not accumulating");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    ScratchShapes scratch = row_scratch(rows);
    scratch.hidden = channels;
    OpCall call(*impl_->backend, impl_->device, scratch);
    const std::int64_t n = std::int64_t(rows) * channels;
    Tensor dy = call.input(dout, n, t, "dout");
    Tensor dx;
    if (dinp_aliases_dout) {
        dx = dy;
        call.download(dinp, dx);
    } else {
        dx = accumulate ? call.in_out(dinp, n, t, "dinp") : call.output(dinp, n, t, "dinp");
    }
    Tensor dw = call.in_out(dweight, channels, DType::F32, "dweight");
    impl_->backend->rmsnorm_backward(dx, dw, dy, call.input(inp, n, t, "inp"), call.input(weight, channels, t, "weight"),
                                     call.input(rstd, rows, DType::F32, "rstd"), rows, channels, accumulate);
    call.finish();
}

namespace {

void check_rope(int batch, int time, int heads, int head_dim) {
    require_positive(batch, "batch");
    require_positive(time, "time");
    require_positive(heads, "heads");
    require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even, got " + std::to_string(head_dim));
}

}  // namespace

void OpRunner::rope_forward(float* x, const float* cos_sin, int batch, int time, int heads, int head_dim,
                            OpDType dtype) {
    check_rope(batch, time, heads, head_dim);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor tx = call.in_out(x, std::int64_t(batch) * time * heads * head_dim, t, "x");
    impl_->backend->rope_forward(tx, call.input(cos_sin, std::int64_t(time) * head_dim, DType::F32, "cos-sin"), batch,
                                 time, heads, head_dim);
    call.finish();
}

void OpRunner::rope_backward(float* dx, const float* cos_sin, int batch, int time, int heads, int head_dim,
                             OpDType dtype) {
    check_rope(batch, time, heads, head_dim);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor tdx = call.in_out(dx, std::int64_t(batch) * time * heads * head_dim, t, "dx");
    impl_->backend->rope_backward(tdx, call.input(cos_sin, std::int64_t(time) * head_dim, DType::F32, "cos-sin"),
                                  batch, time, heads, head_dim);
    call.finish();
}

namespace {

AttentionShape attention_shape(int batch, int time, int heads, int kv_heads, int head_dim) {
    require_positive(batch, "batch");
    require_positive(time, "time");
    require_positive(heads, "heads");
    require_positive(kv_heads, "kv_heads");
    require(heads % kv_heads == 0, "heads (" + std::to_string(heads) + ") must be a multiple of kv_heads (" +
                                       std::to_string(kv_heads) + ")");
    require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even, got " + std::to_string(head_dim));
    return AttentionShape{batch, time, heads, kv_heads, head_dim};
}

ScratchShapes attention_scratch(const AttentionShape& shape) {
    ScratchShapes s = no_scratch();
    s.attention = shape;
    return s;
}

}  // namespace

void OpRunner::attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int batch,
                                 int time, int heads, int kv_heads, int head_dim, OpDType dtype) {
    const AttentionShape s = attention_shape(batch, time, heads, kv_heads, head_dim);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, attention_scratch(s));
    const std::int64_t rows = std::int64_t(batch) * time;
    const std::int64_t q_n = rows * heads * head_dim, kv_n = rows * kv_heads * head_dim;
    Tensor o = call.output(out, q_n, t, "out");
    Tensor l = call.output(lse, rows * heads, DType::F32, "lse");
    impl_->backend->attention_forward(o, l, call.input(q, q_n, t, "q"), call.input(k, kv_n, t, "k"),
                                      call.input(v, kv_n, t, "v"), s);
    call.finish();
}

void OpRunner::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                                  const float* lse, const float* q, const float* k, const float* v, int batch,
                                  int time, int heads, int kv_heads, int head_dim, OpDType dtype) {
    const AttentionShape s = attention_shape(batch, time, heads, kv_heads, head_dim);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, attention_scratch(s));
    const std::int64_t rows = std::int64_t(batch) * time;
    const std::int64_t q_n = rows * heads * head_dim, kv_n = rows * kv_heads * head_dim;
    Tensor tdq = call.output(dq, q_n, t, "dq");
    Tensor tdk = call.output(dk, kv_n, t, "dk");
    Tensor tdv = call.output(dv, kv_n, t, "dv");
    impl_->backend->attention_backward(tdq, tdk, tdv, call.input(dout, q_n, t, "dout"), call.input(out, q_n, t, "out"),
                                       call.input(lse, rows * heads, DType::F32, "lse"), call.input(q, q_n, t, "q"),
                                       call.input(k, kv_n, t, "k"), call.input(v, kv_n, t, "v"), s);
    call.finish();
}

void OpRunner::swiglu_forward(float* out, const float* gate, const float* up, std::int64_t n, OpDType dtype) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.output(out, n, t, "out");
    impl_->backend->swiglu_forward(o, call.input(gate, n, t, "gate"), call.input(up, n, t, "up"));
    call.finish();
}

void OpRunner::swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                               std::int64_t n, bool dgate_aliases_dout, OpDType dtype) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor dy = call.input(dout, n, t, "dout");
    Tensor dg;
    if (dgate_aliases_dout) {
        dg = dy;
        call.download(dgate, dg);
    } else {
        dg = call.output(dgate, n, t, "dgate");
    }
    Tensor du = call.output(dup, n, t, "dup");
    impl_->backend->swiglu_backward(dg, du, dy, call.input(gate, n, t, "gate"), call.input(up, n, t, "up"));
    call.finish();
}

void OpRunner::cross_entropy(float* logits, const std::int32_t* targets, double* stats, int rows, int vocab,
                             int first_position, int time, float z_loss, bool with_grad, OpDType dtype) {
    require_positive(rows, "rows");
    require_positive(vocab, "vocab");
    require_positive(time, "time");
    require(first_position >= 0, "first_position must be >= 0, got " + std::to_string(first_position));
    check_tokens(targets, rows, vocab, true, "targets");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType t = impl_->dtype(dtype);
    ScratchShapes scratch = no_scratch();
    scratch.classifier_rows = rows;
    scratch.vocab = vocab;
    OpCall call(*impl_->backend, impl_->device, scratch);
    Tensor lg = call.in_out(logits, std::int64_t(rows) * vocab, t, "logits");
    Tensor st = call.in_out(stats, kStatCount, "stats");
    impl_->backend->cross_entropy(lg, call.input(targets, rows, "targets"), st, rows, vocab, first_position, time,
                                  z_loss, with_grad);
    call.finish();
}

void OpRunner::sum_squares(double* out, const float* x, std::int64_t n) {
    require_positive(n, "n");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    ScratchShapes scratch = no_scratch();
    scratch.max_reduce = n;
    OpCall call(*impl_->backend, impl_->device, scratch);
    Tensor o = call.in_out(out, 1, "out");
    impl_->backend->sum_squares(o, call.input(x, n, DType::F32, "x"));
    call.finish();
}

void OpRunner::optimizer_scale(float* out, const double* gathered, int ranks, float grad_clip) {
    require_positive(ranks, "ranks");
    std::lock_guard<std::mutex> lock(impl_->mutex);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor o = call.output(out, 3, DType::F32, "out");
    impl_->backend->optimizer_scale(o, call.input(gathered, std::int64_t(ranks) * kGatherStride, "gathered"), ranks,
                                    grad_clip);
    call.finish();
}

void OpRunner::adamw(float* param, const float* grad, float* m, float* v, std::int64_t n, float scale, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int step, std::uint64_t seed,
                     OpDType dtype, OpDType state_dtype) {
    require_positive(n, "n");
    require(step >= 1, "step is 1-based, got " + std::to_string(step));
    std::lock_guard<std::mutex> lock(impl_->mutex);
    const DType param_t = impl_->dtype(dtype), state_t = impl_->dtype(state_dtype);
    OpCall call(*impl_->backend, impl_->device, no_scratch());
    Tensor p = call.in_out(param, n, param_t, "param");
    Tensor tm = call.in_out(m, n, state_t, "m");
    Tensor tv = call.in_out(v, n, state_t, "v");
    const float scale_norm_skip[3] = {scale, 0.0f, 0.0f};  // the layout optimizer_scale writes
    impl_->backend->adamw(p, call.input(grad, n, DType::F32, "grad"), tm, tv,
                          call.input(scale_norm_skip, 3, DType::F32, "scale"),
                          AdamWStep{lr, beta1, beta2, eps, weight_decay, step, seed});
    call.finish();
}

}  // namespace nanoq
