// The data-parallel trainer: one worker per device, ZeRO sharding (zero.h).
//
// Parameters are flat in parameter_layout() order (lora_layout() with LoRA),
// padded to a multiple of the device count; device r owns shard r and keeps
// the master weights and AdamW moments of that shard only. At update() the
// gradients are summed into their owners' shards, each device updates its
// shard, and the weights kept whole are refreshed from the owners. When
// weights and master weights share a dtype, the master shard is a view into
// the weights; otherwise it is its own tensor and the updated master shard
// is cast into the weights before the gather.
// What a device allocates is decided in one place, allocate_device_state():
// the constructor runs it on each device's allocator, plan_memory() on
// planning allocators, so the memory plan is the Trainer's own sequence.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator.h"
#include "backend.h"
#include "comm.h"
#include "dropout.h"
#include "model.h"
#include "nanoq/trainer.h"
#include "worker_pool.h"
#include "zero.h"

namespace nanoq {

namespace {

// Host batches are copied into one of this many staging slots per device,
// so that step() can return while the devices still read an earlier batch.
constexpr int kBatchSlots = 2;
// Host<->device parameter copies go through a float32 buffer of this many elements.
constexpr std::int64_t kStagingElements = std::int64_t(1) << 22;
// AdamW runs over chunks of at most this many elements (the size of the
// device buffers that offloaded state streams through).
constexpr std::int64_t kOptimizerChunk = std::int64_t(1) << 22;

DType dtype_of(Precision precision) {
    return precision == Precision::BF16 ? DType::BF16 : DType::F32;
}

void check_config(const ModelConfig& c) {
    auto require = [](bool ok, const std::string& what) {
        if (!ok) throw InvalidArgument(what);
    };
    require(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0,
            "model sizes must be positive");
    require(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0,
            "num_heads must be a positive multiple of num_kv_heads");
    require(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be positive and even");
    require(c.max_positions >= 0, "max_positions must be >= 0 (0: RoPE)");
    require(c.dropout >= 0.0f && c.dropout < 1.0f, "model dropout must be in [0, 1)");
}

// What every trainer of one world must agree on: the model and the options
// that shape the sharding and the step (not devices, first_rank, threads).
std::string world_signature(const ModelConfig& c, const TrainOptions& o) {
    std::string s;
    auto add = [&](const std::string& name, const std::string& value) { s += name + "=" + value + " "; };
    add("vocab", std::to_string(c.vocab_size));
    add("hidden", std::to_string(c.hidden_size));
    add("intermediate", std::to_string(c.intermediate_size));
    add("layers", std::to_string(c.num_layers));
    add("heads", std::to_string(c.num_heads) + "/" + std::to_string(c.num_kv_heads));
    add("head_dim", std::to_string(c.head_dim));
    add("flags(tied,qkv_bias,o_bias,qk_norm,causal)", std::to_string(c.tie_embeddings) + std::to_string(c.qkv_bias) +
                                                           std::to_string(c.o_bias) + std::to_string(c.qk_norm) +
                                                           std::to_string(c.causal));
    add("rope", std::to_string(c.rope_theta) + ":" + std::to_string(c.rope_llama3) + ":" +
                    std::to_string(c.rope_factor) + ":" + std::to_string(c.rope_low_freq_factor) + ":" +
                    std::to_string(c.rope_high_freq_factor) + ":" + std::to_string(c.rope_original_max_position));
    add("rms_norm_eps", std::to_string(c.rms_norm_eps));
    add("nano(positions,mlp_bias,dropout)", std::to_string(c.max_positions) + ":" + std::to_string(c.mlp_bias) +
                                                ":" + std::to_string(c.dropout));
    add("backend", o.backend);
    add("batch_size", std::to_string(o.batch_size));
    add("seq_len", std::to_string(o.seq_len));
    add("grad_accum", std::to_string(o.grad_accum));
    add("zero_stage", std::to_string(o.zero_stage));
    add("dtypes", std::to_string(static_cast<int>(o.dtype)) + "/" + std::to_string(static_cast<int>(o.master_dtype)) +
                      "/" + std::to_string(static_cast<int>(o.optimizer_dtype)));
    add("recompute", std::to_string(o.recompute.bits));
    add("offload", std::to_string(o.offload.bits));
    add("lora", std::to_string(o.lora_rank) + ":" + std::to_string(o.lora_targets.bits) + ":" +
                    std::to_string(o.lora_alpha) + ":" + std::to_string(o.lora_dropout));
    add("z_loss", std::to_string(o.z_loss));
    add("seed", std::to_string(o.seed));
    add("inference", std::to_string(o.inference));
    // Whether collectives run inside CUDA graphs must be the same on every
    // rank (NCCL's rule for captured collectives); fp8 changes the results.
    add("cuda_graphs", std::to_string(o.cuda_graphs));
    add("matmul_dtype", std::to_string(static_cast<int>(o.matmul_dtype)));
    s.pop_back();
    return s;
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
    std::unique_ptr<CommTrace> trace;  // testing: the order of backward and communication (communication_trace)
    std::unique_ptr<LlamaModel> model;
    std::unique_ptr<ModelMemory> planned_model;  // in place of `model` when planning (plan_memory)
    std::unique_ptr<StackArena> stack;
    Tensor frozen;                   // LoRA: the frozen model weights, whole on every device
    ZeroBuffers zero;                // weights and gradients, where the ZeRO stage keeps them
    Tensor master, adam_m, adam_v;   // [shard]; in host memory when offloaded
    bool master_is_weights = false;  // master is this rank's shard of `weights`
    // Device buffers that offloaded state streams through (empty when not offloaded).
    Tensor staged_master, staged_m, staged_v, staged_grads;
    ModelWeights weight_views, grad_views;
    Tensor tokens, targets;          // [B, T]
    Tensor positions;                // [B, T], allocated with the first batch that has positions
    // Host batches: kBatchSlots slots of inputs then targets, [B * T] each,
    // in pinned host memory; step() writes them on the caller's thread.
    Tensor batch_staging;
    Tensor stats, eval_stats;        // [kStatCount] float64
    Tensor gathered;                 // [devices, kGatherStride] float64
    Tensor optimizer_scale;          // [3]: gradient factor, gradient norm, skip flag
    // The whole-shard AdamW (Backend::adamw_shard; unused when offload streams
    // the state through the staged buffers): this rank's segment table, and
    // the per-step values, written into the host-writable staging at the
    // start of each update() and copied to the device from there.
    std::vector<AdamWSegment> adamw_segments;
    Tensor adamw_segment_table, adamw_step_staging, adamw_step_values;
    // LoRA dropout: the micro-batch's mask seed (one uint64 as int32 [2]),
    // written before each step so that a captured step reads a new one.
    Tensor dropout_seed;
    Tensor staging;                  // float32 bounce buffer for parameters
    KvCache kv_cache;                // generation's (capacity 0 until the first forward_cached)
};

namespace {

const Tensor& optimizer_tensor(const DeviceState& d, int kind) {
    switch (kind) {
        case 0: return d.master;
        case 1: return d.adam_m;
        case 2: return d.adam_v;
    }
    throw InvalidArgument("optimizer state kind must be 0 (master), 1 (adam m) or 2 (adam v), got " +
                          std::to_string(kind));
}

// The elements [begin, end) of parameter p (flattened) that lie in [lo, hi)
// of the flat layout; begin == end when none do. The one place that maps
// shards to parameters: a rank's shard is [rank * shard, (rank + 1) * shard),
// a trainer's ranks own the union of theirs.
std::pair<std::int64_t, std::int64_t> part_in_range(const ParameterInfo& p, std::int64_t lo, std::int64_t hi) {
    const std::int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + p.numel());
    if (begin >= end) return {0, 0};
    return {begin - p.offset, end - p.offset};
}

// fn(offset in the shard, offset in the parameter, count) over rank `rank`'s
// part of parameter p, in chunks of at most `chunk` elements.
void for_each_shard_chunk(std::int64_t shard, int rank, const ParameterInfo& p, std::int64_t chunk,
                          const std::function<void(std::int64_t, std::int64_t, std::int64_t)>& fn) {
    const std::int64_t lo = std::int64_t(rank) * shard;
    const auto [begin, end] = part_in_range(p, lo, lo + shard);
    for (std::int64_t at = begin; at < end; at += chunk)
        fn(p.offset + at - lo, at, std::min(chunk, end - at));
}

// Host <-> device copies of a float32 host range and a tensor of any dtype,
// through the device's float32 staging buffer (which casts).
void copy_to_host_staged(DeviceState& d, const Tensor& source, float* out) {
    for (std::int64_t done = 0; done < source.numel(); done += d.staging.numel()) {
        const std::int64_t count = std::min(d.staging.numel(), source.numel() - done);
        const Tensor staged = d.staging.slice(0, count);
        d.backend->copy(staged, source.slice(done, count));
        d.backend->copy_to_host(out + done, staged);
    }
}

void copy_from_host_staged(DeviceState& d, const float* data, const Tensor& target) {
    for (std::int64_t done = 0; done < target.numel(); done += d.staging.numel()) {
        const std::int64_t count = std::min(d.staging.numel(), target.numel() - done);
        const Tensor staged = d.staging.slice(0, count);
        d.backend->copy_from_host(staged, data + done);
        d.backend->copy(target.slice(done, count), staged);
    }
}

}  // namespace

// The options checked and resolved, and the sizes derived from them: where
// a Trainer and the memory plan both start.
struct TrainerSetup {
    TrainerSetup(const ModelConfig& config, const TrainOptions& options);

