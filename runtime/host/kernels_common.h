// The scalar helpers every kernel uses (kernels.cpp includes this first): the work blocks and their OpenMP loop,
// the dtypes (bf16 and f16 bits) and their conversions with c10's arithmetic, the rounding hash and the stochastic
// rounding, and the size from which a buffer written whole is streamed.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 1 << 16;  // elements per OpenMP work item (handed out dynamically: a loaded
                                    // machine stalls no thread at a barrier) and per partial sum (fixed: the
                                    // statistics do not depend on the thread count)

// A buffer written whole this large (a compute copy, a gradient's first landing) is written around the cache
// (non-temporal stores, with AVX-512): a smaller one likely stays in the cache for what reads it next (the uploads, the
// update), where streaming would send it to memory.
constexpr int64_t STREAM_MIN_BYTES = int64_t{1} << 20;

using bf16 = uint16_t;
struct f16 {  // IEEE half bits; converted with c10's branch-free bit arithmetic, which vectorizes (GCC
    uint16_t bits;  // converts a _Float16 one value at a time, through libgcc, when the CPU lacks AVX512-FP16)
};

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <> inline float to_float<bf16>(bf16 x) { return bits_to_float(static_cast<uint32_t>(x) << 16); }

template <> inline float to_float<f16>(f16 x) {  // c10::detail::fp16_ieee_to_fp32_value
    const uint32_t w = static_cast<uint32_t>(x.bits) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_to_float(sign | (two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized)));
}

template <typename T> inline T from_float(float x) { return static_cast<T>(x); }
template <> inline f16 from_float<f16>(float x) {  // c10::detail::fp16_ieee_from_fp32_value (round to nearest even)
    float base = (std::fabs(x) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = float_to_bits(x);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t bias = (shl1_w & 0xFF000000u) < 0x71000000u ? 0x71000000u : (shl1_w & 0xFF000000u);
    base = bits_to_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return f16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}
template <> inline bf16 from_float<bf16>(float x) {  // c10::BFloat16's round_to_nearest_even
    uint32_t u = float_to_bits(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? bf16(0x7FC0) : static_cast<bf16>(rounded);
}

inline uint32_t hash32(uint32_t x) {  // Wellons' lowbias32 (runtime/host/lean.py's hash32)
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

inline bf16 round_stochastic(float x, uint32_t r16) {  // add r16 below the kept bits, cut them; NaN stays NaN
    const uint32_t u = float_to_bits(x);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? bf16(0x7FC0) : static_cast<bf16>((u + r16) >> 16);
}

struct NoOut {};  // out_kind 0: the update writes no compute copy
template <typename O> inline void store(O* out, int64_t i, float x) { out[i] = from_float<O>(x); }
template <> inline void store<NoOut>(NoOut*, int64_t, float) {}

inline int64_t blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

// A body's loop must read its pointers and scalars from locals (or a by-value capture), not through a
// reference capture: GCC does not hoist a load from the closure past the loop's stores, so it would
// not vectorize the loop (-fopt-info-vec-missed: "no vectype for stmt: ... __closure->...").
template <typename Body>
void for_blocks(int64_t n, int threads, Body body) {  // body(block, lo, hi) for each BLOCK, in parallel
    const int64_t nb = blocks(n);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (nb > 1)
    for (int64_t b = 0; b < nb; ++b) body(b, b * BLOCK, b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n);
}

}  // namespace
