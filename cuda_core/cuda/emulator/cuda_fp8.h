// The fp8 subset of CUDA's cuda_fp8.h for the CPU emulator: the e4m3 (OCP
// "fn": no infinities, max 448) and e5m2 (max 57344) formats, converted from
// float by rounding to nearest even, saturating to the largest finite value
// (__NV_SATFINITE) or, for e5m2 only, overflowing to infinity
// (__NV_NOSAT; e4m3 has no infinity and overflows to NaN). NaN becomes the
// format's NaN 0x7f with the sign kept. To float, exactly.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT = 0, __NV_SATFINITE = 1 };
enum __nv_fp8_interpretation_t { __NV_E4M3 = 0, __NV_E5M2 = 1 };

namespace nanoq_emu {

struct Fp8Format {
    int mantissa_bits, bias;
    double max_finite;
    bool has_infinity;
};

inline Fp8Format fp8_format(__nv_fp8_interpretation_t kind) {
    return kind == __NV_E4M3 ? Fp8Format{3, 7, 448.0, false} : Fp8Format{2, 15, 57344.0, true};
}

inline double fp8_decode(__nv_fp8_storage_t bits, __nv_fp8_interpretation_t kind) {
    const Fp8Format f = fp8_format(kind);
    const int exponent_bits = 7 - f.mantissa_bits;
    const int exponent = (bits >> f.mantissa_bits) & ((1 << exponent_bits) - 1);
    const int mantissa = bits & ((1 << f.mantissa_bits) - 1);
    const double sign = (bits & 0x80) ? -1.0 : 1.0;
    const int top = (1 << exponent_bits) - 1;
    if (kind == __NV_E4M3 && exponent == top && mantissa == (1 << f.mantissa_bits) - 1) return std::nan("");
    if (kind == __NV_E5M2 && exponent == top) return mantissa ? std::nan("") : sign * INFINITY;
    if (exponent == 0) return sign * std::ldexp(mantissa, 1 - f.bias - f.mantissa_bits);
    return sign * std::ldexp(mantissa + (1 << f.mantissa_bits), exponent - f.bias - f.mantissa_bits);
}

inline __nv_fp8_storage_t fp8_encode(double x, __nv_saturation_t saturate, __nv_fp8_interpretation_t kind) {
    const Fp8Format f = fp8_format(kind);
    const __nv_fp8_storage_t sign = std::signbit(x) ? 0x80 : 0x00;
    const __nv_fp8_storage_t nan = sign | 0x7f;
    if (std::isnan(x)) return nan;
    const __nv_fp8_storage_t largest = sign | (kind == __NV_E4M3 ? 0x7e : 0x7b);
    const __nv_fp8_storage_t overflow = saturate == __NV_SATFINITE ? largest : f.has_infinity ? (sign | 0x7c) : nan;
    const double a = std::fabs(x);
    if (std::isinf(a)) return overflow;
    if (a == 0.0) return sign;
    const int min_exponent = 1 - f.bias;  // of the normal numbers; below it the spacing stays fixed
    const int exponent = std::max(static_cast<int>(std::floor(std::log2(a))), min_exponent);
    const double quantum = std::ldexp(1.0, exponent - f.mantissa_bits);
    const double value = std::nearbyint(a / quantum) * quantum;  // ties to even (the default rounding mode)
    if (value > f.max_finite) return overflow;
    if (value == 0.0) return sign;
    const int e = static_cast<int>(std::floor(std::log2(value)));
    if (e < min_exponent)
        return sign | static_cast<__nv_fp8_storage_t>(value / std::ldexp(1.0, min_exponent - f.mantissa_bits));
    const int mantissa = static_cast<int>(value / std::ldexp(1.0, e - f.mantissa_bits)) - (1 << f.mantissa_bits);
    return sign | static_cast<__nv_fp8_storage_t>(((e + f.bias) << f.mantissa_bits) | mantissa);
}

}  // namespace nanoq_emu

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                __nv_fp8_interpretation_t kind) {
    return nanoq_emu::fp8_encode(x, saturate, kind);
}

struct __nv_fp8_e4m3 {
    __nv_fp8_storage_t __x;
    __nv_fp8_e4m3() = default;
    explicit __nv_fp8_e4m3(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)) {}
    explicit operator float() const { return static_cast<float>(nanoq_emu::fp8_decode(__x, __NV_E4M3)); }
};

struct __nv_fp8_e5m2 {
    __nv_fp8_storage_t __x;
    __nv_fp8_e5m2() = default;
    explicit __nv_fp8_e5m2(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2)) {}
    explicit operator float() const { return static_cast<float>(nanoq_emu::fp8_decode(__x, __NV_E5M2)); }
};