    // Each trainable parameter's part of global rank `rank`'s shard, in layout order.
    std::vector<AdamWSegment> adamw_segments(int rank) const;
    // Whether AdamW runs as one adamw_shard (no state streamed through device buffers).
    bool whole_shard_adamw() const {
        return !offload.has(kOffloadMaster) && !offload.has(kOffloadOptimizer) && !offload.has(kOffloadGradients);
    }

    ModelConfig config;
    TrainOptions options;
    DType weight_dtype, master_dtype, optimizer_dtype;
    Recompute recompute;
    OffloadSet offload;
    const BackendPlugin* plugin;
    Lora lora;
    std::vector<ParameterInfo> layout;      // the trainable parameters: what the flat buffers hold
    std::vector<ParameterInfo> frozen;      // LoRA: the model's weights, laid out in DeviceState::frozen
    std::vector<ParameterInfo> parameters;  // layout, then frozen: the public list
    std::int64_t shard = 0;
    int world = 1;       // ranks in the world (this trainer's devices and other trainers')
    int first_rank = 0;  // global rank of this trainer's device 0
    std::unique_ptr<ZeroSharding> zero;
    std::int64_t largest = 0;               // elements of the largest parameter
    int threads = 0;                        // per device
};

TrainerSetup::TrainerSetup(const ModelConfig& c, const TrainOptions& o) : config(c), options(o) {
    check_config(c);
    validate_options(o);
    if (c.max_positions > 0 && o.seq_len > c.max_positions)
        throw InvalidArgument("seq_len " + std::to_string(o.seq_len) + " exceeds the learned position table's " +
                              std::to_string(c.max_positions) + " positions (max_positions)");
    if (o.packed_documents && !c.causal)
        throw InvalidArgument("packed_documents needs a causal model: positions (packed documents) restart a "
                              "causal attention, and this model has causal false");
    weight_dtype = dtype_of(o.dtype);
    // An inference trainer's "master" is its weights: nothing is updated.
    master_dtype = o.inference ? weight_dtype : dtype_of(o.master_dtype);
    optimizer_dtype = dtype_of(o.optimizer_dtype);
    // Nothing reads an inference trainer's activations after its forward: it keeps
    // each layer's input only, whatever `recompute` says (the forward is the same).
    recompute = Recompute::from(o.inference ? RecomputeSet{kRecomputeBlock} : o.recompute);
    offload = o.offload;
    plugin = &find_backend(o.backend);
    lora = Lora::from(o);
    layout = lora.enabled() ? lora_layout(c, lora) : parameter_layout(c);
    if (lora.enabled()) {
        frozen = parameter_layout(c);
        for (ParameterInfo& p : frozen) p.trainable = false;
    }
    parameters = layout;
    parameters.insert(parameters.end(), frozen.begin(), frozen.end());
    const int n = o.devices;
    world = o.world_size ? o.world_size : n;
    first_rank = o.first_rank;
    zero = std::make_unique<ZeroSharding>(o.zero_stage, c, layout, world);
    shard = zero->shard();
    for (const ParameterInfo& p : parameters) largest = std::max(largest, p.numel());
    threads = o.threads;
    if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / n);
}

std::vector<AdamWSegment> TrainerSetup::adamw_segments(int rank) const {
    const std::int64_t lo = std::int64_t(rank) * shard, hi = lo + shard;
    std::vector<AdamWSegment> segments;
    for (const ParameterInfo& p : layout) {
        const std::int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + p.numel());
        if (begin < end) segments.push_back(AdamWSegment{begin - lo, end - begin, p.weight_decay});
    }
    return segments;
}

namespace {

ScratchShapes scratch_shapes(const TrainerSetup& s, const ModelMemory& model) {
    ScratchShapes scratch = model.scratch_shapes();
    scratch.max_reduce = s.shard;
    scratch.attention_impl = s.options.attention;
    scratch.matmul_dtype = s.options.matmul_dtype;
    scratch.weights_in_place = s.options.zero_stage < 3;
    scratch.packed_documents = s.options.packed_documents;
    scratch.attention_deterministic = s.options.attention_deterministic;
    scratch.backward = !s.options.inference;
    return scratch;
}

// The classifier's chunk: the backend's at least, and as many more rows, up
// to all of them (one chunk), as the memory budget leaves room for once the
// stack and the op scratch, the last allocations, are counted: the memory
// limit or, without one, the device's memory less an eighth for what the
// allocator does not see (the CUDA context, libraries' workspaces). Without
// a budget (the cpu backend, or a plan that may not ask the device) the
// backend's chunk stands. The Trainer and the plan both come here, with the
// allocations so far in `a`, and so choose alike; a plan may name the
// device's memory (`device_memory`, 0 = ask the device) to plan a GPU that
// is not here.
void choose_classifier_rows(const TrainerSetup& s, int rank, const NamedAllocator& a, ModelMemory& model,
                            bool ask_device, std::size_t device_memory) {
    std::size_t budget = s.options.memory_limit;
    if (!budget && s.plugin->device_memory) {
        const std::size_t total =
            device_memory ? device_memory : ask_device ? s.plugin->device_memory(s.options.first_device + rank) : 0;
        budget = total - total / 8;
    }
    const int least = model.classifier_chunk_rows(), all = s.options.batch_size * s.options.seq_len;
    if (!budget || least >= all) return;
    auto fits = [&](int rows) {
        model.use_classifier_rows(rows);
        std::size_t bytes = a.device_bytes() + model.stack_bytes();
        for (const ScratchBuffer& b : s.plugin->scratch_plan(scratch_shapes(s, model), s.threads, ask_device))
            if (b.kind == MemoryKind::Device) bytes += dtype_size(b.dtype) * static_cast<std::size_t>(b.elements);
        return bytes <= budget;
    };
    if (fits(all)) return;
    // Bisect: `lo` fits (or is the least chunk, which the allocation then refuses), `hi` does not.
    int lo = least, hi = all;
    if (fits(lo))
        while (hi - lo > 1) {
            const int mid = lo + (hi - lo) / 2;
            (fits(mid) ? lo : hi) = mid;
        }
    model.use_classifier_rows(lo);
}

// Allocates the state of local device `rank` into `d` from d.allocator, in
// the one order that a Trainer and the memory plan share (views, which
// allocate nothing, are bound by the caller). With d.backend (a Trainer) the
// model is built on it and the backend reserves its op scratch. Without (the plan: d.allocator
// plans) only the model's memory is planned, and the scratch is the one the
// backend's plan lists, its libraries asked when `ask_libraries`;
// `device_memory` is the plan's stand-in for the device's (choose_classifier_rows).
void allocate_device_state(const TrainerSetup& s, int rank, DeviceState& d, bool ask_libraries,
                           std::size_t device_memory = 0) {
    NamedAllocator& a = *d.allocator;
    const OffloadSet offload = s.offload;
    const DType weight_dtype = s.weight_dtype, master_dtype = s.master_dtype, optimizer_dtype = s.optimizer_dtype;
    const int B = s.options.batch_size, T = s.options.seq_len;
    if (s.lora.enabled())
        d.frozen = a.allocate(Context::Weights, "frozen-weights", weight_dtype,
                              {s.frozen.back().offset + s.frozen.back().numel()});
    const bool training = !s.options.inference;
    s.zero->allocate(a, d.zero, weight_dtype, s.lora.enabled() ? "adapters" : "weights",
                     offload.has(kOffloadGradients), training);
    const MemoryKind master_kind = offload.has(kOffloadMaster) ? MemoryKind::Pinned : MemoryKind::Device;
    const MemoryKind optimizer_kind = offload.has(kOffloadOptimizer) ? MemoryKind::Pinned : MemoryKind::Device;
    // Else the master shard is a view of the weights (bound by the caller).
    d.master_is_weights = master_dtype == weight_dtype && !offload.has(kOffloadMaster);
    if (!d.master_is_weights)
        d.master = a.allocate(Context::Master, "master", master_dtype, {s.shard}, master_kind);
    if (training) {
        d.adam_m = a.allocate(Context::AdamM, "adam-m", optimizer_dtype, {s.shard}, optimizer_kind);
        d.adam_v = a.allocate(Context::AdamV, "adam-v", optimizer_dtype, {s.shard}, optimizer_kind);
    }
    const std::int64_t chunk = std::min(s.shard, kOptimizerChunk);
    if (offload.has(kOffloadMaster))
        d.staged_master = a.allocate(Context::Workspace, "offload-master", master_dtype, {chunk});
    if (offload.has(kOffloadOptimizer)) {
        d.staged_m = a.allocate(Context::Workspace, "offload-adam-m", optimizer_dtype, {chunk});
        d.staged_v = a.allocate(Context::Workspace, "offload-adam-v", optimizer_dtype, {chunk});
    }
    if (offload.has(kOffloadGradients))
        d.staged_grads = a.allocate(Context::Workspace, "offload-gradients", DType::F32, {chunk});
    d.tokens = a.allocate(Context::Workspace, "tokens", DType::I32, {B, T});
    d.targets = a.allocate(Context::Workspace, "targets", DType::I32, {B, T});
    d.batch_staging = a.allocate(Context::Workspace, "batch-staging", DType::I32, {kBatchSlots, 2, B, T},
                                 s.plugin->staging_kind);
    d.stats = a.allocate(Context::Workspace, "loss-stats", kStatDType, {kStatCount});
    d.eval_stats = a.allocate(Context::Workspace, "eval-stats", kStatDType, {kStatCount});
    d.gathered = a.allocate(Context::Workspace, "gathered-stats", kStatDType, {s.world, kGatherStride});
    d.optimizer_scale = a.allocate(Context::Workspace, "optimizer-scale", DType::F32, {3});
    // Room for a segment of every parameter, so that every rank plans the same
    // (and with offload too, which does without them: so that offload's
    // saving is its state alone).
    d.adamw_segments = s.adamw_segments(s.first_rank + rank);
    const std::int64_t table = std::int64_t(d.adamw_segments.size()) * kAdamWSegmentSlots;
    d.adamw_segment_table = a.allocate(Context::Workspace, "adamw-segments", DType::F64,
                                       {std::int64_t(s.layout.size()) * kAdamWSegmentSlots})
                                .slice(0, table);
    d.adamw_step_staging =
        a.allocate(Context::Workspace, "adamw-step-staging", DType::F64, {kAdamWStepSlots}, s.plugin->staging_kind);
    d.adamw_step_values = a.allocate(Context::Workspace, "adamw-step", DType::F64, {kAdamWStepSlots});
    if (s.lora.dropout > 0.0f || s.config.dropout > 0.0f)
        d.dropout_seed = a.allocate(Context::Workspace, "dropout-seed", DType::I32, {2});
    d.staging = a.allocate(Context::Workspace, "parameter-staging", DType::F32,
                           {std::min(s.largest, kStagingElements)});
    const std::int64_t chunk_elements = s.plugin->classifier_chunk_elements;
    if (d.backend) {
        d.model = std::make_unique<LlamaModel>(s.config, B, T, weight_dtype, s.recompute, s.lora, chunk_elements,
                                               *d.backend, a);
    } else {
        d.planned_model =
            std::make_unique<ModelMemory>(s.config, B, T, weight_dtype, s.recompute, s.lora, chunk_elements, a);
    }
    ModelMemory& model = d.backend ? static_cast<ModelMemory&>(*d.model) : *d.planned_model;
    choose_classifier_rows(s, rank, a, model, ask_libraries, device_memory);
    d.stack = std::make_unique<StackArena>(a, model.stack_bytes());
    const ScratchShapes scratch = scratch_shapes(s, model);
    if (d.backend) d.backend->reserve_scratch(a, scratch);
    else allocate_scratch(a, s.plugin->scratch_plan(scratch, s.threads, ask_libraries));
}

}  // namespace

