// How an op of the test harness is declared: its arguments with their roles
// and shapes, and a body that calls the Backend method. The table of ops
// (op_table.cpp) is a list of OpSpecs; the runner (op_runner.h) stages,
// checks and runs any of them generically, and the Python binding
// (nanoq._ops) builds its methods from the same table.
//
// Shapes are strings of comma-separated dimensions, each one
//   a name    an int of the op, bound from the first given tensor that has
//             it and checked against the others ("M,K" then "K,N");
//   a number  a fixed size ("3");
//   name/k    a size that must divide exactly ("head_dim/2");
// the first may be "*name": any leading dimensions, the same for every
// tensor with that group; `name` is bound to their product ("*rows,channels"
// is [..., channels] with rows = the elements of "..."; "*n" is any shape
// of n elements). "flag?A:B" picks shape A when the bool argument `flag` is
// true, else B. Names that are not declared arguments are inferred from the
// given tensors and are not arguments of the Python call.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "allocator.h"
#include "backend.h"
#include "op_harness/op_runner.h"
#include "tensor.h"

namespace nanoq::ops {

enum class ArgRole { Input, InOut, Output, Int, Float, Bool, Seed, DTypeName };

// What an optional tensor is when the caller does not give it.
enum class WhenMissing {
    Required,  // it must be given
    Absent,    // an input the op does without: an empty Tensor (OpCall::given says which)
    Output,    // an output (NaN-filled until the op writes it)
    Zeros,     // an in/out starting at zeros
    StatInit,  // an in/out starting as empty statistics (zeros, lse_max -inf)
};

struct ArgSpec {
    std::string name;
    ArgRole role;
    std::string shape;  // tensors only (see above)
    // A tensor's device dtype: `fixed` when set (F32, F64 statistics, I32
    // tokens), else the value of the dtype argument `dtype_arg` ("fp32" or
    // "bf16"; the activation dtype). The host array is float64 for F64,
    // int32 for I32, else float32.
    std::string dtype_arg = "dtype";
    bool has_fixed = false;
    DType fixed = DType::F32;
    WhenMissing when_missing = WhenMissing::Required;
    std::string given_flag;   // a bool that is true when this optional tensor is given
    std::string token_bound;  // int32 tensors: values must lie in [0, int `token_bound`)
    bool allow_ignore = false;  // ... or be -100
    // Scalars: the default (when has_default), or the value of another
    // argument of the same role (`default_from`); ints at least `minimum`.
    bool has_default = false;
    double default_value = 0.0;
    std::string default_from;
    std::int64_t minimum = std::numeric_limits<std::int64_t>::min();
    // Bools: when true, output tensor `alias_target` is not staged on its
    // own: the op gets the device tensor of `alias_source` as both.
    std::string alias_target, alias_source;

