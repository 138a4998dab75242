// The public face of the core: a data-parallel trainer over N devices.
//
// step() copies its batch into the trainer's staging buffers, queues the
// work on every device's worker and returns; every other call first waits
// for the queued work, then blocks until the workers have finished it (an
// error of queued work is thrown there, naming its step). Callers may
// release their language's global lock around any call. Arguments are validated
// by the binding; the core re-checks what it must to stay memory safe and
// throws InvalidArgument (bad call) or NanoqError (failure inside the core).
// After a worker failure the trainer refuses further work; close() it and
// build a new one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nanoq/config.h"
#include "nanoq/errors.h"
#include "nanoq/testing_hooks.h"
#include "nanoq/transport.h"

namespace nanoq {

// One entry of Trainer::communication_trace: `what` is "backward" (layer
// `layer`'s backward is done), "issue" or "wait" (the reduction of `layer`'s
// gradients, -1 the embedding, num_layers the head, with its `ticket`), or
// "comm-start"/"comm-end" (cpu: the communication thread runs collective
// `ticket`) or "compute-waits" (cuda: the compute stream is made to wait for
// collective `ticket` and those before it); layer -2 for those.
struct CommEvent {
    std::string what;
    int layer = 0;
    std::int64_t ticket = 0;
};

class Trainer {
public:
    Trainer(const ModelConfig& config, const TrainOptions& options);
    // One process's trainer in a world across processes: options.world_size
    // is processes x options.devices and options.first_rank this process's
    // rank x options.devices; `transport` reaches the other processes, which
    // make their trainers at the same time with the same config and options
    // (InvalidArgument on every process, naming the difference, when they
    // disagree). Null: as the constructor above.
    Trainer(const ModelConfig& config, const TrainOptions& options, std::shared_ptr<ProcessTransport> transport);
    ~Trainer();
    Trainer(const Trainer&) = delete;
    Trainer& operator=(const Trainer&) = delete;

    // The world's ranks; this trainer's devices (ranks first_rank() ..
    // first_rank() + devices() - 1). One trainer alone: world_size() == devices().
    int world_size() const;
    int devices() const;
    int first_rank() const;
    const std::vector<ParameterInfo>& parameters() const;

    // Copies a full parameter (float32, parameters()[index].shape) to every device.
    void set_parameter(int index, const float* data);
    // Copies a full parameter out (from device 0; weights are replicated).
    // A stage-3 layer weight is gathered from the shards: InvalidArgument
    // when some of them belong to other trainers of the world.
    void get_parameter(int index, float* out);
    // The gradient of the mean loss over the tokens counted so far in this
    // optimizer step, summed over devices, before clipping. Needs the whole
    // world in this trainer (else InvalidArgument).
    void get_gradient(int index, float* out);
    // This trainer's addend of that gradient (full shape, scaled by the whole
    // world's token count): what its devices accumulated, or, once the
    // gradients are summed into the ZeRO owners' shards, the elements its
    // ranks own (zero elsewhere). The world's gradient is the sum of every
    // trainer's addend; never needs the other trainers' data, but it is a
    // collective of the world (its statistics are gathered): every trainer
    // calls it.
    void get_gradient_addend(int index, float* out);

    // Optimizer state of one parameter, as a full float32 tensor gathered
    // from (or scattered to) the shards of every device, so that it moves
    // between device counts: kind 0 = master weights, 1 = AdamW m, 2 = AdamW v.
    // Setting the master weights does not change the weights: set both.
    // Getting needs the whole world in this trainer (else InvalidArgument);
    // setting stores this trainer's shards of the full tensor.
    void get_optimizer_state(int index, int kind, float* out);
    void set_optimizer_state(int index, int kind, const float* data);
    // This trainer's part of a trainable parameter, for checkpoints written
    // by every trainer of a world: owned_range is the elements [begin, end)
    // of the flattened parameter that lie in the shards of this trainer's
    // ranks (the ZeRO owners; begin == end when none do, [0, numel) for a
    // trainer alone in its world). The _part calls read or write those
    // end - begin elements of the weights (from whole weights or the
    // stage-3 shards) or of optimizer state `kind`; they never need the
    // other trainers. Frozen (LoRA) parameters have no part: InvalidArgument.
    std::pair<std::int64_t, std::int64_t> owned_range(int index) const;
    void get_parameter_part(int index, float* out);
    void get_optimizer_state_part(int index, int kind, float* out);
    void set_optimizer_state_part(int index, int kind, const float* data);
    // The AdamW step count (bias correction) to continue from; no micro-batch
    // may be pending.
    void set_optimizer_steps(int steps);