struct Trainer::Impl : TrainerSetup {
    Impl(const ModelConfig& config, const TrainOptions& options) : TrainerSetup(config, options) {}

    std::vector<DeviceState> devices;
    std::shared_ptr<CommGroup> group;
    std::unique_ptr<WorkerPool> pool;
    int micro_steps = 0;
    int optimizer_steps = 0;
    long steps_queued = 0;             // step() calls so far, for the failure messages
    long slot_ticket[kBatchSlots] = {};  // the pool ticket of the step that last used each batch slot
    bool failed = false;
    bool validate_pending = false;           // queue_validate() ran, validate_result() not yet
    std::vector<StatValue> validate_rows;    // what the queued validate gathered (rank 0's copy)
    std::string stopped_by = "a worker failure";  // why `failed`, for the refusal's message
    int cached_length = 0;  // positions in the devices' KV caches (forward_cached)
    std::mutex call_mutex;  // public calls from several threads run one at a time
    TestingHooks testing_hooks;

    int size() const { return static_cast<int>(devices.size()); }
    int global(int rank) const { return first_rank + rank; }
    // Calls that train need the gradients and optimizer state an inference trainer leaves out.
    void require_training(const std::string& what) const {
        if (options.inference)
            throw InvalidArgument(what + " needs a trainer made for training: this one has inference = true "
                                  "(no gradients or optimizer state)");
    }
    // Calls that need every rank's shard cannot answer for a world beyond this trainer.
    void require_whole_world(const std::string& what) const {
        if (world != size())
            throw InvalidArgument(what + " needs the shards of all " + std::to_string(world) +
                                  " ranks, and ranks outside " + std::to_string(first_rank) + ".." +
                                  std::to_string(first_rank + size() - 1) +
                                  " belong to other trainers: read it in a world of one trainer");
    }

    // The elements [begin, end) of trainable parameter p that this trainer's
    // ranks own (all of it for a trainer alone in its world).
    std::pair<std::int64_t, std::int64_t> owned_range(const ParameterInfo& p) const {
        return part_in_range(p, std::int64_t(first_rank) * shard, std::int64_t(first_rank + options.devices) * shard);
    }

    // fn(device, rank, offset in the rank's shard, offset in owned_range(p),
    // count) over each rank's part of trainable parameter p, on the rank's
    // worker, which then synchronizes.
    using OwnedChunkFn = std::function<void(DeviceState&, int, std::int64_t, std::int64_t, std::int64_t)>;
    void for_each_owned_chunk(const ParameterInfo& p, const OwnedChunkFn& fn) {
        const std::int64_t first = owned_range(p).first;
        run([&](int rank, DeviceState& d) {
            for_each_shard_chunk(shard, global(rank), p, p.numel(),
                                 [&](std::int64_t in_shard, std::int64_t in_param, std::int64_t count) {
                                     fn(d, rank, in_shard, in_param - first, count);
                                 });
            d.backend->synchronize();
        });
    }

    // This trainer's part (owned_range) of trainable parameter p's weights
    // to `out`: each rank copies its shard's part, from the weights it holds
    // whole or, for a stage-3 layer weight, from its weight shard.
    void read_owned_weights(const ParameterInfo& p, float* out) {
        for_each_owned_chunk(p, [&](DeviceState& d, int rank, std::int64_t in_shard, std::int64_t in_part,
                                    std::int64_t count) {
            const Tensor whole = whole_weights(d, p);
            const std::int64_t in_param = owned_range(p).first + in_part;
            copy_to_host_staged(d, whole.data ? whole.slice(in_param, count)
                                              : zero->weight_shard(global(rank), d.zero).slice(in_shard, count),
                                out + in_part);
        });
    }

    // This trainer's part (owned_range) of optimizer state `kind` of p: read
    // into `out`, or written from `part`.
    void read_owned_optimizer_state(const ParameterInfo& p, int kind, float* out) {
        optimizer_tensor(devices[0], kind);  // a bad kind throws here, before any work
        for_each_owned_chunk(p, [&](DeviceState& d, int, std::int64_t in_shard, std::int64_t in_part,
                                    std::int64_t count) {
            copy_to_host_staged(d, optimizer_tensor(d, kind).slice(in_shard, count), out + in_part);
        });
    }
    void write_owned_optimizer_state(const ParameterInfo& p, int kind, const float* part) {
        optimizer_tensor(devices[0], kind);
        for_each_owned_chunk(p, [&](DeviceState& d, int, std::int64_t in_shard, std::int64_t in_part,
                                    std::int64_t count) {
            copy_from_host_staged(d, part + in_part, optimizer_tensor(d, kind).slice(in_shard, count));
        });
    }

