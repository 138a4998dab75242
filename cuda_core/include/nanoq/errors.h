// Exceptions thrown by the core. The binding maps them to Python:
// InvalidArgument -> ValueError, everything else -> nanoq.NanoqError subclasses.
#pragma once

#include <stdexcept>
#include <string>

namespace nanoq {

// Base of every failure inside the core.
struct NanoqError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A caller passed something the core cannot accept.
struct InvalidArgument : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A broken invariant of the core itself (a bug, not a user error).
struct InternalError : NanoqError {
    explicit InternalError(const std::string& what) : NanoqError("internal error: " + what) {}
};

// An allocation did not fit; the message names the tensor and its context.
struct OutOfMemory : NanoqError {
    using NanoqError::NanoqError;
};

// A collective was abandoned because another worker failed.
struct WorkerAborted : NanoqError {
    using NanoqError::NanoqError;
};

}  // namespace nanoq
