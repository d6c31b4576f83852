// cuda_bf16.h (gpt2np CUDA emulator): __nv_bfloat16 as a storage type, with the two conversions the
// kernels use (kernels/common.cuh switches bf16's C++ operators and implicit conversions off on the GPU too):
//   __float2bfloat16_rn(float): round to nearest even; NaN -> the canonical NaN 0x7FFF (as the GPU's
//                               cvt.rn.bf16.f32); +-inf and overflow to inf as IEEE rounding gives
//   __bfloat162float(bf16):     exact (the 16 bits become fp32's top half)
// plus __float2bfloat16 (the same rounding), and CUDA's bit casts __ushort_as_bfloat16 / __bfloat16_as_ushort
// (the 16 bits as they are: how a kernel stores a rounding it made itself, e.g. AdamW's stochastic rounding).
// Neither arithmetic nor comparison operators are defined: code that would compute in bf16 does not compile.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    unsigned short __x;
};
typedef __nv_bfloat16 nv_bfloat16;

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 out;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        out.__x = 0x7FFFu;                              // NaN
        return out;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);                    // ties to even; carries into the exponent (to inf)
    out.__x = (unsigned short)(u >> 16);
    return out;
}

inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.__x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
    __nv_bfloat16 out;
    out.__x = bits;
    return out;
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