    // parameters[index]; with `trainable`, one that has a gradient and optimizer state.
    const ParameterInfo& parameter_at(int index, bool trainable) const {
        if (index < 0 || index >= static_cast<int>(parameters.size()))
            throw InvalidArgument("parameter index " + std::to_string(index) + " out of range");
        const ParameterInfo& p = parameters[index];
        if (trainable && !p.trainable)
            throw InvalidArgument(p.name + " is frozen (LoRA): it has no gradient and no optimizer state");
        return p;
    }

    // The pool's failure handler, on each rank's own thread once a task
    // failed: marks the group aborted, which ends the other ranks'
    // collectives and waits, and abandons this rank's communicator's work
    // (no rank touches another's communicator).
    void abort_rank(int rank) {
        group->abort();
        // The graphs first: NCCL's teardown waits for those holding its collectives.
        if (devices[rank].backend) devices[rank].backend->release_captured();
        if (devices[rank].comm) devices[rank].comm->abort();
    }

    void refuse_if_failed() const {
        if (failed)
            throw NanoqError("this trainer stopped after " + stopped_by + "; close it and create a new one");
    }

    // Runs task(rank, device) on every worker after the work queued before
    // it and waits for all of it; a failure, its own or a queued step's,
    // poisons the trainer.
    void run(const std::function<void(int, DeviceState&)>& task) {
        refuse_if_failed();
        try {
            pool->run([&](int rank) { task(rank, devices[rank]); });
        } catch (...) {
            failed = true;
            throw;
        }
    }

    // Generation's KV caches, on their first use, on every device or on
    // none: a device that cannot hold its cache fails the call, not the
    // trainer (nothing else was touched: training goes on), and what the
    // other devices allocated is freed again.
    void allocate_kv_caches() {
        std::vector<std::exception_ptr> refused(devices.size());
        std::vector<std::size_t> marks(devices.size());
        const std::int64_t refusing = testing_hooks.take(TestingHook::kRefuseKvCacheInWorker);
        run([&](int rank, DeviceState& d) {
            marks[rank] = d.allocator->mark();
            try {
                d.kv_cache = d.model->allocate_kv_cache(*d.allocator);
                if (rank == refusing) throw OutOfMemory("out of memory allocating the KV cache (testing hook)");
            } catch (const OutOfMemory&) {
                refused[rank] = std::current_exception();
                d.allocator->release_after(marks[rank]);
            }
        });
        const auto first = std::find_if(refused.begin(), refused.end(), [](const auto& e) { return bool(e); });
        if (first == refused.end()) return;
        run([&](int rank, DeviceState& d) {
            d.kv_cache = KvCache{};
            d.allocator->release_after(marks[rank]);
        });
        std::rethrow_exception(*first);
    }

    // Waits for the queued work; a failure in it surfaces here (and poisons
    // the trainer). Nothing is queued once the trainer has failed.
    // Token ids of a host batch: Python checked them, but the caller's array
    // may have changed since (another thread); one past the vocabulary would
    // index past the embedding table. Targets may also be kIgnoreIndex.
    void check_batch_ids(const std::int32_t* ids, std::int64_t count, bool targets) const {
        for (std::int64_t i = 0; i < count; ++i) {
            const std::int32_t id = ids[i];
            if ((id < 0 || id >= config.vocab_size) && !(targets && id == kIgnoreIndex))
                throw InvalidArgument(std::string(targets ? "targets" : "inputs") + " hold id " + std::to_string(id) +
                                      " at flat index " + std::to_string(i) + ", outside [0, " +
                                      std::to_string(config.vocab_size) + ") (the array changed after its check?)");
        }
    }

    void drain() {
        if (failed) return;
        try {
            pool->wait();
        } catch (...) {
            failed = true;
            throw;
        }
    }

    // Each worker releases its own communicator, all at once: NCCL's destroy
    // may wait for the peers' destroys. Its CUDA graphs go first: NCCL's
    // finalize waits until no graph holds one of its collectives.
    void release_communicators() {
        try {
            pool->wait();  // a failure nobody has waited for yet would drop the release
        } catch (...) {
        }
        try {
            pool->run([&](int rank) {
                if (devices[rank].backend) devices[rank].backend->release_captured();
                devices[rank].comm.reset();
            });
        } catch (...) {
            // Teardown goes on: the remaining state is freed by the caller either way.
        }
    }

    // Device batches: the work each rank does next waits for what the
    // caller's streams had queued (marked here, on the caller's thread).
    void record_batch_streams(int source_device, std::uintptr_t inputs_stream, std::uintptr_t targets_stream) {
        if (failed) return;  // run() says so
        if (source_device < 0) {
            if (inputs_stream || targets_stream) throw InvalidArgument("streams are given for device batches only");
            return;
        }
        const std::uintptr_t streams[2] = {inputs_stream, targets_stream};
        devices[source_device].backend->record_batch_ready(streams, 2);
    }

    // This trainer's addend of trainable parameter p's gradient (all of it
    // when the trainer holds its whole world): the sum over its devices of
    // what they accumulated, or of the owned chunks once the gradients are
    // summed into the owners' shards; scaled by the world's token count.
    // whole_world: refuse a trainer that holds only part of its world.
    void read_gradient(const ParameterInfo& p, float* out, bool whole_world) {
        if (micro_steps == 0) throw InvalidArgument("no gradients yet: call step() before reading gradients");
        if (whole_world) require_whole_world("get_gradient");
        const int n = size();
        std::vector<std::vector<float>> per_rank(n, std::vector<float>(p.numel()));
        std::vector<StatValue> rows;
        bool summed = false;  // decided on the workers: after the steps queued before this call
        run([&](int rank, DeviceState& d) {
            gather_stats(d, d.stats);
            std::vector<StatValue> gathered = read_gathered(d);
            const bool summed_here = zero->gradients_summed(d.zero);  // the same on every rank
            if (rank == 0) {
                rows = std::move(gathered);
                summed = summed_here;
            }
            if (!summed_here) {
                d.backend->copy_to_host(per_rank[rank].data(), d.zero.grads.slice(p.offset, p.numel()));
            } else {
                // Already summed over devices, in the owners' shards.
                const Tensor grads = zero->grad_shard(global(rank), d.zero);
                for_each_shard_chunk(shard, global(rank), p, p.numel(),
                                     [&](std::int64_t in_shard, std::int64_t in_param, std::int64_t count) {
                    d.backend->copy_to_host(per_rank[0].data() + in_param, grads.slice(in_shard, count));
                });
            }
            d.backend->synchronize();
        });
        const StepStats totals = combine(rows);
        const float scale = totals.tokens ? 1.0f / static_cast<float>(totals.tokens) : 0.0f;
        const int ranks = summed ? 1 : n;
        for (std::int64_t i = 0; i < p.numel(); ++i) {
            float sum = 0.0f;
            for (int r = 0; r < ranks; ++r) sum += per_rank[r][i];
            out[i] = sum * scale;
        }
    }

    // Statistics of all ranks (rows of kGatherStride) combined in rank order.
    StepStats combine(const std::vector<StatValue>& rows) const {
        double sums[kStatCount] = {};
        double lse_max = -std::numeric_limits<double>::infinity();
        for (int r = 0; r < world; ++r) {
            const StatValue* s = &rows[static_cast<std::size_t>(r) * kGatherStride];
            for (int i = 0; i < kStatCount; ++i) sums[i] += s[i];
            lse_max = std::max(lse_max, s[kLseMax]);
        }
        StepStats out;
        const double nan = std::numeric_limits<double>::quiet_NaN();
        // A mean over no counted tokens is reported as 0 (tokens == 0 says
        // there were none), never NaN, which would read as a diverged run.
        out.tokens = static_cast<std::int64_t>(sums[kTokens]);
        out.loss = out.tokens ? sums[kLossSum] / sums[kTokens] : 0.0;
        out.loss_1k = sums[kTokens1k] > 0 ? sums[kLoss1kSum] / sums[kTokens1k] : 0.0;
        out.z_loss = out.tokens ? sums[kZLossSum] / sums[kTokens] : 0.0;
        out.lse_mean = out.tokens ? sums[kLseSum] / sums[kTokens] : 0.0;
        out.lse_max = out.tokens ? lse_max : 0.0;
        out.grad_norm = nan;
        return out;
    }

    // Puts this rank's `stats` into its row of `gathered` and gathers all rows.
    void gather_stats(DeviceState& d, const Tensor& stats) {
        d.backend->copy(d.gathered.slice(std::int64_t(d.comm->rank()) * kGatherStride, kStatCount), stats);
        d.comm->all_gather(d.gathered);
    }

    std::vector<StatValue> read_gathered(DeviceState& d) {
        std::vector<StatValue> host(static_cast<std::size_t>(world) * kGatherStride);
        d.backend->copy_to_host(host.data(), d.gathered);
        d.backend->synchronize();
        return host;
    }

