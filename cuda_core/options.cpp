// The one definition of the training options' choices, limits and rules
// (see nanoq/options.h). Each option is a row of kFields: its schema entry
// and how to read its value from a TrainOptions; each rule a row of kRules:
// its schema entry and the condition it states.
#include "nanoq/options.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <utility>

#include "nanoq/config.h"
#include "nanoq/errors.h"

namespace nanoq {

namespace {

struct Field {
    OptionSpec spec;
    const char* noun = nullptr;  // Set options: what one name is, in messages ("recompute option")
    // How to read the value (one of these, by kind).
    double (*number)(const TrainOptions&) = nullptr;
    std::string (*choice)(const TrainOptions&) = nullptr;  // the chosen name; "" if it is none of them
    std::uint32_t (*bits)(const TrainOptions&) = nullptr;
    bool (*flag)(const TrainOptions&) = nullptr;
};

struct Rule {
    OptionRule spec;
    bool (*holds)(const TrainOptions&);
};

OptionLimit at_least(double value) { return OptionLimit{true, value, true}; }
OptionLimit above(double value) { return OptionLimit{true, value, false}; }
OptionLimit at_most(double value) { return OptionLimit{true, value, true}; }
OptionLimit below(double value) { return OptionLimit{true, value, false}; }
constexpr OptionLimit kNone{};

const std::vector<OptionChoice> kPrecisions = {{"fp32", "32-bit IEEE float", {}},
                                               {"bf16", "bfloat16 (8-bit exponent, 7-bit mantissa)", {}}};

const std::vector<OptionChoice> kAttentionImpls = {
    {"auto", "cuDNN's fused attention where the backend has it and supports the shape, else native", {}},
    {"cudnn", "cuDNN's fused attention (tensor cores), an error where it is not available", {}},
    {"native", "nanoq's own attention kernel", {}}};
const std::vector<OptionChoice> kMatmulPrecisions = {
    {"auto", "the dtype of the activations", {}},
    {"fp8",
     "the projections forward and backward in fp8, each operand with a per-tensor scale from its absolute maximum: "
     "e4m3 activations and weights, e5m2 gradients (cuda, dtype bf16)",
     {}}};

// The name of choice `i` of `choices`; "" if there is none (a corrupt enum).
std::string name_or_empty(const std::vector<OptionChoice>& choices, int i) {
    return i >= 0 && i < static_cast<int>(choices.size()) ? choices[i].name : std::string();
}

std::string precision_or_empty(Precision p) { return name_or_empty(kPrecisions, static_cast<int>(p)); }

Field number(const char* name, const char* help, OptionLimit minimum, OptionLimit maximum,
             double (*get)(const TrainOptions&)) {
    Field f;
    f.spec = OptionSpec{name, OptionKind::Number, help, {}, minimum, maximum};
    f.number = get;
    return f;
}

// Every integer option is a C int of TrainOptions: without a stated
// maximum, INT_MAX is its maximum, so that Python refuses a larger value
// naming the option instead of failing to convert it.
Field integer(const char* name, const char* help, OptionLimit minimum, OptionLimit maximum,
              double (*get)(const TrainOptions&)) {
    Field f = number(name, help, minimum,
                     maximum.present ? maximum : at_most(double(std::numeric_limits<int>::max())), get);
    f.spec.kind = OptionKind::Integer;
    return f;
}

Field choice(const char* name, const char* help, std::vector<OptionChoice> choices,
             std::string (*get)(const TrainOptions&)) {
    Field f;
    f.spec = OptionSpec{name, OptionKind::Choice, help, std::move(choices), kNone, kNone};
    f.choice = get;
    return f;
}

Field flag(const char* name, const char* help, bool (*get)(const TrainOptions&)) {
    Field f;
    f.spec = OptionSpec{name, OptionKind::Flag, help, {}, kNone, kNone};
    f.flag = get;
    return f;
}

Field set(const char* name, const char* noun, const char* help, std::vector<OptionChoice> choices,
          std::uint32_t (*get)(const TrainOptions&)) {
    Field f;
    f.spec = OptionSpec{name, OptionKind::Set, help, std::move(choices), kNone, kNone};
    f.noun = noun;
    f.bits = get;
    return f;
}

const std::vector<Field>& fields() {
    static const std::vector<Field> table = {
        choice("backend", "the compute backend",
               {{"cpu", "C++ with OpenMP and OpenBLAS: the reference backend, always built", {}},
                {"cuda", "NVIDIA GPUs (CUDA kernels, cuBLASLt, NCCL)", {}},
                {"cuda_emulated", "the cuda backend's code on a CPU emulator of CUDA (tests only, slow)", {}}},
               [](const TrainOptions& o) { return o.backend; }),
        integer("devices", "devices trained on (GPUs, or worker threads on cpu)", at_least(1), kNone,
                [](const TrainOptions& o) { return double(o.devices); }),
        integer("batch_size", "sequences per device per micro-batch", at_least(1), kNone,
                [](const TrainOptions& o) { return double(o.batch_size); }),
        integer("seq_len", "tokens per sequence", at_least(1), kNone,
                [](const TrainOptions& o) { return double(o.seq_len); }),
        integer("grad_accum", "micro-batches per optimizer step (step() calls per update())", at_least(1), kNone,
                [](const TrainOptions& o) { return double(o.grad_accum); }),
        // (a bound beyond any machine's cores: OpenMP ends the process when it cannot start them)
        integer("threads", "cpu threads per device; 0 = the cores shared out", at_least(0), at_most(1024),
                [](const TrainOptions& o) { return double(o.threads); }),
        number("z_loss", "z-loss coefficient", at_least(0), kNone,
               [](const TrainOptions& o) { return double(o.z_loss); }),
        choice("dtype", "the dtype of the weights and activations", kPrecisions,
               [](const TrainOptions& o) { return precision_or_empty(o.dtype); }),
        choice("master_dtype", "the dtype of the master weights the optimizer updates", kPrecisions,
               [](const TrainOptions& o) { return precision_or_empty(o.master_dtype); }),
        choice("optimizer_dtype", "the dtype of the AdamW moments (bf16 ones with stochastic rounding)", kPrecisions,
               [](const TrainOptions& o) { return precision_or_empty(o.optimizer_dtype); }),
        set("recompute", "recompute option", "activations recomputed in backward instead of kept",
            {{"swiglu", "the SwiGLU output", {}},
             {"norms", "the RMSNorm outputs", {}},
             {"qkv", "the attention inputs q, k, v", {}},
             {"ffn", "gate, up and the SwiGLU output", {"swiglu"}},
             {"block", "everything but each layer's input", {"norms", "qkv", "ffn"}}},
            [](const TrainOptions& o) { return o.recompute.bits; }),
        set("offload", "offload option", "state kept in host memory (pinned on GPUs), streamed through update()",
            {{"optimizer", "the AdamW moments", {}},
             {"master", "the master weights", {}},
             {"gradients", "the gradient shard", {}}},
            [](const TrainOptions& o) { return o.offload.bits; }),
        integer("zero_stage", "sharded across devices: 1 optimizer state, 2 also gradients, 3 also weights",
                at_least(1), at_most(3), [](const TrainOptions& o) { return double(o.zero_stage); }),
        integer("lora_rank", "adapter rank; 0 = every parameter trains (no adapters)", at_least(0), kNone,
                [](const TrainOptions& o) { return double(o.lora_rank); }),
        number("lora_alpha", "adapter outputs are scaled by lora_alpha / lora_rank", above(0), kNone,
               [](const TrainOptions& o) { return double(o.lora_alpha); }),
        number("lora_dropout", "dropout on the adapters' input while training (step(), not validate())", at_least(0), below(1),
               [](const TrainOptions& o) { return double(o.lora_dropout); }),
        set("lora_targets", "LoRA target", "projections that get adapters",
            {{"q", "self_attn.q_proj", {}},
             {"k", "self_attn.k_proj", {}},
             {"v", "self_attn.v_proj", {}},
             {"o", "self_attn.o_proj", {}},
             {"gate", "mlp.gate_proj", {}},
             {"up", "mlp.up_proj", {}},
             {"down", "mlp.down_proj", {}}},
            [](const TrainOptions& o) { return o.lora_targets.bits; }),
        integer("world_size", "ranks of the whole world (several trainers); 0 = this trainer's devices",
                at_least(0), kNone, [](const TrainOptions& o) { return double(o.world_size); }),
        integer("first_rank", "the global rank of this trainer's first device", at_least(0), kNone,
                [](const TrainOptions& o) { return double(o.first_rank); }),
        integer("first_device", "the machine's index of this trainer's first device (several processes per node)",
                at_least(0), kNone, [](const TrainOptions& o) { return double(o.first_device); }),
        choice("attention", "the attention implementation", kAttentionImpls,
               [](const TrainOptions& o) { return name_or_empty(kAttentionImpls, static_cast<int>(o.attention)); }),
        flag("attention_deterministic",
             "cuda (cuDNN): the attention backward bitwise repeatable; false: cuDNN accumulates dq with atomics "
             "(less workspace, not repeatable); nanoq's own kernels are deterministic either way",
             [](const TrainOptions& o) { return o.attention_deterministic; }),
        flag("cuda_graphs", "cuda: capture step() and update() once as CUDA graphs and replay them",
             [](const TrainOptions& o) { return o.cuda_graphs; }),
        flag("packed_documents",
             "step() takes positions (packed documents): cuda reserves their attention mask so that cuDNN runs them "
             "(seq_len a multiple of 8)",
             [](const TrainOptions& o) { return o.packed_documents; }),
        flag("inference",
             "forward passes only (logits, generate, validate): no gradients, master weights or AdamW state are "
             "allocated, activations are kept as with recompute block whatever recompute says, and step() and "
             "update() refuse",
             [](const TrainOptions& o) { return o.inference; }),
        choice("matmul_dtype", "the dtype of the projection matmuls' inputs", kMatmulPrecisions,
               [](const TrainOptions& o) {
                   return name_or_empty(kMatmulPrecisions, static_cast<int>(o.matmul_dtype));
               }),
    };
    return table;
}

// The ranks of the world a trainer belongs to (world_size 0: its own devices).
int world_of(const TrainOptions& o) { return o.world_size ? o.world_size : o.devices; }

// Bit i of a set option is choice i: the enums of options.h must list as many values as the table has choices.
void check_enum_counts() {
    const std::pair<const char*, std::size_t> counts[] = {
        {"recompute", kRecomputeCount}, {"offload", kOffloadCount}, {"lora_targets", kLoraTargetCount}};
    for (const auto& [name, count] : counts)
        for (const Field& f : fields())
            if (f.spec.name == name && f.spec.choices.size() != count)
                throw InternalError(std::string("option ") + name + " has " + std::to_string(f.spec.choices.size()) +
                                    " choices but its enum " + std::to_string(count) + " values");
}

const std::vector<Rule>& rules() {
    static const std::vector<Rule> table = {
        {{"offload_gradients_needs_zero_stage_2",
          {"offload", "zero_stage"},
          "offloading gradients needs zero_stage 2 or 3: at stage 1 every device keeps full gradients, which "
          "backward writes on the device"},
         [](const TrainOptions& o) { return !o.offload.has(kOffloadGradients) || o.zero_stage >= 2; }},
        {{"lora_needs_zero_stage_1",
          {"lora_rank", "zero_stage"},
          "LoRA trains at zero_stage 1 only: its frozen weights are kept whole on every device and its adapters "
          "are small, so stages 2 and 3 would shard nothing that matters"},
         [](const TrainOptions& o) { return o.lora_rank == 0 || o.zero_stage == 1; }},
        {{"lora_needs_targets",
          {"lora_rank", "lora_targets"},
          "no LoRA targets given: lora_targets needs at least one of q, k, v, o, gate, up, down"},
         [](const TrainOptions& o) { return o.lora_rank == 0 || !o.lora_targets.empty(); }},
        {{"cpu_computes_in_fp32",
          {"backend", "dtype", "master_dtype", "optimizer_dtype"},
          "the cpu backend computes in fp32 only: use dtype, master_dtype and optimizer_dtype \"fp32\""},
         [](const TrainOptions& o) {
             return o.backend != "cpu" || (o.dtype == Precision::FP32 && o.master_dtype == Precision::FP32 &&
                                           o.optimizer_dtype == Precision::FP32);
         }},
        {{"cudnn_attention_needs_cuda",
          {"attention", "backend"},
          "attention \"cudnn\" needs the cuda backend (cuda, or cuda_emulated for tests): cpu has no cuDNN"},
         [](const TrainOptions& o) { return o.attention != AttentionImpl::Cudnn || o.backend != "cpu"; }},
        {{"fp8_matmuls_need_cuda_and_bf16",
          {"matmul_dtype", "backend", "dtype"},
          "matmul_dtype \"fp8\" needs the cuda backend and dtype \"bf16\": the fp8 matmuls read bf16 "
          "activations and weights"},
         [](const TrainOptions& o) {
             return o.matmul_dtype != MatmulPrecision::FP8 || (o.backend != "cpu" && o.dtype == Precision::BF16);
         }},
        {{"inference_keeps_weights_only",
          {"inference", "zero_stage", "offload"},
          "an inference trainer keeps whole weights only: zero_stage 1 and nothing offloaded (stages 2 and 3 and "
          "offload are for gradients and optimizer state it does not have)"},
         [](const TrainOptions& o) { return !o.inference || (o.zero_stage == 1 && o.offload.empty()); }},
        {{"world_holds_the_devices",
          {"world_size", "devices"},
          "world_size must be 0 (this trainer's devices are the world) or at least devices"},
         [](const TrainOptions& o) { return o.world_size == 0 || o.world_size >= o.devices; }},
        {{"devices_fit_in_the_world",
          {"first_rank", "devices", "world_size"},
          "first_rank + devices must not exceed the world's ranks: this trainer's devices are the global ranks "
          "first_rank .. first_rank + devices - 1"},
         [](const TrainOptions& o) { return std::int64_t(o.first_rank) + o.devices <= world_of(o); }},
        {{"world_needs_comm_id",
          {"world_size", "devices", "comm_id"},
          "a world of more ranks than this trainer's devices needs comm_id, the same for every member (made once "
          "with nanoq.new_comm_id)"},
         [](const TrainOptions& o) { return world_of(o) == o.devices || !o.comm_id.empty(); }},
    };
    return table;
}

const Field& field(const std::string& name) {
    for (const Field& f : fields())
        if (f.spec.name == name) return f;
    throw InternalError("no option named '" + name + "' in the schema");
}

std::string join_choices(const OptionSpec& spec) {
    std::string out;
    for (const OptionChoice& c : spec.choices) out += (out.empty() ? "" : ", ") + c.name;
    return out;
}

// A number as a user wrote it: 3, not 3.000000; a whole number whole
// (2147483647, not 2.14748e+09), others to 15 significant digits.
std::string format_number(double value) {
    std::ostringstream s;
    if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 1e18)
        s << static_cast<long long>(value);
    else
        s << std::setprecision(15) << value;
    return s.str();
}

// "a", "b" or "c" (or 1, 2 or 3): the alternatives as a sentence lists them.
std::string alternatives(const std::vector<std::string>& items) {
    std::string out;
    for (std::size_t i = 0; i < items.size(); ++i)
        out += (i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
    return out;
}

std::string quoted_choices(const OptionSpec& spec) {
    std::vector<std::string> quoted;
    for (const OptionChoice& c : spec.choices) quoted.push_back('"' + c.name + '"');
    return alternatives(quoted);
}

std::string describe_limits(const OptionSpec& spec) {
    const OptionLimit& lo = spec.minimum;
    const OptionLimit& hi = spec.maximum;
    // A few whole numbers are clearer listed: "1, 2 or 3".
    if (spec.kind == OptionKind::Integer && lo.present && hi.present && lo.inclusive && hi.inclusive &&
        hi.value - lo.value <= 4) {
        std::vector<std::string> values;
        for (double v = lo.value; v <= hi.value; ++v) values.push_back(format_number(v));
        return alternatives(values);
    }
    const std::string what = spec.kind == OptionKind::Integer ? "an integer" : "a finite number";
    if (lo.present && hi.present)
        return what + " in " + (lo.inclusive ? "[" : "(") + format_number(lo.value) + ", " + format_number(hi.value) +
               (hi.inclusive ? "]" : ")");
    if (lo.present) return what + (lo.inclusive ? " >= " : " > ") + format_number(lo.value);
    if (hi.present) return what + (hi.inclusive ? " <= " : " < ") + format_number(hi.value);
    return what;
}

bool within(double value, const OptionSpec& spec) {
    if (!std::isfinite(value)) return false;
    const OptionLimit& lo = spec.minimum;
    const OptionLimit& hi = spec.maximum;
    if (lo.present && (lo.inclusive ? value < lo.value : value <= lo.value)) return false;
    if (hi.present && (hi.inclusive ? value > hi.value : value >= hi.value)) return false;
    return true;
}

void check_field(const Field& f, const TrainOptions& o) {
    const OptionSpec& spec = f.spec;
    switch (spec.kind) {
        case OptionKind::Integer:
        case OptionKind::Number: {
            const double value = f.number(o);
            if (!within(value, spec))
                throw InvalidArgument(spec.name + " must be " + describe_limits(spec) + ", got " +
                                      format_number(value));
            return;
        }
        case OptionKind::Choice: {
            const std::string value = f.choice(o);
            for (const OptionChoice& c : spec.choices)
                if (c.name == value) return;
            throw InvalidArgument(spec.name + " must be " + quoted_choices(spec) + ", got \"" + value + "\"");
        }
        case OptionKind::Flag:
            return;  // a bool holds nothing else
        case OptionKind::Set:
            if (f.bits(o) >> spec.choices.size())
                throw InvalidArgument(spec.name + " holds values beyond its " + std::to_string(spec.choices.size()) +
                                      " choices (" + join_choices(spec) + ")");
            return;
    }
}

std::uint32_t set_named(const std::string& option, const std::vector<std::string>& names) {
    const Field& f = field(option);
    std::uint32_t bits = 0;
    for (const std::string& name : names) {
        std::size_t i = 0;
        while (i < f.spec.choices.size() && f.spec.choices[i].name != name) ++i;
        if (i == f.spec.choices.size())
            throw InvalidArgument("unknown " + std::string(f.noun) + " '" + name + "'; choose from " +
                                  join_choices(f.spec));
        bits |= 1u << i;
    }
    return bits;
}

}  // namespace

const OptionSchema& option_schema() {
    static const OptionSchema schema = [] {
        check_enum_counts();
        OptionSchema s;
        for (const Field& f : fields()) s.options.push_back(f.spec);
        for (const Rule& r : rules()) s.rules.push_back(r.spec);
        return s;
    }();
    return schema;
}

const char* option_kind_name(OptionKind kind) {
    switch (kind) {
        case OptionKind::Choice: return "choice";
        case OptionKind::Set: return "set";
        case OptionKind::Integer: return "integer";
        case OptionKind::Number: return "number";
        case OptionKind::Flag: return "flag";
    }
    throw InternalError("unknown OptionKind");
}

void validate_options(const TrainOptions& options, const std::vector<std::string>& undecided) {
    auto decided = [&](const std::string& name) {
        return std::find(undecided.begin(), undecided.end(), name) == undecided.end();
    };
    for (const std::string& name : undecided) field(name);  // names an option, or a bug
    for (const Field& f : fields())
        if (decided(f.spec.name)) check_field(f, options);
    for (const Rule& r : rules())
        if (std::all_of(r.spec.options.begin(), r.spec.options.end(), decided) && !r.holds(options))
            throw InvalidArgument(r.spec.message);
}

namespace {
// The index of `name` among the choices of choice option `option`.
int choice_named(const std::string& option, const std::string& name) {
    const Field& f = field(option);
    for (std::size_t i = 0; i < f.spec.choices.size(); ++i)
        if (f.spec.choices[i].name == name) return static_cast<int>(i);
    throw InvalidArgument(option + " must be " + quoted_choices(f.spec) + ", got \"" + name + "\"");
}
}  // namespace

Precision precision_named(const std::string& option, const std::string& name) {
    return static_cast<Precision>(choice_named(option, name));
}

AttentionImpl attention_named(const std::string& name) {
    return static_cast<AttentionImpl>(choice_named("attention", name));
}

MatmulPrecision matmul_dtype_named(const std::string& name) {
    return static_cast<MatmulPrecision>(choice_named("matmul_dtype", name));
}

RecomputeSet recompute_named(const std::vector<std::string>& names) {
    return RecomputeSet::from_bits(set_named("recompute", names));
}

OffloadSet offload_named(const std::vector<std::string>& names) {
    return OffloadSet::from_bits(set_named("offload", names));
}

LoraTargetSet lora_targets_named(const std::vector<std::string>& names) {
    return LoraTargetSet::from_bits(set_named("lora_targets", names));
}

RecomputeSet implied_recompute(RecomputeSet chosen) {
    const OptionSpec& spec = field("recompute").spec;
    RecomputeSet out = chosen;
    for (bool grew = true; grew;) {  // until closed: an implied choice may imply more
        grew = false;
        for (std::size_t i = 0; i < spec.choices.size(); ++i) {
            if (!out.has(static_cast<Recomputed>(i))) continue;
            const RecomputeSet more = recompute_named(spec.choices[i].implies);
            if ((out.bits | more.bits) != out.bits) {
                out.bits |= more.bits;
                grew = true;
            }
        }
    }
    return out;
}

}  // namespace nanoq
