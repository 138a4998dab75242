#include "allocator.h"

#include <cstdio>

#include "backend.h"
#include "nanoq/errors.h"

namespace nanoq {

const char* context_name(Context context) {
    switch (context) {
        case Context::Weights: return "weights";
        case Context::Master: return "master";
        case Context::Gradients: return "gradients";
        case Context::AdamM: return "adam-m";
        case Context::AdamV: return "adam-v";
        case Context::Activations: return "activations";
        case Context::Workspace: return "workspace";
        case Context::Stack: return "stack";
        case Context::KvCache: return "kv-cache";
        case Context::Count: break;
    }
    return "?";
}

const char* memory_kind_name(MemoryKind kind) {
    switch (kind) {
        case MemoryKind::Device: return "device";
        case MemoryKind::Pinned: return "pinned";
        case MemoryKind::Host: return "host";
    }
    return "?";
}

NamedAllocator::NamedAllocator(Backend& backend, int device, std::size_t limit_bytes)
    : backend_(&backend), device_(device), limit_(limit_bytes) {}

NamedAllocator::NamedAllocator(int device, std::size_t limit_bytes)
    : backend_(nullptr), device_(device), limit_(limit_bytes) {}

NamedAllocator::~NamedAllocator() {
    if (!backend_) return;
    for (auto it = segments_.rbegin(); it != segments_.rend(); ++it) backend_->raw_free(it->data, it->kind);
}

std::string human_bytes(std::size_t bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double value = static_cast<double>(bytes);
    int unit = 0;
    while (value >= 1024.0 && unit < 4) {
        value /= 1024.0;
        ++unit;
    }
    char text[32];
    std::snprintf(text, sizeof(text), unit ? "%.1f %s" : "%.0f %s", value, units[unit]);
    return text;
}

Tensor NamedAllocator::allocate(Context context, const std::string& name, DType dtype,
                                std::initializer_list<std::int64_t> dims, MemoryKind kind, bool exact) {
    Tensor tensor(nullptr, dtype, dims);
    const std::size_t bytes = tensor.bytes();
    if (kind == MemoryKind::Device && limit_ && device_bytes_ + bytes > limit_)
        out_of_memory(context, name, tensor, "the memory limit of " + human_bytes(limit_) + " would be exceeded",
                      Backend::device_state_memory_advice());  // a limit stands for a device's own memory
    void* data = bytes && backend_ ? backend_->raw_alloc(bytes, kind) : nullptr;
    if (bytes && backend_ && !data) {
        const std::string why = backend_->refusal();
        out_of_memory(context, name, tensor,
                      std::string("the ") + backend_->name() + " backend refused" + (why.empty() ? "" : ": " + why),
                      backend_->state_memory_advice());
    }
    tensor.data = data;
    segments_.push_back(Segment{context, name, bytes, kind, data, exact});
    if (kind == MemoryKind::Device) device_bytes_ += bytes;
    return tensor;
}

void NamedAllocator::release_after(std::size_t mark) {
    while (segments_.size() > mark) {
        const Segment& s = segments_.back();
        if (backend_) backend_->raw_free(s.data, s.kind);
        if (s.kind == MemoryKind::Device) device_bytes_ -= s.bytes;
        segments_.pop_back();
    }
}

void NamedAllocator::out_of_memory(Context context, const std::string& name, const Tensor& tensor,
                                   const std::string& reason, const std::string& state_advice) const {
    std::string table;
    for (int c = 0; c < static_cast<int>(Context::Count); ++c) {
        const std::size_t total = total_bytes(static_cast<Context>(c));
        if (total) table += "\n  " + std::string(context_name(static_cast<Context>(c))) + ": " + human_bytes(total);
    }
    const bool per_token = context == Context::Activations || context == Context::Stack;
    const std::string suggestion =
        per_token ? "lower batch_size (per device) or seq_len, raising grad_accum to keep the tokens per step"
                  : state_advice;
    throw OutOfMemory("out of memory on device " + std::to_string(device_) + " allocating '" + name + "' (" +
                      context_name(context) + ", " + dtype_name(tensor.dtype) + " " + tensor.shape_string() + ", " +
                      human_bytes(tensor.bytes()) + "): " + reason + "; already allocated on this device:" +
                      (table.empty() ? " nothing" : table) + "\n  total: " + human_bytes(device_bytes()) +
                      "\nsuggestion: " + suggestion + " (nanoq memory estimates the options)");
}

std::size_t NamedAllocator::total_bytes(Context context) const {
    std::size_t total = 0;
    for (const Segment& s : segments_)
        if (s.context == context) total += s.bytes;
    return total;
}

StackArena::StackArena(NamedAllocator& allocator, std::size_t capacity_bytes) : capacity_(capacity_bytes) {
    Tensor storage = allocator.allocate(Context::Stack, "activation-stack", DType::F32,
                                        {static_cast<std::int64_t>(capacity_bytes / 4)});
    base_ = static_cast<char*>(storage.data);
}

Tensor StackArena::push(const std::string& name, DType dtype, std::initializer_list<std::int64_t> dims) {
    Tensor tensor(nullptr, dtype, dims);
    const std::size_t bytes = aligned(tensor.bytes());
    if (used_ + bytes > capacity_)
        throw OutOfMemory("activation stack exhausted pushing '" + name + "' " + tensor.shape_string() + " (" +
                          std::to_string(bytes) + " bytes; " + std::to_string(used_) + " of " +
                          std::to_string(capacity_) + " in use)");
    tensor.data = base_ + used_;
    live_.push_back(StackEntry{name, used_, bytes});
    used_ += bytes;
    if (used_ > high_water_) {
        high_water_ = used_;
        live_at_high_water_ = live_;
    }
    return tensor;
}

void StackArena::pop(const Tensor& tensor) {
    if (live_.empty() || base_ + live_.back().offset != tensor.data)
        throw InternalError("activation stack popped out of order");
    used_ = live_.back().offset;
    live_.pop_back();
}

}  // namespace nanoq