    // Runs `body`, device work that repeats whenever `key` does, through the
    // backend's run_captured (a CUDA graph on cuda); directly while the
    // communication is traced: the trace records the host's issue order,
    // which a replay does not repeat.
    void run_repeating(DeviceState& d, const std::string& key, const std::function<void()>& body) {
        if (d.trace) return body();
        d.backend->run_captured(key, body);
    }

    // Per-token positions (packed documents) of one batch, for all of this
    // trainer's devices (null: none), shared by the batch's tasks.
    using Positions = std::shared_ptr<const std::vector<std::int32_t>>;

    // The host copy of a batch's positions, checked: each row starts a
    // document, and a position is 0 (a new document) or one more than the
    // one before it.
    Positions take_positions(const std::int32_t* positions) const {
        if (!positions) return nullptr;
        if (!config.causal)
            throw InvalidArgument("positions (packed documents) need a causal model; this one has causal false");
        const int T = options.seq_len;
        const std::int64_t rows = std::int64_t(size()) * options.batch_size;
        // Copied first, then checked: the copy is what the steps read (the caller's array may change).
        auto copy = std::make_shared<const std::vector<std::int32_t>>(positions, positions + rows * T);
        const std::int32_t* checked = copy->data();
        for (std::int64_t r = 0; r < rows; ++r)
            for (int t = 0; t < T; ++t) {
                const std::int32_t p = checked[r * T + t];
                const std::int32_t before = t == 0 ? -1 : checked[r * T + t - 1];
                if (p != 0 && p != before + 1)
                    throw InvalidArgument("positions[" + std::to_string(r) + ", " + std::to_string(t) + "] is " +
                                          std::to_string(p) + ": a position is 0 (a document starts) or one more "
                                          "than the one before it (" + std::to_string(before) + ")");
            }
        return copy;
    }

    // Gives the model this device's part of `positions` (null: none).
    void load_positions(int rank, DeviceState& d, const Positions& positions) const {
        if (!positions) return d.model->use_positions(Tensor(), *d.allocator);
        if (!d.positions.data)
            d.positions = d.allocator->allocate(Context::Workspace, "positions", DType::I32,
                                                {options.batch_size, options.seq_len});
        d.backend->copy_from_host(d.positions,
                                  positions->data() + std::int64_t(rank) * options.batch_size * options.seq_len);
        d.model->use_positions(d.positions, *d.allocator);
    }

    // Copies this device's part of a batch into d.tokens and d.targets (also
    // from this device's own memory: the work after it then reads the same
    // buffers whatever the caller passed, so that it can be captured).
    void load_batch(int rank, DeviceState& d, const std::int32_t* inputs, const std::int32_t* targets,
                    int source_device) {
        const std::int64_t offset = std::int64_t(rank) * options.batch_size * options.seq_len;
        if (source_device >= 0) d.backend->wait_batch_ready(*devices[source_device].backend);
        if (source_device == rank) {
            auto view = [&](const std::int32_t* p) {
                return Tensor(const_cast<std::int32_t*>(p + offset), DType::I32, {options.batch_size, options.seq_len});
            };
            d.backend->copy(d.tokens, view(inputs));
            d.backend->copy(d.targets, view(targets));
            return;
        }
        if (source_device < 0) {
            d.backend->copy_from_host(d.tokens, inputs + offset);
            d.backend->copy_from_host(d.targets, targets + offset);
        } else {
            d.backend->copy_from_device(d.tokens, inputs + offset, source_device);
            d.backend->copy_from_device(d.targets, targets + offset, source_device);
        }
    }

    // Where this rank holds parameter p whole (see ZeroSharding::whole_weights).
    Tensor whole_weights(const DeviceState& d, const ParameterInfo& p) const {
        return p.trainable ? zero->whole_weights(d.zero, p) : d.frozen.slice(p.offset, p.numel());
    }

    // out[0] += sum of squares of this rank's gradient shard, streamed
    // through the device buffer when the shard lives in host memory.
    void gradient_squares(int rank, DeviceState& d, const Tensor& out) {
        const Tensor grads = zero->grad_shard(global(rank), d.zero);
        if (!d.staged_grads.data) return d.backend->sum_squares(out, grads);
        for (std::int64_t at = 0; at < shard; at += d.staged_grads.numel()) {
            const std::int64_t count = std::min(d.staged_grads.numel(), shard - at);
            const Tensor staged = d.staged_grads.slice(0, count);
            d.backend->copy(staged, grads.slice(at, count));
            d.backend->sum_squares(out, staged);
        }
    }

    // The rounding seed of this rank's chunk that starts at global element `at`.
    std::uint64_t adamw_seed(std::int64_t at) const {
        return options.seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(at);
    }

    AdamWStep adamw_step(const UpdateParams& params, int step_number) const {
        return AdamWStep{params.lr, params.beta1, params.beta2, params.eps, params.weight_decay, step_number, 0};
    }

    // The per-step values of the update (the whole-shard AdamW's and the
    // gradient clip that optimizer_scale reads), into the device from the
    // host-writable staging (whose previous copy ended with the previous
    // update's synchronize()), before any captured work that reads them.
    void write_adamw_step(int rank, DeviceState& d, const UpdateParams& params, int step_number) {
        std::vector<double> values =
            adamw_step_values(adamw_step(params, step_number), adamw_seed(global(rank) * shard));
        values[kAdamWGradClip] = params.grad_clip;
        std::memcpy(d.adamw_step_staging.data, values.data(), values.size() * sizeof(double));
        d.backend->copy(d.adamw_step_values, d.adamw_step_staging);
    }

    // AdamW over this rank's shard: one adamw_shard, or, when offload keeps
    // state in host memory, parameter by parameter (weight decay differs)
    // and chunk by chunk, each chunk copied into the device buffers, updated
    // there and copied back. adamw_shard rounds as that loop does, so the
    // results are the same either way.
    void optimizer_step(int rank, DeviceState& d, const UpdateParams& params, int step_number) {
        Backend& be = *d.backend;
        const Tensor grad_shard = zero->grad_shard(global(rank), d.zero);
        if (whole_shard_adamw()) {
            be.adamw_shard(AdamWShard{d.master,
                                      d.master_is_weights ? Tensor() : zero->weight_shard(global(rank), d.zero),
                                      grad_shard, d.adam_m, d.adam_v, d.optimizer_scale, d.adamw_step_values,
                                      d.adamw_segment_table, kOptimizerChunk});
            return;
        }
        const std::int64_t lo = global(rank) * shard, hi = lo + shard;
        AdamWStep step = adamw_step(params, step_number);
        for (const ParameterInfo& p : layout) {
            const std::int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + p.numel());
            step.weight_decay = p.weight_decay ? params.weight_decay : 0.0f;
            for (std::int64_t at = begin; at < end; at += kOptimizerChunk) {
                const std::int64_t count = std::min(kOptimizerChunk, end - at);
                auto on_device = [&](const Tensor& state, const Tensor& staging) {
                    const Tensor part = state.slice(at - lo, count);
                    if (!staging.data) return part;
                    const Tensor staged = staging.slice(0, count);
                    be.copy(staged, part);
                    return staged;
                };
                const Tensor master = on_device(d.master, d.staged_master);
                const Tensor adam_m = on_device(d.adam_m, d.staged_m);
                const Tensor adam_v = on_device(d.adam_v, d.staged_v);
                // Distinct rounding noise for every chunk: the kernels index from the chunk start.
                step.seed = adamw_seed(at);
                const Tensor grads = on_device(grad_shard, d.staged_grads);
                be.adamw(master, grads, adam_m, adam_v, d.optimizer_scale, step);
                if (d.staged_master.data) be.copy(d.master.slice(at - lo, count), master);
                if (d.staged_m.data) {
                    be.copy(d.adam_m.slice(at - lo, count), adam_m);
                    be.copy(d.adam_v.slice(at - lo, count), adam_v);
                }
                if (!d.master_is_weights) be.copy(zero->weight_shard(global(rank), d.zero).slice(at - lo, count), master);
            }
        }
    }

    void check_source(int source_device) const {
        if (source_device < -1 || source_device >= size())
            throw InvalidArgument("batch is on device " + std::to_string(source_device) + ", but this trainer uses devices 0.." +
                                  std::to_string(size() - 1));
    }
};

Trainer::Trainer(const ModelConfig& config, const TrainOptions& options) : Trainer(config, options, nullptr) {}