    // Forward + backward of one micro-batch per device. inputs, targets:
    // int32 [devices * batch_size, seq_len], C-contiguous, in host memory
    // (source_device = -1) or in the memory of device `source_device` of
    // this trainer's backend (read in place there, peer-copied elsewhere).
    // A device batch may still be being written on the caller's streams:
    // inputs_stream and targets_stream name them as the CUDA Array
    // Interface v3 does (1: the legacy default stream, 2: the calling
    // thread's per-thread default stream, else a cudaStream_t; 0: nothing
    // to wait for), and the trainer's reads are ordered after the work they
    // hold when the call is made.
    // positions: null, or host int32 [devices * batch_size, seq_len], each
    // token's position in its document for rows that pack several
    // (attention stays inside a document, RoPE restarts): 0 where a
    // document starts (every row starts one), else one more than the
    // position before; copied before the call returns. Needs a causal model.
    void step(const std::int32_t* inputs, const std::int32_t* targets, int source_device = -1,
              std::uintptr_t inputs_stream = 0, std::uintptr_t targets_stream = 0,
              const std::int32_t* positions = nullptr);
    StepStats validate(const std::int32_t* inputs, const std::int32_t* targets, int source_device = -1,
                       std::uintptr_t inputs_stream = 0, std::uintptr_t targets_stream = 0,
                       const std::int32_t* positions = nullptr);
    StepStats update(const UpdateParams& params);
    // validate() in two halves, for a caller that waits in slices
    // (wait_ready()): queue_validate() queues the batch's loss on the devices
    // and returns; the batch must stay valid and unchanged until that work has
    // run (validate_result() returns, or wait_ready() says it is done).
    // validate_result() waits for it and returns the statistics; one
    // validate may be queued at a time. An interrupt's
    // discard_micro_batches() drops the result.
    void queue_validate(const std::int32_t* inputs, const std::int32_t* targets, int source_device = -1,
                        std::uintptr_t inputs_stream = 0, std::uintptr_t targets_stream = 0,
                        const std::int32_t* positions = nullptr);
    StepStats validate_result();
    // Inference over one sequence with a KV cache (context "kv-cache",
    // allocated on the first call and kept): runs tokens[count] at positions
    // position .. position + count - 1, either a prompt (position 0, count <=
    // seq_len: the cache restarts) or one token after the `position` ones
    // the cache holds (count 1). Writes float32 logits of every new position
    // ([count, vocab]) when all_positions, else of the last ([vocab]).
    // Every device runs it (their weights may be sharded); device 0 writes.
    // Needs the whole world in this trainer (else InvalidArgument).
    void forward_cached(const std::int32_t* tokens, int count, int position, bool all_positions, float* logits);

    // Waits for the work step() queued; an error of that work is thrown
    // here, naming its step (close() and the destructor do not throw it).
    void wait();
    // Interrupts. wait_ready() waits at most `milliseconds` for what the next
    // call would wait for first: the queued work (for_step: only until the
    // next step()'s batch slot is free). It returns whether that is done (or
    // has failed; the next call throws), so a caller can wait in slices and
    // check for interrupts in between.
    bool wait_ready(int milliseconds, bool for_step);
    // For a caller interrupted while micro-batches run: discards every
    // micro-batch since the last update() and returns at once. Queued ones
    // that no device has begun never run; the one running finishes on the
    // devices, and then its gradients and statistics are cleared with the
    // others', so the trainer is as after the last update() (micro_steps()
    // is 0, the next step() or validate() is valid, and an update() waits
    // for that work). In a world of several trainers, whose collectives
    // would then not match, the trainer refuses further work instead (close
    // it). A validate() queued and not collected is dropped too (as the
    // micro-batches, if no device has begun it). Nothing else to discard
    // (micro_steps() is 0): does nothing more.
    void discard_micro_batches();

    int micro_steps() const;   // step() calls since the last update()
    int optimizer_steps() const;

