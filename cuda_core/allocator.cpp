#include "allocator.h"

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

NamedAllocator::NamedAllocator(Backend& backend, int device) : backend_(backend), device_(device) {}

NamedAllocator::~NamedAllocator() {
    for (auto it = segments_.rbegin(); it != segments_.rend(); ++it) backend_.raw_free(it->data, it->kind);
}

Tensor NamedAllocator::allocate(Context context, const std::string& name, DType dtype,
                                std::initializer_list<std::int64_t> dims, MemoryKind kind) {
    Tensor tensor(nullptr, dtype, dims);
    const std::size_t bytes = tensor.bytes();
    void* data = bytes ? backend_.raw_alloc(bytes, kind) : nullptr;
    if (bytes && !data) {
        std::string table;
        for (int c = 0; c < static_cast<int>(Context::Count); ++c) {
            std::size_t total = total_bytes(static_cast<Context>(c));
            if (total) table += "\n  " + std::string(context_name(static_cast<Context>(c))) + ": " +
                                std::to_string(total) + " bytes";
        }
        throw OutOfMemory("out of memory on device " + std::to_string(device_) + " allocating '" + name +
                          "' (" + context_name(context) + ", " + dtype_name(dtype) + " " +
                          tensor.shape_string() + ", " + std::to_string(bytes) +
                          " bytes); already allocated:" + (table.empty() ? " nothing" : table));
    }
    tensor.data = data;
    segments_.push_back(Segment{context, name, bytes, kind, data});
    return tensor;
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
