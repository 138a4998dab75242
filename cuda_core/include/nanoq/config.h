// Plain configuration and result types shared by the core and its binding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nanoq/options.h"

namespace nanoq {

// One config for the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Nano-style).
struct ModelConfig {
    int vocab_size = 0;
    int hidden_size = 0;
    int intermediate_size = 0;
    int num_layers = 0;
    int num_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;
    double rope_theta = 10000.0;
    // Llama-3 frequency scaling; off when rope_llama3 is false.
    bool rope_llama3 = false;
    double rope_factor = 1.0;
    double rope_low_freq_factor = 1.0;
    double rope_high_freq_factor = 4.0;
    int rope_original_max_position = 8192;
    float rms_norm_eps = 1e-6f;
    bool tie_embeddings = false;
    bool qkv_bias = false;  // Qwen2
    bool o_bias = false;    // Llama with attention_bias
    bool qk_norm = false;   // Qwen3
    // Nano-style options (all off for Llama and Qwen). max_positions > 0: a
    // learned [max_positions, hidden] position table is added to the token
    // embedding and there is no RoPE. mlp_bias: biases on gate, up and down.
    // dropout: on the embedding, the attention output and the MLP output, in
    // step() only.
    int max_positions = 0;
    bool mlp_bias = false;
    float dropout = 0.0f;
    // Causal self-attention (a language model); false: bidirectional, every
    // token attends every token of its sequence (issue 19).
    bool causal = true;
};

// What each field may hold, and the rules between fields, are defined once
// in nanoq/options.h (validate_options); the comments here say what they mean.
struct TrainOptions {
    std::string backend = "cpu";  // a backend of the schema: cpu, cuda, cuda_emulated
    int devices = 1;
    int batch_size = 1;  // per device
    int seq_len = 0;
    int grad_accum = 1;
    int threads = 0;     // per device, cpu backend; 0 = all cores shared out
    float z_loss = 0.0f;
    std::uint64_t seed = 0;  // stochastic rounding of bf16 optimizer outputs
    // Weights and activations, master weights, AdamW moments.
    Precision dtype = Precision::FP32;
    Precision master_dtype = Precision::FP32;
    Precision optimizer_dtype = Precision::FP32;
    std::size_t memory_limit = 0;  // bytes of device memory per device; 0 = what the device has
    // Activations recomputed in backward instead of kept (empty = keep
    // everything); implied_recompute() adds what each implies.
    RecomputeSet recompute;
    // State kept in host memory (pinned on GPUs) and streamed through device
    // buffers during update(): the AdamW moments, the master weights and, at
    // zero_stage 2 or 3, the gradient shard.
    OffloadSet offload;
    // 1: optimizer state and master weights sharded across devices; 2: also
    // the gradients; 3: also the weights (gathered a layer at a time).
    int zero_stage = 1;
    // LoRA. lora_rank 0: every parameter trains. Otherwise the model's
    // weights are frozen (no gradients, no optimizer state) and only
    // adapters of this rank train, on the projections in lora_targets: a
    // targeted projection computes x W^T + (alpha / rank) * dropout(x) A^T B^T.
    int lora_rank = 0;
    float lora_alpha = 16.0f;
    float lora_dropout = 0.0f;  // applied in step() only
    LoraTargetSet lora_targets{kLoraQ, kLoraK, kLoraV, kLoraO};
    // Topology: this trainer's devices may be a contiguous slice of a larger
    // world (other processes, or other Trainers of this process, hold the
    // rest). world_size 0: this trainer's devices are the whole world.
    // first_rank: the global rank of this trainer's first device. comm_id:
    // the communicator id that every member of the world was given
    // (new_comm_id(); bytes); empty: made here, for a world of this
    // trainer's devices alone.
    int world_size = 0;
    int first_rank = 0;
    std::string comm_id;
    // The index of this trainer's first device among the machine's (the
    // cuda backend's devices first_device .. first_device + devices - 1):
    // several processes on one node drive different GPUs.
    int first_device = 0;
    // The fast path's choices (the cuda backend; others compute the same
    // without them): the attention implementation, whether step() and
    // update() are captured once as CUDA graphs and replayed, and the
    // dtype of the projection matmuls.
    AttentionImpl attention = AttentionImpl::Auto;
    // The fused library's attention backward in its deterministic algorithm
    // (bitwise repeatable; cuDNN keeps dP for every query-key pair) or not
    // (cuDNN accumulates dq with atomics: less memory, not repeatable in the
    // last bits). nanoq's own kernels are deterministic.
    bool attention_deterministic = true;
    bool cuda_graphs = true;
    MatmulPrecision matmul_dtype = MatmulPrecision::Auto;
    // step() and validate() will take positions (packed documents): a
    // backend whose fused attention takes their mask as a bias reserves it
    // (cuda: bf16 [batch_size, 1, seq_len, seq_len]), so that packed rows run
    // there too; without, they run the native kernels. Needs a causal model.
    bool packed_documents = false;
    // A trainer for forward passes only (logits, generate, validate, and
    // reading and writing weights): no gradients, master weights or AdamW
    // state are allocated, and step(), update() and the optimizer state
    // refuse. Needs zero_stage 1 and nothing offloaded.
    bool inference = false;
};

struct UpdateParams {
    float lr = 0.0f;
    float beta1 = 0.9f;
    float beta2 = 0.95f;
    float weight_decay = 0.1f;
    float grad_clip = 1.0f;  // 0 disables clipping
    float eps = 1e-8f;
};

// Means over no counted tokens (tokens == 0) are 0.
struct StepStats {
    double loss = 0.0;       // mean cross-entropy over counted tokens
    double loss_1k = 0.0;    // the same over positions < 1024
    double z_loss = 0.0;     // mean z_loss * lse^2 (in the gradient, not in `loss`)
    double grad_norm = 0.0;  // of the mean-loss gradient, before clipping
    double lse_max = 0.0;
    double lse_mean = 0.0;
    std::int64_t tokens = 0;
    bool skipped = false;    // the loss or gradient was not finite, or no token counted: no update was applied
};

struct ParameterInfo {
    std::string name;  // Hugging Face name
    std::vector<std::int64_t> shape;
    bool weight_decay = false;
    std::int64_t offset = 0;  // in the flat buffer of its kind (trainable or frozen)
    bool trainable = true;    // false: a frozen LoRA base weight (no gradient, no optimizer state)
    std::int64_t numel() const {
        std::int64_t n = 1;
        for (auto d : shape) n *= d;
        return n;
    }
};

struct AllocationInfo {
    std::string context;
    std::string name;
    std::size_t bytes;
    std::string kind;
    // false: `bytes` is an upper bound, a library's need planned where it
    // could not report it (CUB's sort storage without a GPU; plan_memory).
    bool exact = true;
};

// What a Trainer would allocate on one device (plan_memory, nanoq/trainer.h):
// its allocations in order and the activation stack's capacity; and, in
// `generation`, what its first forward_cached (generation) adds: the
// context "kv-cache", one sequence of seq_len positions.
struct DevicePlan {
    std::vector<AllocationInfo> allocations;
    std::size_t stack_capacity = 0;
    std::vector<AllocationInfo> generation;
    int classifier_rows = 0;  // rows of the classifier's logits chunk (batch_size x seq_len: one chunk)
};

struct MemoryInfo {
    std::size_t allocated = 0;   // device memory held by this trainer's allocator
    std::size_t limit = 0;       // TrainOptions::memory_limit (0 = none)
    bool known = false;          // whether free/total below are the device's
    std::size_t free = 0;
    std::size_t total = 0;
};

struct StackInfo {
    std::size_t capacity = 0;
    std::size_t high_water = 0;
    std::vector<std::pair<std::string, std::size_t>> live_at_high_water;
};

// An attention's shape (the backends' ops take it whole). causal: query t
// attends keys 0 .. t (further narrowed to its document by the ops' optional
// positions); false: every query attends every key of its row.
struct AttentionShape {
    int batch, time, heads, kv_heads, head_dim;
    bool causal = true;
};

// Which attention a device runs (Trainer::attention_info): "native" (the
// backend's own kernels) or a fused library ("cuDNN 9.28.1"), and the
// library's plans the device runs (one per pass, and per pass again with
// the mask of packed documents).
struct AttentionInfo {
    std::string implementation = "native";
    int plans = 0;
    // Which attention runs packed documents (positions): the fused library
    // where the run reserved their mask (TrainOptions::packed_documents), else "native".
    std::string documents = "native";
    // How many times the documents' mask was written from positions (once
    // per batch that brings new ones, Backend::positions_changed).
    std::int64_t document_masks = 0;
    // Whether the attention backward is deterministic (the fused library's
    // as TrainOptions::attention_deterministic asks; native: always).
    bool deterministic = true;
};

// The largest shapes a backend's ops will see, so that it can reserve its
// scratch memory once, through the named allocator (and the memory plan can
// ask how much that is, BackendPlugin::scratch_plan).
struct ScratchShapes {
    AttentionShape attention;  // batch and time give rows = batch * time
    int hidden;
    int intermediate;
    int vocab;
    int classifier_rows;       // rows per classifier chunk
    std::int64_t max_reduce;   // longest sum_squares input
    // The run's choices that change what a backend reserves (TrainOptions),
    // and the activations' dtype (a fused attention library's workspace
    // depends on it).
    AttentionImpl attention_impl = AttentionImpl::Auto;
    MatmulPrecision matmul_dtype = MatmulPrecision::Auto;
    Precision dtype = Precision::FP32;
    // The model's layer count, and whether its layer weights keep their
    // addresses for the run (not gathered into reused buffers, as ZeRO
    // stage 3 does): what a cache of per-weight copies needs (cuda's fp8
    // weight cache). 0 / false: no such cache.
    int layers = 0;
    bool weights_in_place = false;
    // The run's attention may take positions (TrainOptions::packed_documents).
    bool packed_documents = false;
    // TrainOptions::attention_deterministic (the fused backward's plans and workspace).
    bool attention_deterministic = true;
    // The run computes gradients (not TrainOptions::inference): only then are
    // the fused attention's backward plans built and their workspace reserved.
    bool backward = true;
};

// The parameters of a config, in flat-buffer order, with Hugging Face names.
std::vector<ParameterInfo> parameter_layout(const ModelConfig& config);

}  // namespace nanoq
