// The training options, defined once: their names, choices, limits and the
// rules between them, each rule with its error message.
//
// Everything else derives from this: validate_options() applies every limit
// and rule (the Trainer calls it, and the binding exports it so that Python
// refuses bad options before anything reaches the core); option_schema()
// describes them for Python's choice lists, the CLI's help and the docs. The
// core receives typed values (Precision, and bit sets of the enums below);
// names are turned into them once, at the binding, by the *_named functions.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace nanoq {

struct TrainOptions;

// A dtype an option can name: "fp32" or "bf16".
enum class Precision : int { FP32 = 0, BF16 = 1 };
// The attention implementation (TrainOptions::attention): "auto" (cuDNN's
// fused attention where the backend has it and supports the shape, else
// native), "cudnn" (cuDNN or an error), "native" (nanoq's own kernel).
enum class AttentionImpl : int { Auto = 0, Cudnn = 1, Native = 2 };
// The dtype of the projection matmuls (TrainOptions::matmul_dtype): "auto"
// (the activations' dtype) or "fp8" (the projections forward and backward
// on fp8 operands with per-tensor scales: e4m3, e5m2 for gradients).
enum class MatmulPrecision : int { Auto = 0, FP8 = 1 };

// Activations backward can recompute instead of keeping (TrainOptions::recompute).
enum Recomputed : int { kRecomputeSwiglu, kRecomputeNorms, kRecomputeQkv, kRecomputeFfn, kRecomputeBlock,
                        kRecomputeCount };
// State kept in host memory (TrainOptions::offload).
enum Offloaded : int { kOffloadOptimizer, kOffloadMaster, kOffloadGradients, kOffloadCount };
// The projections LoRA adapters can attach to, in layout order (TrainOptions::lora_targets).
enum LoraTarget : int { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargetCount };

// A set of the values 0..Count-1 of an enum, one bit each.
template <typename Enum, int Count>
struct OptionSet {
    static_assert(Count <= 32, "an OptionSet holds at most 32 values");
    std::uint32_t bits = 0;

    OptionSet() = default;
    OptionSet(std::initializer_list<Enum> values) {
        for (Enum v : values) add(v);
    }
    static OptionSet from_bits(std::uint32_t bits) {
        OptionSet s;
        s.bits = bits & ((std::uint64_t(1) << Count) - 1);
        return s;
    }
    bool has(Enum v) const { return (bits >> static_cast<int>(v)) & 1u; }
    void add(Enum v) { bits |= 1u << static_cast<int>(v); }
    bool empty() const { return bits == 0; }
    bool operator==(const OptionSet& other) const { return bits == other.bits; }
    bool operator!=(const OptionSet& other) const { return bits != other.bits; }
};

using RecomputeSet = OptionSet<Recomputed, kRecomputeCount>;
using OffloadSet = OptionSet<Offloaded, kOffloadCount>;
using LoraTargetSet = OptionSet<LoraTarget, kLoraTargetCount>;

// --- the schema -------------------------------------------------------------

enum class OptionKind {
    Choice,   // one name of `choices` (a string field, or a Precision)
    Set,      // any subset of `choices` (an OptionSet, bit i = choices[i])
    Integer,  // within the limits
    Number,   // finite, within the limits
    Flag,     // true or false
};

struct OptionChoice {
    std::string name;
    std::string help;
    std::vector<std::string> implies;  // Set options: other choices this one turns on too
};

struct OptionLimit {
    bool present = false;
    double value = 0.0;
    bool inclusive = true;
};

struct OptionSpec {
    std::string name;  // the TrainOptions field
    OptionKind kind;
    std::string help;
    std::vector<OptionChoice> choices;  // Choice and Set options, in enum order
    OptionLimit minimum, maximum;       // Integer and Number options
};

// A rule between options: when broken, validate_options throws `message`.
struct OptionRule {
    std::string name;                  // a short identifier
    std::vector<std::string> options;  // the options it relates
    std::string message;
};

struct OptionSchema {
    std::vector<OptionSpec> options;
    std::vector<OptionRule> rules;
};

const OptionSchema& option_schema();
const char* option_kind_name(OptionKind kind);  // "choice", "set", "integer", "number", "flag"

// Throws InvalidArgument with the message of the first limit or rule that
// `options` breaks (limits first, in schema order, then rules in order).
// Options named in `undecided` (e.g. a backend Python will pick later) are
// not checked, nor are the rules that involve them.
void validate_options(const TrainOptions& options, const std::vector<std::string>& undecided = {});

// --- names to typed values (the binding's one conversion) ---------------------
// Each throws InvalidArgument naming an unknown name and the choices.

Precision precision_named(const std::string& option, const std::string& name);
AttentionImpl attention_named(const std::string& name);
MatmulPrecision matmul_dtype_named(const std::string& name);
RecomputeSet recompute_named(const std::vector<std::string>& names);
OffloadSet offload_named(const std::vector<std::string>& names);
LoraTargetSet lora_targets_named(const std::vector<std::string>& names);

// `chosen` with the implications of the schema applied ("block" turns on
// everything, "ffn" also "swiglu").
RecomputeSet implied_recompute(RecomputeSet chosen);

}  // namespace nanoq