Trainer::Trainer(const ModelConfig& config, const TrainOptions& options, std::shared_ptr<ProcessTransport> transport)
    : impl_(std::make_unique<Impl>(config, options)) {
    Impl& m = *impl_;
    const BackendPlugin& plugin = *m.plugin;
    const int available = plugin.device_count();
    if (options.backend != "cpu" && options.first_device + options.devices > available)
        throw InvalidArgument("asked for " + std::to_string(options.devices) + " " + options.backend +
                              " device(s)" +
                              (options.first_device ? " from device " + std::to_string(options.first_device) : "") +
                              ", but " + std::to_string(available) + " are available");
    const int n = options.devices;

    m.group = plugin.create_group(
        Topology{m.world, m.first_rank, n, options.comm_id, world_signature(config, options), std::move(transport)});
    m.devices.resize(n);
    m.pool = std::make_unique<WorkerPool>(n, [&m](int rank) { m.abort_rank(rank); });
    // Should a worker fail, each releases its own communicator on its own
    // thread before the rest of the state is freed.
    struct ReleaseOnFailure {
        Impl& m;
        bool armed = true;
        ~ReleaseOnFailure() {
            if (armed) m.release_communicators();
        }
    } release_on_failure{m};
    m.run([&](int rank, DeviceState& d) {
        d.backend = plugin.create_backend(options.first_device + rank, m.threads);
        d.backend->configure(options);
        d.allocator = std::make_unique<NamedAllocator>(*d.backend, rank, options.memory_limit);
        d.comm = m.group->connect(rank, *d.backend);
        allocate_device_state(m, rank, d, true);
        if (d.master_is_weights) d.master = m.zero->weight_shard(m.global(rank), d.zero);
        if (m.lora.enabled()) {
            d.weight_views =
                attach_adapters(bind_weights(config, d.frozen), bind_lora(config, m.lora, d.zero.weights));
            if (!options.inference) d.grad_views = bind_lora(config, m.lora, d.zero.grads);
        } else {
            d.weight_views = m.zero->weight_views(d.zero);
            if (!options.inference) d.grad_views = m.zero->grad_views(d.zero);
        }
        m.zero->fill_zero(*d.backend, d.zero);
        for (const Tensor& t : {d.frozen, d.adam_m, d.adam_v, d.master})
            if (t.data) d.backend->fill(t, 0.0f);
        if (d.adamw_segment_table.data && !d.adamw_segments.empty())
            d.backend->copy_from_host(d.adamw_segment_table, adamw_segment_table(d.adamw_segments).data());
        reset_stats(*d.backend, d.stats);
        d.backend->synchronize();
        d.comm->barrier();  // every rank is connected and ready
    });
    release_on_failure.armed = false;
}

Trainer::~Trainer() { impl_->release_communicators(); }

int Trainer::world_size() const { return impl_->world; }
int Trainer::devices() const { return impl_->size(); }
int Trainer::first_rank() const { return impl_->first_rank; }
const std::vector<ParameterInfo>& Trainer::parameters() const { return impl_->parameters; }
void Trainer::wait() {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->drain();
}

bool Trainer::wait_ready(int milliseconds, bool for_step) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const auto timeout = std::chrono::milliseconds(std::max(0, milliseconds));
    if (for_step) return m.pool->wait_for_within(m.slot_ticket[m.steps_queued % kBatchSlots], timeout);
    return m.pool->wait_idle_for(timeout);
}

void Trainer::discard_micro_batches() {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const bool validating = m.validate_pending;
    m.validate_pending = false;  // its result, once computed, is never read
    if (m.failed || (m.micro_steps == 0 && !validating)) return;
    if (m.world != m.size()) {
        m.failed = true;
        m.stopped_by = "an interrupt in a world of several trainers (the others' collectives would not match)";
        return;
    }
    m.pool->drop_unstarted();
    if (m.micro_steps == 0) return;
    m.pool->submit(
        [&m](int rank) {
            DeviceState& d = m.devices[rank];
            m.zero->clear_gradients(*d.backend, d.zero);
            reset_stats(*d.backend, d.stats);
            d.zero.gradients_reduced = false;
            d.backend->synchronize();
        },
        "discarding the interrupted micro-batches");
    m.micro_steps = 0;
}

int Trainer::micro_steps() const { return impl_->micro_steps; }
int Trainer::optimizer_steps() const { return impl_->optimizer_steps; }
TestingHooks& Trainer::testing_hooks() { return impl_->testing_hooks; }

AttentionInfo Trainer::attention_info(int device) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (device < 0 || device >= devices()) throw InvalidArgument("no device " + std::to_string(device));
    impl_->drain();  // plans are built by the queued steps
    return impl_->devices[device].backend->attention_info();
}

std::vector<CommEvent> Trainer::communication_trace(int device) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (device < 0 || device >= devices()) throw InvalidArgument("no device " + std::to_string(device));
    impl_->drain();  // the steps queued so far have recorded their events
    std::vector<CommEvent> out;
    if (const auto& trace = impl_->devices[device].trace)
        for (CommTrace::Event& e : trace->take()) out.push_back(CommEvent{std::move(e.what), e.layer, e.ticket});
    return out;
}


void Trainer::set_parameter(int index, const float* data) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const ParameterInfo& p = m.parameter_at(index, false);
    m.run([&](int rank, DeviceState& d) {
        const Tensor whole = m.whole_weights(d, p);
        const Tensor shard = m.zero->weight_shard(m.global(rank), d.zero);
        const std::int64_t shard_begin = m.global(rank) * m.shard;
        for (std::int64_t done = 0; done < p.numel(); done += d.staging.numel()) {
            const std::int64_t count = std::min(d.staging.numel(), p.numel() - done);
            const Tensor staged = d.staging.slice(0, count);
            d.backend->copy_from_host(staged, data + done);
            if (whole.data) d.backend->copy(whole.slice(done, count), staged);
            if (!p.trainable) continue;
            // The part of this chunk inside this rank's shard: the stage-3
            // weight shard and a separate master copy hold it too.
            const std::int64_t begin = std::max(p.offset + done, shard_begin);
            const std::int64_t end = std::min(p.offset + done + count, shard_begin + m.shard);
            if (begin >= end) continue;
            const Tensor part = staged.slice(begin - p.offset - done, end - begin);
            if (m.zero->separate_weight_shard()) d.backend->copy(shard.slice(begin - shard_begin, end - begin), part);
            if (!d.master_is_weights) d.backend->copy(d.master.slice(begin - shard_begin, end - begin), part);
        }
        d.backend->weights_changed();
        d.backend->synchronize();
    });
}

void Trainer::get_parameter(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    const ParameterInfo& p = m.parameter_at(index, false);
    if (m.whole_weights(m.devices[0], p).data) {
        m.run([&](int rank, DeviceState& d) {
            if (rank != 0) return;  // weights held whole are the same on every rank
            copy_to_host_staged(d, m.whole_weights(d, p), out);
            d.backend->synchronize();
        });
        return;
    }
    m.require_whole_world("get_parameter of a stage-3 layer weight");
    m.read_owned_weights(p, out);  // the whole world's part is the whole parameter
}

void Trainer::get_parameter_part(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    m.read_owned_weights(m.parameter_at(index, true), out);
}

void Trainer::get_optimizer_state(int index, int kind, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("get_optimizer_state");
    Impl& m = *impl_;
    const ParameterInfo& p = m.parameter_at(index, true);
    m.require_whole_world("get_optimizer_state");
    m.read_owned_optimizer_state(p, kind, out);
}

void Trainer::set_optimizer_state(int index, int kind, const float* data) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("set_optimizer_state");
    Impl& m = *impl_;
    const ParameterInfo& p = m.parameter_at(index, true);
    m.write_owned_optimizer_state(p, kind, data + m.owned_range(p).first);  // reads only this part
}

void Trainer::get_optimizer_state_part(int index, int kind, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("get_optimizer_state_part");
    Impl& m = *impl_;
    m.read_owned_optimizer_state(m.parameter_at(index, true), kind, out);
}

void Trainer::set_optimizer_state_part(int index, int kind, const float* data) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("set_optimizer_state_part");
    Impl& m = *impl_;
    m.write_owned_optimizer_state(m.parameter_at(index, true), kind, data);
}

std::pair<std::int64_t, std::int64_t> Trainer::owned_range(int index) const {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    return impl_->owned_range(impl_->parameter_at(index, true));
}

void Trainer::set_optimizer_steps(int steps) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (steps < 0) throw InvalidArgument("optimizer steps must be >= 0, got " + std::to_string(steps));
    if (impl_->micro_steps) throw InvalidArgument("cannot set the optimizer step with micro-batches pending");
    impl_->optimizer_steps = steps;
}

void Trainer::get_gradient(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("get_gradient");
    impl_->read_gradient(impl_->parameter_at(index, true), out, true);
}

void Trainer::get_gradient_addend(int index, float* out) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("get_gradient_addend");
    impl_->read_gradient(impl_->parameter_at(index, true), out, false);
}