    ArgSpec f32() const { return with_fixed(DType::F32); }
    ArgSpec f64() const { return with_fixed(DType::F64); }
    ArgSpec dtype(const std::string& arg) const { ArgSpec a = *this; a.dtype_arg = arg; return a; }
    ArgSpec optional() const { return missing(WhenMissing::Absent); }
    ArgSpec or_output() const { return missing(WhenMissing::Output); }
    ArgSpec or_zeros() const { return missing(WhenMissing::Zeros); }
    ArgSpec or_stat_init() const { return missing(WhenMissing::StatInit); }
    ArgSpec sets(const std::string& flag) const { ArgSpec a = *this; a.given_flag = flag; return a; }
    ArgSpec at_least(std::int64_t m) const { ArgSpec a = *this; a.minimum = m; return a; }
    ArgSpec aliases(const std::string& target, const std::string& source) const {
        ArgSpec a = *this;
        a.alias_target = target;
        a.alias_source = source;
        return a;
    }

private:
    ArgSpec with_fixed(DType d) const { ArgSpec a = *this; a.has_fixed = true; a.fixed = d; return a; }
    ArgSpec missing(WhenMissing m) const { ArgSpec a = *this; a.when_missing = m; return a; }
};

inline bool is_tensor(ArgRole role) {
    return role == ArgRole::Input || role == ArgRole::InOut || role == ArgRole::Output;
}
// The host array's element type of a tensor argument, and its numpy name.
HostType host_type(const ArgSpec& tensor);
const char* host_dtype_name(HostType type);

// Tensors.
ArgSpec input(const std::string& name, const std::string& shape);
ArgSpec output(const std::string& name, const std::string& shape);
ArgSpec in_out(const std::string& name, const std::string& shape);
ArgSpec tokens(const std::string& name, const std::string& shape, const std::string& bound);   // [0, bound)
ArgSpec targets(const std::string& name, const std::string& shape, const std::string& bound);  // or -100
// Scalars, required or with a default.
ArgSpec integer(const std::string& name);
ArgSpec integer(const std::string& name, std::int64_t default_value);
ArgSpec integer_like(const std::string& name, const std::string& default_from);
ArgSpec real(const std::string& name);
ArgSpec real(const std::string& name, double default_value);
ArgSpec flag(const std::string& name, bool default_value);
ArgSpec seed(const std::string& name);
ArgSpec seed(const std::string& name, std::uint64_t default_value);
// A device dtype argument, "fp32" by default or the value of `default_from`.
ArgSpec dtype_arg(const std::string& name, const std::string& default_from = "");

class OpCall;

struct OpSpec {
    std::string name;
    std::string doc;  // one line: what the op computes
    std::vector<ArgSpec> args;
    // Tensors returned, in order; empty: every in/out and output, in `args` order.
    std::vector<std::string> results;
    std::function<void(OpCall&)> run;
    // The scratch to reserve (default: none).
    std::function<ScratchShapes(const OpCall&)> scratch = nullptr;
    // Checks beyond the shapes; throw InvalidArgument.
    std::function<void(const OpCall&)> check = nullptr;
    // Fixed ints the shapes may name ("slots", the statistics' length).
    std::vector<std::pair<std::string, std::int64_t>> constants = {};
};

// The resolved arguments of one call, as an op's body and checks see them.
class OpCall {
public:
    virtual ~OpCall() = default;
    virtual Backend& backend() = 0;
    virtual const Tensor& operator[](const std::string& tensor) const = 0;  // its device tensor
    virtual bool given(const std::string& tensor) const = 0;  // whether the caller gave it
    virtual bool has(const std::string& tensor) const = 0;    // whether the op declares it (in run)
    virtual int i(const std::string& name) const = 0;
    virtual float f(const std::string& name) const = 0;
    virtual bool b(const std::string& name) const = 0;
    virtual std::uint64_t seed(const std::string& name) const = 0;
    // The device dtype a dtype argument ("dtype", ...) resolved to.
    virtual DType dtype(const std::string& dtype_arg) const = 0;
    // A float32 input made from host values (for arguments the backend takes as a tensor).
    virtual Tensor upload(const std::vector<float>& values, const std::string& name) = 0;
    // The same for float64 values (a table the backend reads on the device).
    virtual Tensor upload_f64(const std::vector<double>& values, const std::string& name) = 0;
    // Device memory for the op alone, of the activation dtype `dtype_arg`
    // names (a workspace the backend takes as a tensor; not read back).
    virtual Tensor workspace(std::int64_t elements, const std::string& dtype_arg, const std::string& name) = 0;
};

// No scratch, rows = `rows`, time = 1 (the cpu backend's attention scratch
// grows with time^2: ops that are not attention must not reserve it).
ScratchShapes no_scratch();
ScratchShapes row_scratch(int rows);

const std::vector<OpSpec>& op_table();  // op_table.cpp
// Throws std::logic_error naming the op and the argument when an entry is
// inconsistent (a duplicate name, an alias or flag on the wrong kind of
// argument, a shape naming a bool that does not exist, ...).
void validate_table(const std::vector<OpSpec>& table);

}  // namespace nanoq::ops
