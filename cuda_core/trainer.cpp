// The data-parallel trainer with ZeRO-1 sharding.
//
// Each device keeps a full replica of the weights and a full gradient buffer,
// both flat in parameter_layout() order and padded to a multiple of the device
// count. At update() the gradients are reduce-scattered so that device r owns
// the summed gradient of shard r; it updates the master weights and AdamW
// moments of that shard only, and the updated shards are all-gathered. While
// weights are float32 the master shard is a view into the weights buffer.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <thread>

#include "allocator.h"
#include "backend.h"
#include "comm.h"
#include "model.h"
#include "nanoq/trainer.h"
#include "worker_pool.h"

namespace nanoq {

namespace {

void check_config(const ModelConfig& c, const TrainOptions& o) {
    auto require = [](bool ok, const std::string& what) {
        if (!ok) throw InvalidArgument(what);
    };
    require(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0, "model sizes must be positive");
    require(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0,
            "num_heads must be a positive multiple of num_kv_heads");
    require(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be positive and even");
    require(o.devices > 0 && o.batch_size > 0 && o.seq_len > 0 && o.grad_accum > 0,
            "devices, batch_size, seq_len and grad_accum must be positive");
}

void reset_stats(Backend& backend, const Tensor& stats) {
    backend.fill(stats, 0.0f);
    backend.fill(stats.slice(kLseMax, 1), -std::numeric_limits<float>::infinity());
}

}  // namespace

struct DeviceState {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<NamedAllocator> allocator;
    std::unique_ptr<Communicator> comm;
    std::unique_ptr<LlamaModel> model;
    std::unique_ptr<StackArena> stack;
    Tensor weights, grads;           // [padded]
    Tensor master, adam_m, adam_v;   // [shard]
    ModelWeights weight_views, grad_views;
    Tensor tokens, targets;          // [B, T]
    Tensor stats, eval_stats;        // [kStatCount]
    Tensor gathered;                 // [devices * kStatCount] for host-side combination
};

struct Trainer::Impl {
    ModelConfig config;
    TrainOptions options;
    std::vector<ParameterInfo> layout;
    std::int64_t shard = 0;
    std::vector<DeviceState> devices;
    std::shared_ptr<SharedMemoryGroup> group;
    std::unique_ptr<WorkerPool> pool;
    int micro_steps = 0;
    int optimizer_steps = 0;
    bool failed = false;
    std::mutex call_mutex;  // public calls from several threads run one at a time
    std::atomic<int> fault_rank{-1};

    // Runs task(rank, device) on every worker; a failure poisons the trainer.
    void run(const std::function<void(int, DeviceState&)>& task) {
        if (failed)
            throw NanoqError("this trainer stopped after a worker failure; close it and create a new one");
        std::function<void(int)> body = [&](int rank) { task(rank, devices[rank]); };
        std::function<void()> abort = [&] { abort_shared_memory_group(*group); };
        try {
            pool->run(body, abort);
        } catch (...) {
            failed = true;
            throw;
        }
    }

    // Per-rank statistics combined on the host in rank order.
    StepStats combine(const std::vector<float>& per_rank, int ranks) const {
        double sums[kStatCount] = {};
        double lse_max = -std::numeric_limits<double>::infinity();
        for (int r = 0; r < ranks; ++r) {
            const float* s = &per_rank[static_cast<std::size_t>(r) * kStatCount];
            for (int i = 0; i < kStatCount; ++i) sums[i] += s[i];
            lse_max = std::max(lse_max, double(s[kLseMax]));
        }
        StepStats out;
        const double nan = std::numeric_limits<double>::quiet_NaN();
        out.tokens = static_cast<std::int64_t>(sums[kTokens]);
        out.loss = out.tokens ? sums[kLossSum] / sums[kTokens] : nan;
        out.loss_1k = sums[kTokens1k] > 0 ? sums[kLoss1kSum] / sums[kTokens1k] : nan;
        out.z_loss = out.tokens ? sums[kZLossSum] / sums[kTokens] : nan;
        out.lse_mean = out.tokens ? sums[kLseSum] / sums[kTokens] : nan;
        out.lse_max = out.tokens ? lse_max : nan;
        out.grad_norm = nan;
        return out;
    }

    // Gathers `stats` of every rank into every rank's `gathered` and reads it.
    std::vector<float> gather_stats(DeviceState& d, const Tensor& stats) {
        const int ranks = static_cast<int>(devices.size());
        d.backend->copy(d.gathered.slice(std::int64_t(d.comm->rank()) * kStatCount, kStatCount), stats);
        d.comm->all_gather(d.gathered);
        std::vector<float> host(static_cast<std::size_t>(ranks) * kStatCount);
        d.backend->copy_to_host(host.data(), d.gathered);
        d.backend->synchronize();
        return host;
    }
};

Trainer::Trainer(const ModelConfig& config, const TrainOptions& options) : impl_(std::make_unique<Impl>()) {
    check_config(config, options);
    if (!backend_available(options.backend))
        throw InvalidArgument("backend '" + options.backend + "' is not available in this build of nanoq");
    Impl& m = *impl_;
    m.config = config;
    m.options = options;
    m.layout = parameter_layout(config);
    const int n = options.devices;
    const std::int64_t total = m.layout.back().offset + m.layout.back().numel();
    m.shard = (total + n - 1) / n;
    const std::int64_t padded = m.shard * n;
    int threads = options.threads;
    if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / n);

