// The named allocator and the activation stack arena.
//
// Every byte the core takes from a device is recorded with a context (what kind
// of state it is) and a name (which tensor), so that memory can be reported per
// context and an out-of-memory error can name the tensor that did not fit.
// Short-lived temporaries of the backward pass come from a StackArena: one
// allocation sized up front, used last-in-first-out, with its high-water mark.
//
// Planning mode: an allocator made without a backend records the same
// segments, with the same accounting and memory-limit check, but takes no
// memory (every tensor's data is null). The Trainer's allocation sequence
// runs against one to plan a run without a device (plan_memory in
// nanoq/trainer.h); nothing may read or write the tensors it hands out.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <vector>

#include "tensor.h"

namespace nanoq {

class Backend;

enum class Context : int {
    Weights = 0,
    Master,
    Gradients,
    AdamM,
    AdamV,
    Activations,
    Workspace,
    Stack,
    KvCache,  // generation: the keys and values of the sequence so far, and its activations
    Count
};
const char* context_name(Context context);

enum class MemoryKind : int { Device = 0, Pinned, Host };
const char* memory_kind_name(MemoryKind kind);

struct Segment {
    Context context;
    std::string name;
    std::size_t bytes;
    MemoryKind kind;
    void* data;
    bool exact;  // false: `bytes` is an upper bound (a library's size planned without a device)
};

// `bytes` as people read it: "512 B", "1.5 GiB".
std::string human_bytes(std::size_t bytes);

class NamedAllocator {
public:
    // limit_bytes > 0 caps the device memory this allocator hands out (a
    // smaller device, simulated; also how tests provoke out-of-memory).
    NamedAllocator(Backend& backend, int device, std::size_t limit_bytes = 0);
    // Planning mode: records what would be allocated and allocates nothing.
    NamedAllocator(int device, std::size_t limit_bytes);
    ~NamedAllocator();
    NamedAllocator(const NamedAllocator&) = delete;
    NamedAllocator& operator=(const NamedAllocator&) = delete;

    // Allocates a tensor that lives until the allocator is destroyed.
    // Throws OutOfMemory naming the tensor when the backend refuses or the
    // limit would be exceeded (in planning mode too). `exact` is recorded
    // with the segment (see Segment::exact).
    Tensor allocate(Context context, const std::string& name, DType dtype,
                    std::initializer_list<std::int64_t> dims, MemoryKind kind = MemoryKind::Device,
                    bool exact = true);

    // A group of allocations undone: mark() before it, release_after(mark)
    // frees every tensor allocated since, newest first. Only for tensors
    // nobody holds (a group that failed part way, say).
    std::size_t mark() const { return segments_.size(); }
    void release_after(std::size_t mark);

    bool planning() const { return backend_ == nullptr; }
    const std::vector<Segment>& segments() const { return segments_; }
    std::size_t total_bytes(Context context) const;
    std::size_t device_bytes() const { return device_bytes_; }  // all MemoryKind::Device segments
    std::size_t limit() const { return limit_; }

private:
    [[noreturn]] void out_of_memory(Context context, const std::string& name, const Tensor& tensor,
                                    const std::string& reason, const std::string& state_advice) const;

    Backend* backend_;  // null in planning mode
    int device_;
    std::size_t limit_;
    std::size_t device_bytes_ = 0;
    std::vector<Segment> segments_;
};

struct StackEntry {
    std::string name;
    std::size_t offset;
    std::size_t bytes;
};

class StackArena {
public:
    StackArena(NamedAllocator& allocator, std::size_t capacity_bytes);

    Tensor push(const std::string& name, DType dtype, std::initializer_list<std::int64_t> dims);
    // Releases the most recent push; `tensor` must be it (checked).
    void pop(const Tensor& tensor);

    std::size_t capacity() const { return capacity_; }
    std::size_t used() const { return used_; }
    std::size_t high_water() const { return high_water_; }
    const std::vector<StackEntry>& live_at_high_water() const { return live_at_high_water_; }

    static constexpr std::size_t kAlignment = 256;
    static std::size_t aligned(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

private:
    char* base_ = nullptr;
    std::size_t capacity_ = 0;
    std::size_t used_ = 0;
    std::size_t high_water_ = 0;
    std::vector<StackEntry> live_;
    std::vector<StackEntry> live_at_high_water_;
};

// A scope guard that pops what it pushed, in reverse order, even on exceptions.
class StackFrame {
public:
    explicit StackFrame(StackArena& arena) : arena_(arena) {}
    ~StackFrame() {
        for (auto it = pushed_.rbegin(); it != pushed_.rend(); ++it) arena_.pop(*it);
    }
    StackFrame(const StackFrame&) = delete;
    StackFrame& operator=(const StackFrame&) = delete;

    Tensor push(const std::string& name, DType dtype, std::initializer_list<std::int64_t> dims) {
        pushed_.push_back(arena_.push(name, dtype, dims));
        return pushed_.back();
    }

private:
    StackArena& arena_;
    std::vector<Tensor> pushed_;
};

}  // namespace nanoq
