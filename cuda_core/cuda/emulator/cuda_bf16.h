// __nv_bfloat16 for the CPU emulator, with CUDA's conversions: from float
// rounding to nearest even (NaN becomes the canonical 0x7fff, infinities and
// overflow to infinity follow from the rounding), to float exactly.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16_raw {
    unsigned short x;
};

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(__nv_bfloat16_raw raw) : __x(raw.x) {}
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};
typedef __nv_bfloat16 nv_bfloat16;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16(__nv_bfloat16_raw{bits}); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 value) { return value.__x; }

inline float __bfloat162float(__nv_bfloat16 value) {
    const std::uint32_t bits = static_cast<std::uint32_t>(value.__x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline __nv_bfloat16 __float2bfloat16_rn(float value) {
    std::uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);  // NaN
    const std::uint32_t rest = bits & 0xffffu;
    std::uint32_t upper = bits >> 16;
    if (rest > 0x8000u || (rest == 0x8000u && (upper & 1u))) ++upper;
    return __ushort_as_bfloat16(static_cast<unsigned short>(upper));
}
inline __nv_bfloat16 __float2bfloat16(float value) { return __float2bfloat16_rn(value); }
// Round toward zero: truncation (NaN stays NaN).
inline __nv_bfloat16 __float2bfloat16_rz(float value) {
    std::uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);
    return __ushort_as_bfloat16(static_cast<unsigned short>(bits >> 16));
}
