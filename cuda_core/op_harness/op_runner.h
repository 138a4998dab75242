// Single backend ops on host arrays: the test surface for backend parity.
//
// An OpRunner owns one device's backend (cpu, cuda, ...) and runs any op of
// the table (op_table.cpp) by name, so that tests can feed every backend the
// same inputs and compare the outputs op by op. Each call checks its
// arguments against the op's spec (shapes, dtypes, token ranges), stages
// its own device memory and scratch sized for that call, NaN-fills the
// outputs, runs the op, copies the results back and frees everything:
// calls are independent and slow, which is what a test wants. time() runs
// one call many times on the same device tensors, for the op benchmark.
//
// Every call blocks until the device has finished. Calls from several
// threads run one at a time; a cuda runner for a device other than 0 must be
// called from the thread that created it (the backend selects its GPU there).
// Errors: InvalidArgument for a bad call, NanoqError for a failure inside the
// backend. The binding (nanoq._ops) is the only caller.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nanoq/errors.h"

namespace nanoq::ops {

// Element type of a host array: float32 (activations, weights and their
// gradients), int32 (tokens), float64 (statistics).
enum class HostType : int { F32 = 0, I32 = 1, F64 = 2 };

// A tensor argument as the caller gives it (C-contiguous, read only).
struct HostArray {
    std::string name;
    HostType type = HostType::F32;
    std::vector<std::int64_t> shape;
    const void* data = nullptr;
};

// The scalar arguments given, by name; dtypes are "fp32" or "bf16".
struct Scalars {
    std::map<std::string, std::int64_t> ints;
    std::map<std::string, double> floats;
    std::map<std::string, bool> bools;
    std::map<std::string, std::uint64_t> seeds;
    std::map<std::string, std::string> dtypes;
};

// A tensor the op returns (an in/out or output), owned.
struct HostResult {
    std::string name;
    HostType type = HostType::F32;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
};

// The table as the binding sees it. role: "input", "in_out", "output",
// "int", "float", "bool", "seed", "dtype"; host_dtype: "float32", "int32",
// "float64" (tensors); device_dtype: a dtype argument's name or a fixed
// dtype (tensors); default_value: the default as text (empty: none);
// default_from: the argument (or int of the shapes) whose value is the default.
struct ArgInfo {
    std::string name, role, shape, host_dtype, device_dtype, default_value, default_from;
    bool required = true;
};
struct OpInfo {
    std::string name, doc;
    std::vector<ArgInfo> args;
    std::vector<std::string> results;
};
std::vector<OpInfo> describe_ops();

// Names of the cross_entropy statistics slots (stat_slots.h) in order, and
// the width of a row of optimizer_scale's `gathered` (the slots, then a
// rank's sum of squares).
std::vector<std::string> stat_slots();
int gather_stride();

class OpRunner {
public:
    // `threads`: OpenMP threads of the cpu backend (0 = all cores); ignored by others.
    OpRunner(const std::string& backend, int device, int threads = 0);
    ~OpRunner();
    OpRunner(const OpRunner&) = delete;
    OpRunner& operator=(const OpRunner&) = delete;

    const std::string& backend_name() const;
    int device() const;

    // Runs op `op` (a name of the table); returns its result tensors in order.
    std::vector<HostResult> run(const std::string& op, const std::vector<HostArray>& tensors,
                                const Scalars& scalars);

    // Times op `op` for benchmarks: stages the call as run() does, runs the
    // op once (warm-up: plans, autotuning, first-touch), then `repeats`
    // times back to back on the same device tensors, and returns the mean
    // seconds of one run, from an idle device to the device done (host
    // clock around synchronize). In/out tensors carry over from run to run.
    double time(const std::string& op, const std::vector<HostArray>& tensors, const Scalars& scalars,
                int repeats);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace nanoq::ops
