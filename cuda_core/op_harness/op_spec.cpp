// The op table's vocabulary (op_spec.h): the builders of argument specs,
// the checks that an entry is consistent, and the table as the binding sees
// it (describe_ops of op_runner.h).
#include <sstream>
#include <stdexcept>
#include <string>

#include "op_harness/op_runner.h"
#include "op_harness/op_spec.h"

namespace nanoq::ops {

// -- builders (op_spec.h) ------------------------------------------------------

namespace {

ArgSpec tensor(const std::string& name, ArgRole role, const std::string& shape) {
    ArgSpec a;
    a.name = name;
    a.role = role;
    a.shape = shape;
    return a;
}

ArgSpec scalar(const std::string& name, ArgRole role) {
    ArgSpec a;
    a.name = name;
    a.role = role;
    return a;
}

ArgSpec scalar(const std::string& name, ArgRole role, double default_value) {
    ArgSpec a = scalar(name, role);
    a.has_default = true;
    a.default_value = default_value;
    return a;
}

}  // namespace

ArgSpec input(const std::string& name, const std::string& shape) { return tensor(name, ArgRole::Input, shape); }
ArgSpec output(const std::string& name, const std::string& shape) { return tensor(name, ArgRole::Output, shape); }
ArgSpec in_out(const std::string& name, const std::string& shape) { return tensor(name, ArgRole::InOut, shape); }

ArgSpec tokens(const std::string& name, const std::string& shape, const std::string& bound) {
    ArgSpec a = tensor(name, ArgRole::Input, shape);
    a.has_fixed = true;
    a.fixed = DType::I32;
    a.token_bound = bound;
    return a;
}

ArgSpec targets(const std::string& name, const std::string& shape, const std::string& bound) {
    ArgSpec a = tokens(name, shape, bound);
    a.allow_ignore = true;
    return a;
}

ArgSpec integer(const std::string& name) { return scalar(name, ArgRole::Int); }
ArgSpec integer(const std::string& name, std::int64_t value) {
    return scalar(name, ArgRole::Int, static_cast<double>(value));
}
ArgSpec integer_like(const std::string& name, const std::string& default_from) {
    ArgSpec a = scalar(name, ArgRole::Int);
    a.default_from = default_from;
    return a;
}
ArgSpec real(const std::string& name) { return scalar(name, ArgRole::Float); }
ArgSpec real(const std::string& name, double value) { return scalar(name, ArgRole::Float, value); }
ArgSpec flag(const std::string& name, bool value) { return scalar(name, ArgRole::Bool, value ? 1.0 : 0.0); }
ArgSpec seed(const std::string& name) { return scalar(name, ArgRole::Seed); }
ArgSpec seed(const std::string& name, std::uint64_t value) {
    return scalar(name, ArgRole::Seed, static_cast<double>(value));
}
ArgSpec dtype_arg(const std::string& name, const std::string& default_from) {
    ArgSpec a = scalar(name, ArgRole::DTypeName);
    if (default_from.empty()) {
        a.has_default = true;  // "fp32"
    } else {
        a.default_from = default_from;
    }
    return a;
}

ScratchShapes no_scratch() { return ScratchShapes{AttentionShape{0, 0, 0, 0, 0}, 0, 0, 0, 0, 0}; }

ScratchShapes row_scratch(int rows) {
    ScratchShapes s = no_scratch();
    s.attention.batch = rows;
    s.attention.time = 1;
    return s;
}

const char* host_dtype_name(HostType t) {
    switch (t) {
        case HostType::F32: return "float32";
        case HostType::I32: return "int32";
        case HostType::F64: return "float64";
    }
    return "?";
}

HostType host_type(const ArgSpec& a) {
    if (a.has_fixed && a.fixed == DType::F64) return HostType::F64;
    if (a.has_fixed && a.fixed == DType::I32) return HostType::I32;
    return HostType::F32;
}

namespace {

const ArgSpec* find_arg(const OpSpec& op, const std::string& name) {
    for (const ArgSpec& a : op.args)
        if (a.name == name) return &a;
    return nullptr;
}

void validate_op(const OpSpec& op) {
    auto fail = [&](const std::string& what) { throw std::logic_error("op table: " + op.name + ": " + what); };
    auto role_of = [&](const std::string& name) {
        const ArgSpec* a = find_arg(op, name);
        if (!a) fail("no argument " + name);
        return a->role;
    };
    if (!op.run) fail("no body");
    for (std::size_t i = 0; i < op.args.size(); ++i) {
        const ArgSpec& a = op.args[i];
        if (find_arg(op, a.name) != &a) fail("two arguments named " + a.name);
        if (is_tensor(a.role)) {
            if (a.shape.empty()) fail(a.name + " has no shape");
            const std::size_t q = a.shape.find('?');
            if (q != std::string::npos) {
                if (role_of(a.shape.substr(0, q)) != ArgRole::Bool) fail(a.name + "'s shape names no bool");
                if (a.shape.find(':', q) == std::string::npos) fail(a.name + "'s shape has '?' without ':'");
            }
            if (!a.has_fixed && a.dtype_arg != "dtype" && role_of(a.dtype_arg) != ArgRole::DTypeName)
                fail(a.name + "'s dtype names no dtype argument");
            if (a.when_missing == WhenMissing::StatInit && !(a.has_fixed && a.fixed == DType::F64))
                fail(a.name + " starts as statistics but is not .f64()");
            if (a.when_missing == WhenMissing::Absent ? a.role != ArgRole::Input
                                                      : a.when_missing != WhenMissing::Required && a.role != ArgRole::InOut)
                fail(a.name + ": optional() is for inputs, or_output/or_zeros/or_stat_init for in/outs");
            if (!a.given_flag.empty() && a.when_missing == WhenMissing::Required)
                fail(a.name + " sets " + a.given_flag + " but is never missing");
        }
        if (!a.alias_target.empty()) {
            if (a.role != ArgRole::Bool) fail(a.name + ": only bools alias");
            const ArgSpec* target = find_arg(op, a.alias_target);
            if (!target || !(target->role == ArgRole::Output || target->when_missing == WhenMissing::Output))
                fail(a.name + ": alias target " + a.alias_target + " is not an output");
            if (role_of(a.alias_source) != ArgRole::Input) fail(a.name + ": alias source is not an input");
        }
        // (An int's default may name an int of the shapes, which only a call binds.)
        if (a.role == ArgRole::DTypeName && !a.default_from.empty() && role_of(a.default_from) != ArgRole::DTypeName)
            fail(a.name + "'s default names no dtype argument");
    }
    for (const std::string& r : op.results)
        if (!is_tensor(role_of(r)) || role_of(r) == ArgRole::Input) fail("result " + r + " is not an in/out or output");
}

const char* role_name(ArgRole role) {
    switch (role) {
        case ArgRole::Input: return "input";
        case ArgRole::InOut: return "in_out";
        case ArgRole::Output: return "output";
        case ArgRole::Int: return "int";
        case ArgRole::Float: return "float";
        case ArgRole::Bool: return "bool";
        case ArgRole::Seed: return "seed";
        case ArgRole::DTypeName: return "dtype";
    }
    return "?";
}

std::string default_text(const ArgSpec& a) {
    if (!a.has_default) return "";
    std::ostringstream out;
    switch (a.role) {
        case ArgRole::Bool: return a.default_value != 0.0 ? "True" : "False";
        case ArgRole::DTypeName: return "fp32";
        case ArgRole::Int:
        case ArgRole::Seed: out << static_cast<std::int64_t>(a.default_value); break;
        default:
            // The shortest text that reads back as the same double.
            for (int digits = 1; digits <= 17; ++digits) {
                out.str("");
                out.precision(digits);
                out << a.default_value;
                if (std::stod(out.str()) == a.default_value) break;
            }
            break;
    }
    return out.str();
}

}  // namespace

void validate_table(const std::vector<OpSpec>& table) {
    for (const OpSpec& op : table) {
        for (const OpSpec& other : table)
            if (&other != &op && other.name == op.name) throw std::logic_error("op table: two ops named " + op.name);
        validate_op(op);
    }
}

std::vector<OpInfo> describe_ops() {
    std::vector<OpInfo> ops;
    for (const OpSpec& op : op_table()) {
        OpInfo info{op.name, op.doc, {}, op.results};
        bool implicit_dtype = false, explicit_dtype = false;
        for (const ArgSpec& a : op.args) {
            ArgInfo arg;
            arg.name = a.name;
            arg.role = role_name(a.role);
            arg.default_value = default_text(a);
            arg.default_from = a.default_from;
            if (is_tensor(a.role)) {
                arg.shape = a.shape;
                arg.host_dtype = host_dtype_name(host_type(a));
                arg.device_dtype = a.has_fixed ? dtype_name(a.fixed) : a.dtype_arg;
                arg.required = a.when_missing == WhenMissing::Required;
                implicit_dtype |= !a.has_fixed && a.dtype_arg == "dtype";
            } else {
                arg.required = !a.has_default && a.default_from.empty() && a.role != ArgRole::Bool;
                explicit_dtype |= a.name == "dtype";
            }
            info.args.push_back(arg);
        }
        if (implicit_dtype && !explicit_dtype)
            info.args.push_back(ArgInfo{"dtype", "dtype", "", "", "", "fp32", "", false});
        if (info.results.empty()) {
            for (const ArgSpec& a : op.args)
                if (a.role == ArgRole::InOut || a.role == ArgRole::Output) info.results.push_back(a.name);
        }
        ops.push_back(info);
    }
    return ops;
}

}  // namespace nanoq::ops