void Trainer::step(const std::int32_t* inputs, const std::int32_t* targets, int source_device,
                   std::uintptr_t inputs_stream, std::uintptr_t targets_stream, const std::int32_t* positions) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    m.require_training("step()");
    m.check_source(source_device);
    if (m.micro_steps >= m.options.grad_accum)
        throw InvalidArgument("step() called " + std::to_string(m.micro_steps + 1) +
                              " times without update(), but grad_accum is " + std::to_string(m.options.grad_accum));
    m.refuse_if_failed();
    if (m.pool->failed()) m.drain();  // an earlier step's failure surfaces here
    const std::int64_t rows = std::int64_t(m.options.batch_size) * m.options.seq_len;
    const int slot = static_cast<int>(m.steps_queued % kBatchSlots);
    const Impl::Positions packed_positions = m.take_positions(positions);
    const bool packed = packed_positions != nullptr;
    if (source_device < 0) {
        // The slot is free once the step that used it last has read it.
        if (!m.pool->wait_for(m.slot_ticket[slot])) m.drain();
        for (int rank = 0; rank < m.size(); ++rank) {
            auto* staged = static_cast<std::int32_t*>(m.devices[rank].batch_staging.data) + slot * 2 * rows;
            std::memcpy(staged, inputs + rank * rows, sizeof(std::int32_t) * rows);
            std::memcpy(staged + rows, targets + rank * rows, sizeof(std::int32_t) * rows);
            // The copies are what the step reads: checked here, nothing can change them after.
            m.check_batch_ids(staged, rows, false);
            m.check_batch_ids(staged + rows, rows, true);
        }
    } else {
        m.record_batch_streams(source_device, inputs_stream, targets_stream);
    }
    const std::int64_t fault = m.testing_hooks.take(TestingHook::kFailNextStepInWorker);
    const std::int64_t delay_rank = m.testing_hooks.take(TestingHook::kDelayNextStepInWorker);
    const std::int64_t delay = m.testing_hooks.get(TestingHook::kDelayNextStepMilliseconds);
    // Dropout masks differ per step, micro-batch and device.
    const std::uint64_t dropout_step = std::uint64_t(m.optimizer_steps) * m.options.grad_accum + m.micro_steps;
    const std::string label = "step() #" + std::to_string(m.steps_queued + 1) + " (micro-batch " +
                              std::to_string(m.micro_steps + 1) + " of optimizer step " +
                              std::to_string(m.optimizer_steps + 1) + ")";
    const bool last_micro_batch = m.micro_steps + 1 == m.options.grad_accum;
    const bool overlap = m.testing_hooks.get(TestingHook::kSynchronousReductions) == 0;
    const bool tracing = m.testing_hooks.get(TestingHook::kTraceCommunication) != 0;
    const long ticket = m.pool->submit(
        [&m, slot, rows, fault, delay_rank, delay, dropout_step, inputs, targets, source_device, last_micro_batch,
         overlap, tracing, packed, packed_positions](int rank) {
            DeviceState& d = m.devices[rank];
            if (tracing != static_cast<bool>(d.trace)) {  // each rank sets its own communicator's trace
                d.trace = tracing ? std::make_unique<CommTrace>() : nullptr;
                d.comm->set_trace(d.trace.get());
            }
            if (rank == delay_rank) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
            if (rank == fault) throw NanoqError("injected fault in worker " + std::to_string(rank));
            // The micro-batch moves into this device's own buffers, so that
            // neither the staging slot nor the caller's device arrays are
            // read after this task ends.
            if (source_device < 0) {
                const Tensor staged = d.batch_staging.slice(slot * 2 * rows, 2 * rows);
                d.backend->copy_from_staging(d.tokens, staged.data);
                d.backend->copy_from_staging(d.targets, staged.slice(rows, rows).data);
            } else {
                d.backend->wait_batch_ready(*m.devices[source_device].backend);
                const std::int64_t offset = rank * rows;
                if (source_device == rank) {
                    auto view = [&](const std::int32_t* p) {
                        return Tensor(const_cast<std::int32_t*>(p + offset), DType::I32,
                                      {m.options.batch_size, m.options.seq_len});
                    };
                    d.backend->copy(d.tokens, view(inputs));
                    d.backend->copy(d.targets, view(targets));
                } else {
                    d.backend->copy_from_device(d.tokens, inputs + offset, source_device);
                    d.backend->copy_from_device(d.targets, targets + offset, source_device);
                }
            }
            m.load_positions(rank, d, packed_positions);
            if (d.dropout_seed.data) {
                const std::uint64_t dropout_seed =
                    mix_seed(mix_seed(m.options.seed, dropout_step), std::uint64_t(m.global(rank)));
                d.backend->copy_from_host(d.dropout_seed, &dropout_seed);
            }
            // After the positions' and the seed's copies too: the wait for
            // it below then leaves the backend's pinned staging free for the
            // next micro-batch's, which would otherwise copy from pageable
            // memory (a copy that may wait for the work queued before it).
            d.backend->mark_batch_read();
            ZeroLayers layers(*m.zero, d.zero, d.weight_views, d.grad_views, *d.backend, *d.comm, last_micro_batch,
                              overlap, d.trace.get());
            // Forward and backward issue the same work for every micro-batch
            // but the last (which may start the ZeRO reductions): captured
            // once per kind.
            const auto forward_backward = [&] {
                d.model->forward_backward(d.weight_views, d.grad_views, layers, d.tokens, d.targets, d.stats,
                                          m.options.z_loss, *d.stack, d.dropout_seed);
                layers.finish_backward();
            };
            m.run_repeating(d,
                            std::string("step:last=") + (last_micro_batch ? "1" : "0") +
                                ":overlap=" + (overlap ? "1" : "0") + ":positions=" + (packed ? "1" : "0"),
                            forward_backward);
            if (layers.reduced_in_backward()) d.zero.gradients_reduced = true;
            // After the step's work is queued, so that the device never idles
            // while this thread waits for the copies.
            d.backend->wait_batch_read();
        },
        label);
    ++m.steps_queued;
    ++m.micro_steps;
    if (source_device < 0) {
        m.slot_ticket[slot] = ticket;
    } else if (!m.pool->wait_for(ticket)) {
        // A device batch is the caller's again once every device has copied it.
        m.drain();
    }
}

StepStats Trainer::validate(const std::int32_t* inputs, const std::int32_t* targets, int source_device,
                            std::uintptr_t inputs_stream, std::uintptr_t targets_stream,
                            const std::int32_t* positions) {
    queue_validate(inputs, targets, source_device, inputs_stream, targets_stream, positions);
    return validate_result();
}

void Trainer::queue_validate(const std::int32_t* inputs, const std::int32_t* targets, int source_device,
                             std::uintptr_t inputs_stream, std::uintptr_t targets_stream,
                             const std::int32_t* positions) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    m.check_source(source_device);
    m.refuse_if_failed();
    if (m.validate_pending) throw InvalidArgument("validate() queued twice: collect the first with validate_result()");
    // A host batch is copied, then checked: the task reads the copy, which nothing else can change (an
    // interrupted validate's task outlives the call, and the caller may refill its arrays).
    std::shared_ptr<std::vector<std::int32_t>> host_batch;
    if (source_device < 0) {
        const std::int64_t count = std::int64_t(m.size()) * m.options.batch_size * m.options.seq_len;
        host_batch = std::make_shared<std::vector<std::int32_t>>(inputs, inputs + count);
        host_batch->insert(host_batch->end(), targets, targets + count);
        m.check_batch_ids(host_batch->data(), count, false);
        m.check_batch_ids(host_batch->data() + count, count, true);
        inputs = host_batch->data();
        targets = host_batch->data() + count;
    }
    const Impl::Positions packed_positions = m.take_positions(positions);
    m.record_batch_streams(source_device, inputs_stream, targets_stream);
    const std::int64_t delay_rank = m.testing_hooks.take(TestingHook::kDelayNextValidateInWorker);
    const std::int64_t delay = m.testing_hooks.get(TestingHook::kDelayNextStepMilliseconds);
    // The task reads the batch and writes its result only into the trainer: it
    // may outlive this call (validate_result() collects it).
    m.pool->submit(
        [&m, inputs, targets, host_batch, source_device, delay_rank, delay, packed_positions](int rank) {
            DeviceState& d = m.devices[rank];
            if (rank == delay_rank) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
            m.load_batch(rank, d, inputs, targets, source_device);
            m.load_positions(rank, d, packed_positions);
            m.run_repeating(d, packed_positions ? "validate:positions" : "validate", [&] {
                reset_stats(*d.backend, d.eval_stats);
                ZeroLayers layers(*m.zero, d.zero, d.weight_views, d.grad_views, *d.backend, *d.comm);
                d.model->forward_loss(d.weight_views, layers, d.tokens, d.targets, d.eval_stats, m.options.z_loss,
                                      *d.stack);
                m.gather_stats(d, d.eval_stats);
            });
            std::vector<StatValue> gathered = m.read_gathered(d);
            if (rank == 0) m.validate_rows = std::move(gathered);
        },
        std::string());
    m.validate_pending = true;
}

