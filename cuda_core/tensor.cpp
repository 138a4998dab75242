#include "tensor.h"

#include "nanoq/errors.h"

namespace nanoq {

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<std::int64_t> dims)
    : data(data_), dtype(dtype_) {
    if (dims.size() > kMaxDims) throw InternalError("tensor with more than 4 dimensions");
    for (std::int64_t d : dims) shape[ndim++] = d;
}

std::int64_t Tensor::numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
}

std::string Tensor::shape_string() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) {
        if (i) s += ", ";
        s += std::to_string(shape[i]);
    }
    return s + "]";
}

Tensor Tensor::slice(std::int64_t offset, std::int64_t count) const {
    if (offset < 0 || count < 0 || offset + count > numel())
        throw InternalError("slice [" + std::to_string(offset) + ", +" + std::to_string(count) +
                            ") out of a tensor of " + std::to_string(numel()) + " elements");
    char* base = static_cast<char*>(data) + static_cast<std::size_t>(offset) * dtype_size(dtype);
    return Tensor(base, dtype, {count});
}

namespace {

template <class T>
T* typed(const Tensor& t, DType expected) {
    if (t.dtype != expected)
        throw InternalError(std::string("expected a tensor of ") + dtype_name(expected) + ", got " + dtype_name(t.dtype));
    return static_cast<T*>(t.data);
}

}  // namespace

float* Tensor::f32() const { return typed<float>(*this, DType::F32); }
std::int32_t* Tensor::i32() const { return typed<std::int32_t>(*this, DType::I32); }
double* Tensor::f64() const { return typed<double>(*this, DType::F64); }

}  // namespace nanoq