    std::vector<AllocationInfo> allocations(int device) const;
    StackInfo stack_info(int device) const;
    MemoryInfo memory_info(int device);

    // The hooks tests arm to reach failure paths (nanoq/testing_hooks.h).
    TestingHooks& testing_hooks();
    // Testing: what each device recorded while the "trace_communication"
    // hook is armed, in the order it happened (when each layer's backward
    // finished, each reduction was issued and waited for, and the
    // communicator ran it); returned and cleared.
    std::vector<CommEvent> communication_trace(int device);
    // Which attention `device` runs and the fused library's plans built so
    // far (AttentionInfo, nanoq/config.h); waits for the queued steps.
    AttentionInfo attention_info(int device);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// What Trainer(config, options) would allocate, per device in rank order,
// computed without a device: the Trainer's own allocation sequence run
// against planning allocators, so the lists equal allocations(device) and
// StackInfo::capacity of such a trainer, entry for entry; `generation` lists
// what its first forward_cached then allocates (the KV cache, planned
// without the memory_limit, which the Trainer checks when it allocates).
// No backend is created (the backend's library is loaded for its scratch
// plan), so it works for any device count, and for "cuda" on a machine
// without a GPU.
// Options are checked as the Trainer checks them (the count of available
// devices aside), and a memory_limit that the Trainer would exceed throws
// the same OutOfMemory. Library-sized scratch (CUB's) is asked of the
// library when `ask_libraries`, and is an upper bound with exact = false
// where it cannot answer (no GPU) or is not asked. `device_memory` (bytes,
// 0 = none) plans each device as one of that size: on a backend that sizes
// the classifier's chunk by the device's memory (cuda), the chunk the
// Trainer would choose on such a device, without one being here.
std::vector<DevicePlan> plan_memory(const ModelConfig& config, const TrainOptions& options,
                                    bool ask_libraries = true, std::size_t device_memory = 0);

// Whether a backend is compiled into this install ("cpu" always is); does
// not load it.
bool has_backend(const std::string& name);
// A fresh communicator id (TrainOptions::comm_id) of the backend, to hand to
// every trainer of one world; loads the backend's library.
std::string new_comm_id(const std::string& backend);
// Devices the backend can use now; loads the backend's library. Throws
// InvalidArgument if it is not built, NanoqError if it cannot be loaded.
int backend_device_count(const std::string& name);
// The fused attention library the backend was built with, in words
// ("cuDNN 9.28.1"), or "" for none; loads the backend's library (errors as
// backend_device_count).
std::string backend_attention_library(const std::string& name);
// The sgemm a cpu backend created now runs: name "openblas" (the
// scipy-openblas32 library, when this build links it) or "portable" (nanoq's
// own, always compiled). The environment variable NANOQ_CPU_GEMM
// ("portable" or "openblas"), read by each cpu backend when it is created,
// overrides the default (OpenBLAS when built). Throws InvalidArgument for
// another value, or for "openblas" in a build without it.
struct CpuGemm {
    std::string name;
    bool openblas_built = false;
};
CpuGemm cpu_gemm();

// The host memory the cpu backend's trainers may hold together now: what the
// machine has available (MemAvailable of /proc/meminfo, within the process's
// cgroup limit) or the environment variable NANOQ_CPU_MEMORY_AVAILABLE
// (bytes), plus what they hold already; and where the figure comes from.
// `bytes` is 0 where the machine does not say (no check then). The cpu
// backend refuses an allocation that would pass it (an OutOfMemory error)
// rather than let the kernel's out-of-memory killer end the process.
struct HostMemory {
    std::size_t bytes = 0;
    std::string source;
};
HostMemory cpu_host_memory();

// What the memory cgroups of a process leave (its own, as `self_cgroup`
// names them in /proc/self/cgroup's format, and each above it, under
// `cgroup_root`, /sys/fs/cgroup: v2's files there, v1's in memory/): the
// least of limit - usage over those with a limit, usage without the page
// cache the kernel reclaims first (inactive files: the token files nanoq
// has read, say), as container runtimes count it. SIZE_MAX where no cgroup
// sets a limit. cpu_host_memory() takes the least of this and MemAvailable.
std::size_t cgroup_memory_available(const std::string& self_cgroup, const std::string& cgroup_root);

}  // namespace nanoq