    m.group = make_shared_memory_group(n);
    m.devices.resize(n);
    m.pool = std::make_unique<WorkerPool>(n);
    const int B = options.batch_size, T = options.seq_len;
    m.run([&](int rank, DeviceState& d) {
        d.backend = create_backend(options.backend, rank, threads);
        d.allocator = std::make_unique<NamedAllocator>(*d.backend, rank);
        d.comm = make_shared_memory_communicator(m.group, rank);
        NamedAllocator& a = *d.allocator;
        d.weights = a.allocate(Context::Weights, "weights", DType::F32, {padded});
        d.grads = a.allocate(Context::Gradients, "gradients", DType::F32, {padded});
        d.master = d.weights.slice(rank * m.shard, m.shard);
        d.adam_m = a.allocate(Context::AdamM, "adam-m", DType::F32, {m.shard});
        d.adam_v = a.allocate(Context::AdamV, "adam-v", DType::F32, {m.shard});
        d.tokens = a.allocate(Context::Workspace, "tokens", DType::I32, {B, T});
        d.targets = a.allocate(Context::Workspace, "targets", DType::I32, {B, T});
        d.stats = a.allocate(Context::Workspace, "loss-stats", DType::F32, {kStatCount});
        d.eval_stats = a.allocate(Context::Workspace, "eval-stats", DType::F32, {kStatCount});
        d.gathered = a.allocate(Context::Workspace, "gathered-stats", DType::F32, {std::int64_t(n) * kStatCount});
        d.model = std::make_unique<LlamaModel>(config, B, T, *d.backend, a);
        d.stack = std::make_unique<StackArena>(a, d.model->stack_bytes());
        d.weight_views = bind_weights(config, d.weights);
        d.grad_views = bind_weights(config, d.grads);
        d.backend->fill(d.weights, 0.0f);
        d.backend->fill(d.grads, 0.0f);
        d.backend->fill(d.adam_m, 0.0f);
        d.backend->fill(d.adam_v, 0.0f);
        reset_stats(*d.backend, d.stats);
        d.backend->synchronize();
    });
}

Trainer::~Trainer() = default;

int Trainer::world_size() const { return impl_->options.devices; }
const std::vector<ParameterInfo>& Trainer::parameters() const { return impl_->layout; }
int Trainer::micro_steps() const { return impl_->micro_steps; }
int Trainer::optimizer_steps() const { return impl_->optimizer_steps; }
void Trainer::inject_fault(int rank) { impl_->fault_rank = rank; }

static const ParameterInfo& parameter_at(const std::vector<ParameterInfo>& layout, int index) {
    if (index < 0 || index >= static_cast<int>(layout.size()))
        throw InvalidArgument("parameter index " + std::to_string(index) + " out of range");
    return layout[index];
}

void Trainer::set_parameter(int index, const float* data) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    const ParameterInfo& p = parameter_at(impl_->layout, index);
    impl_->run([&](int, DeviceState& d) {
        d.backend->copy_from_host(d.weights.slice(p.offset, p.numel()), data);
        d.backend->synchronize();
    });
}

void Trainer::get_parameter(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    const ParameterInfo& p = parameter_at(impl_->layout, index);
    impl_->run([&](int rank, DeviceState& d) {
        if (rank != 0) return;
        d.backend->copy_to_host(out, d.weights.slice(p.offset, p.numel()));
        d.backend->synchronize();
    });
}

void Trainer::get_gradient(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const ParameterInfo& p = parameter_at(m.layout, index);
    if (m.micro_steps == 0) throw InvalidArgument("no gradients yet: call step() before reading gradients");
    const int n = world_size();
    std::vector<std::vector<float>> per_rank(n, std::vector<float>(p.numel()));
    std::vector<float> stats;
    m.run([&](int rank, DeviceState& d) {
        std::vector<float> s = m.gather_stats(d, d.stats);
        if (rank == 0) stats = std::move(s);
        d.backend->copy_to_host(per_rank[rank].data(), d.grads.slice(p.offset, p.numel()));
        d.backend->synchronize();
    });
    const StepStats totals = m.combine(stats, n);
    const float scale = totals.tokens ? 1.0f / static_cast<float>(totals.tokens) : 0.0f;
    for (std::int64_t i = 0; i < p.numel(); ++i) {
        float sum = 0.0f;
        for (int r = 0; r < n; ++r) sum += per_rank[r][i];
        out[i] = sum * scale;
    }
}

