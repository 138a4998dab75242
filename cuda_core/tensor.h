// Tensors of the core: a typed view of memory owned by a device allocator.
//
// A Tensor never owns its memory; the NamedAllocator (or the StackArena) that
// produced it does. Kernels see raw pointers only; the dtype travels with the
// tensor so that dtype dispatch happens in one place per backend.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace nanoq {

enum class DType : int { F32 = 0, BF16 = 1, I32 = 2, F64 = 3 };

inline std::size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::F32: return 4;
        case DType::BF16: return 2;
        case DType::I32: return 4;
        case DType::F64: return 8;
    }
    return 0;
}

inline const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::F32: return "float32";
        case DType::BF16: return "bfloat16";
        case DType::I32: return "int32";
        case DType::F64: return "float64";
    }
    return "?";
}

struct Tensor {
    static constexpr int kMaxDims = 4;

    void* data = nullptr;
    DType dtype = DType::F32;
    int ndim = 0;
    std::array<std::int64_t, kMaxDims> shape{};

    Tensor() = default;
    Tensor(void* data_, DType dtype_, std::initializer_list<std::int64_t> dims);

    std::int64_t numel() const;
    std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
    std::string shape_string() const;

    // A view of `count` elements starting at element `offset` (1-D).
    Tensor slice(std::int64_t offset, std::int64_t count) const;

    float* f32() const;  // throws unless dtype is F32
    std::int32_t* i32() const;  // throws unless dtype is I32
    double* f64() const;  // throws unless dtype is F64
};

}  // namespace nanoq