StepStats Trainer::validate_result() {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    if (!m.validate_pending) throw InvalidArgument("validate_result() without a queued validate()");
    m.validate_pending = false;
    m.refuse_if_failed();
    m.drain();
    return m.combine(m.validate_rows);
}

void Trainer::forward_cached(const std::int32_t* tokens, int count, int position, bool all_positions,
                             float* logits) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    Impl& m = *impl_;
    m.refuse_if_failed();
    m.require_whole_world("generation (forward_cached)");
    const int capacity = m.options.seq_len, vocab = m.config.vocab_size;
    if (count < 1) throw InvalidArgument("forward_cached needs at least one token, got " + std::to_string(count));
    if (position < 0 || position > m.cached_length)
        throw InvalidArgument("forward_cached at position " + std::to_string(position) + ", but the cache holds " +
                              std::to_string(m.cached_length) + " positions");
    if (position > 0 && count != 1)
        throw InvalidArgument("after the prompt (position 0) forward_cached takes one token at a time, got " +
                              std::to_string(count));
    if (position > 0 && !m.config.causal)
        throw InvalidArgument("a bidirectional model (causal false) has no token-by-token generation: "
                              "forward_cached runs whole sequences (position 0) only");
    if (position + count > capacity)
        throw InvalidArgument("positions up to " + std::to_string(position + count) + " exceed seq_len " +
                              std::to_string(capacity) + ", the longest sequence this trainer runs");
    // Copied, then checked: the workers read the copy (the caller's array may change).
    const std::vector<std::int32_t> copied(tokens, tokens + count);
    for (int i = 0; i < count; ++i)
        if (copied[i] < 0 || copied[i] >= vocab)
            throw InvalidArgument("token id " + std::to_string(copied[i]) + " at " + std::to_string(i) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    if (m.devices[0].kv_cache.capacity == 0) m.allocate_kv_caches();
    m.run([&](int rank, DeviceState& d) {
        d.backend->copy_from_host(d.kv_cache.tokens.slice(position, count), copied.data());
        ZeroLayers layers(*m.zero, d.zero, d.weight_views, d.grad_views, *d.backend, *d.comm);
        d.model->forward_cached(d.weight_views, layers, d.kv_cache, position, count, all_positions, *d.stack,
                                [&](const Tensor& out, int first, int /*rows*/) {
                                    if (rank != 0) return;
                                    const int row = all_positions ? first : 0;
                                    d.backend->copy_to_host(logits + std::int64_t(row) * vocab, out);
                                });
        d.backend->synchronize();
    });
    m.cached_length = position + count;
}

StepStats Trainer::update(const UpdateParams& params) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    impl_->require_training("update()");
    Impl& m = *impl_;
    if (m.micro_steps == 0) throw InvalidArgument("update() called before any step(): there are no gradients");
    const int n = m.world;
    const int step_number = m.optimizer_steps + 1;
    std::vector<StatValue> rows;
    float scale_norm_skip[3] = {0.0f, 0.0f, 0.0f};
    m.run([&](int rank, DeviceState& d) {
        Backend& be = *d.backend;
        // Per-step values (AdamW's, the gradient clip): host-writable staging
        // copied into the device table before any graph, which reads them
        // from there.
        m.write_adamw_step(rank, d, params, step_number);
        // The work before the optimizer repeats from step to step: captured.
        const bool reduce = m.zero->reduces_at_update(d.zero);
        m.run_repeating(d, std::string("update:before-optimizer:reduce=") + (reduce ? "1" : "0"), [&] {
            m.zero->reduce_gradients(d.zero, *d.comm);
            // This rank's row of `gathered`: its loss statistics and the sum of
            // squares of its gradient shard; the scale is computed on the device.
            const Tensor squares =
                d.gathered.slice(std::int64_t(m.global(rank)) * kGatherStride + kSumSquaresSlot, 1);
            be.fill(squares, 0.0f);
            m.gradient_squares(rank, d, squares);
            m.gather_stats(d, d.stats);
            be.optimizer_scale(d.optimizer_scale, d.gathered, n, d.adamw_step_values.slice(kAdamWGradClip, 1));
        });
        // adamw_shard reads its per-step values from the device table, so it
        // is captured with the weight gather; the offload loop passes them
        // as kernel arguments and runs uncaptured.
        const bool whole_shard = m.whole_shard_adamw();
        if (!whole_shard) m.optimizer_step(rank, d, params, step_number);
        m.run_repeating(d, whole_shard ? "update:optimizer" : "update:after-optimizer", [&] {
            if (whole_shard) m.optimizer_step(rank, d, params, step_number);
            m.zero->gather_weights(d.zero, *d.comm);
            m.zero->clear_gradients(be, d.zero);
            reset_stats(be, d.stats);
        });
        be.weights_changed();  // outside the captures, so that every replay of update() calls it
        d.zero.gradients_reduced = false;
        if (rank == 0) {
            rows = m.read_gathered(d);
            be.copy_to_host(scale_norm_skip, d.optimizer_scale);
        }
        be.synchronize();
    });
    m.micro_steps = 0;
    StepStats result = m.combine(rows);
    result.grad_norm = scale_norm_skip[1];
    result.skipped = scale_norm_skip[2] != 0.0f;
    // A skipped update changed nothing, the AdamW step count included.
    if (!result.skipped) m.optimizer_steps = step_number;
    return result;
}

std::vector<AllocationInfo> Trainer::allocations(int device) const {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (device < 0 || device >= devices()) throw InvalidArgument("no device " + std::to_string(device));
    impl_->drain();
    std::vector<AllocationInfo> out;
    for (const Segment& s : impl_->devices[device].allocator->segments())
        out.push_back(AllocationInfo{context_name(s.context), s.name, s.bytes, memory_kind_name(s.kind), s.exact});
    return out;
}

StackInfo Trainer::stack_info(int device) const {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (device < 0 || device >= devices()) throw InvalidArgument("no device " + std::to_string(device));
    impl_->drain();  // the queued steps move the high-water mark
    const StackArena& stack = *impl_->devices[device].stack;
    StackInfo info{stack.capacity(), stack.high_water(), {}};
    for (const StackEntry& e : stack.live_at_high_water()) info.live_at_high_water.emplace_back(e.name, e.bytes);
    return info;
}

MemoryInfo Trainer::memory_info(int device) {
    std::lock_guard<std::mutex> serial(impl_->call_mutex);
    if (device < 0 || device >= devices()) throw InvalidArgument("no device " + std::to_string(device));
    MemoryInfo info;
    impl_->run([&](int rank, DeviceState& d) {
        if (rank != device) return;
        info.allocated = d.allocator->device_bytes();
        info.limit = d.allocator->limit();
        info.known = d.backend->memory_info(&info.free, &info.total);
    });
    return info;
}

std::vector<DevicePlan> plan_memory(const ModelConfig& config, const TrainOptions& options, bool ask_libraries,
                                    std::size_t device_memory) {
    const TrainerSetup setup(config, options);
    std::vector<DevicePlan> plans;
    for (int rank = 0; rank < options.devices; ++rank) {
        DeviceState d;
        d.allocator = std::make_unique<NamedAllocator>(rank, options.memory_limit);
        allocate_device_state(setup, rank, d, ask_libraries, device_memory);
        // The KV cache as forward_cached allocates it, apart: a run that never
        // generates never holds it.
        NamedAllocator generation(rank, 0);
        d.planned_model->allocate_kv_cache(generation);
        auto info = [](const Segment& s) {
            return AllocationInfo{context_name(s.context), s.name, s.bytes, memory_kind_name(s.kind), s.exact};
        };
        DevicePlan plan;
        for (const Segment& s : d.allocator->segments()) plan.allocations.push_back(info(s));
        for (const Segment& s : generation.segments()) plan.generation.push_back(info(s));
        plan.stack_capacity = d.stack->capacity();
        plan.classifier_rows = d.planned_model->classifier_chunk_rows();
        plans.push_back(std::move(plan));
    }
    return plans;
}

bool has_backend(const std::string& name) { return backend_built(name); }

std::string new_comm_id(const std::string& backend) { return find_backend(backend).new_comm_id(); }

int backend_device_count(const std::string& name) { return find_backend(name).device_count(); }

std::string backend_attention_library(const std::string& name) {
    const BackendPlugin& plugin = find_backend(name);
    return plugin.attention_library ? plugin.attention_library() : "";
}

}  // namespace nanoq