void Trainer::step(const std::int32_t* inputs, const std::int32_t* targets) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    if (m.micro_steps >= m.options.grad_accum)
        throw InvalidArgument("step() called " + std::to_string(m.micro_steps + 1) + " times without update(), but grad_accum is " +
                              std::to_string(m.options.grad_accum));
    const std::int64_t per_device = std::int64_t(m.options.batch_size) * m.options.seq_len;
    const int fault = m.fault_rank.exchange(-1);
    m.run([&](int rank, DeviceState& d) {
        if (rank == fault) throw NanoqError("injected fault in worker " + std::to_string(rank));
        d.backend->copy_from_host(d.tokens, inputs + rank * per_device);
        d.backend->copy_from_host(d.targets, targets + rank * per_device);
        d.model->forward_backward(d.weight_views, d.grad_views, d.tokens, d.targets, d.stats, m.options.z_loss,
                                  *d.stack);
        d.backend->synchronize();
    });
    ++m.micro_steps;
}

StepStats Trainer::validate(const std::int32_t* inputs, const std::int32_t* targets) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const std::int64_t per_device = std::int64_t(m.options.batch_size) * m.options.seq_len;
    std::vector<float> stats;
    m.run([&](int rank, DeviceState& d) {
        d.backend->copy_from_host(d.tokens, inputs + rank * per_device);
        d.backend->copy_from_host(d.targets, targets + rank * per_device);
        reset_stats(*d.backend, d.eval_stats);
        d.model->forward_loss(d.weight_views, d.tokens, d.targets, d.eval_stats, m.options.z_loss, *d.stack);
        std::vector<float> s = m.gather_stats(d, d.eval_stats);
        if (rank == 0) stats = std::move(s);
    });
    return m.combine(stats, world_size());
}

StepStats Trainer::update(const UpdateParams& params) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    if (m.micro_steps == 0) throw InvalidArgument("update() called before any step(): there are no gradients");
    const int n = world_size();
    const int step_number = m.optimizer_steps + 1;
    StepStats result;
    m.run([&](int rank, DeviceState& d) {
        Backend& be = *d.backend;
        const StepStats totals = m.combine(m.gather_stats(d, d.stats), n);
        d.comm->reduce_scatter_sum(d.grads);
        const Tensor grad_shard = d.grads.slice(rank * m.shard, m.shard);

        // Global norm of the summed gradient: each rank squares its shard,
        // the partial sums are gathered and added in rank order.
        Tensor partial = d.gathered.slice(0, n);
        be.fill(partial, 0.0f);
        be.sum_squares(partial.slice(rank, 1), grad_shard);
        d.comm->all_gather(partial);
        std::vector<float> squares(n);
        be.copy_to_host(squares.data(), partial);
        be.synchronize();
        double sum_squares = 0.0;
        for (float s : squares) sum_squares += s;

        const double inv_tokens = totals.tokens ? 1.0 / totals.tokens : 0.0;
        const double norm = std::sqrt(sum_squares) * inv_tokens;
        double clip = 1.0;
        if (params.grad_clip > 0 && norm > params.grad_clip) clip = params.grad_clip / norm;

        AdamWStep step{params.lr, params.beta1, params.beta2, params.eps, 0.0f, step_number,
                       static_cast<float>(inv_tokens * clip)};
        const std::int64_t lo = rank * m.shard, hi = lo + m.shard;
        for (const ParameterInfo& p : m.layout) {
            const std::int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + p.numel());
            if (begin >= end) continue;
            step.weight_decay = p.weight_decay ? params.weight_decay : 0.0f;
            be.adamw(d.master.slice(begin - lo, end - begin), d.grads.slice(begin, end - begin),
                     d.adam_m.slice(begin - lo, end - begin), d.adam_v.slice(begin - lo, end - begin), step);
        }
        d.comm->all_gather(d.weights);
        be.fill(d.grads, 0.0f);
        reset_stats(be, d.stats);
        be.synchronize();
        if (rank == 0) {
            result = totals;
            result.grad_norm = norm;
        }
    });
    m.micro_steps = 0;
    m.optimizer_steps = step_number;
    return result;
}

std::vector<AllocationInfo> Trainer::allocations(int device) const {
    if (device < 0 || device >= world_size()) throw InvalidArgument("no device " + std::to_string(device));
    std::vector<AllocationInfo> out;
    for (const Segment& s : impl_->devices[device].allocator->segments())
        out.push_back(AllocationInfo{context_name(s.context), s.name, s.bytes, memory_kind_name(s.kind)});
    return out;
}

StackInfo Trainer::stack_info(int device) const {
    if (device < 0 || device >= world_size()) throw InvalidArgument("no device " + std::to_string(device));
    const StackArena& stack = *impl_->devices[device].stack;
    StackInfo info{stack.capacity(), stack.high_water(), {}};
    for (const StackEntry& e : stack.live_at_high_water()) info.live_at_high_water.emplace_back(e.name, e.bytes);
    return info;
}

bool has_backend(const std::string& name) { return backend_available(name); }

}  // namespace nanoq
