// The updates: torch.optim.AdamW in fp32 (`adamw_t`), the same update with bf16 moments, a bf16 master or a bf16
// gradient (`adamw_lean_t`, with its AVX-512 loop in kernels_avx512.h), and torch.optim.SGD (`sgd_t`), each one pass
// over memory. Included by kernels.cpp after kernels_land.h.
#pragma once
#include "kernels_common.h"

namespace {

// ---- adamw: torch.optim.AdamW (single tensor), one pass --------------------------------------------
struct AdamArgs {
    float factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
};

template <typename O, bool SCALE>
void adamw_t(float* p, const float* g, float* m, float* v, O* out, int64_t n, int threads, AdamArgs args) {
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
        const AdamArgs a = args;  // a local copy: the loop vectorizes (see for_blocks)
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) {
            const float gi = SCALE ? g[i] * a.factor : g[i];        // unscale and clip (one factor)
            float pi = p[i] * a.decay;                               // param.mul_(1 - lr * wd)
            const float mi = std::fma(a.w1, gi - m[i], m[i]);        // exp_avg.lerp_(grad, 1 - beta1)
            const float vi = std::fma(a.w2 * gi, gi, v[i] * a.beta2);  // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
            const float denom = std::sqrt(vi) / a.bc2_sqrt + a.eps;  // (v.sqrt() / bc2_sqrt).add_(eps)
            pi = pi + a.neg_step * mi / denom;                       // param.addcdiv_(m, denom, -step_size)
            m[i] = mi;
            v[i] = vi;
            p[i] = pi;
            store(out, i, pi);
        }
    });
}

// ---- adamw with bf16 moments and/or a bf16 master: the same float32 update, bf16 values rounded stochastically
template <typename T> inline T keep(float x, uint32_t r16);  // a lean value's store: fp32 as is, bf16 rounded
template <> inline float keep<float>(float x, uint32_t) { return x; }
template <> inline bf16 keep<bf16>(float x, uint32_t r16) { return round_stochastic(x, r16); }

// A bf16 master's 16 random bits from the element's hash r (runtime/host/lean.py's master_bits): the xor of its halves
// (which round the moments), so each pair of the three draws is independent; ^ 0x8000 maps r = 0x80008000 (every
// draw one half: round to nearest, ties away) to one half too.
inline uint32_t master_bits(uint32_t r) { return ((r ^ (r >> 16)) ^ 0x8000u) & 0xFFFFu; }
template <typename P> inline uint32_t master_draw(uint32_t r) {  // fp32 master: none drawn
    return std::is_same<P, bf16>::value ? master_bits(r) : 0u;
}

// A split master (SPLIT: an exact fp32 master stored as two 16-bit halves, AReno's): hi, its bf16 copy rounded to
// nearest with ties away from zero, and lo, the 16 bits that make it whole again: value bits = (hi << 16) + lo, lo
// read as a signed 16-bit number. hi = (u + 0x8000) >> 16 and lo = the low 16 bits of u; a NaN is stored as the
// canonical one (0x7FC00000, as the roundings store it), so u + 0x8000 never wraps.
inline float split_value(bf16 hi, uint16_t lo) {
    return bits_to_float((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int16_t>(lo)));
}
inline uint32_t split_bits(float x) {  // x's bits, a NaN the canonical one
    const uint32_t u = float_to_bits(x);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : u;
}
inline bf16 split_hi(uint32_t u) { return static_cast<bf16>((u + 0x8000u) >> 16); }

}  // namespace
#include "kernels_avx512.h"  // v512::adamw_lean: the loop below in AVX-512 intrinsics, where the CPU has them
namespace {

// SPLIT: P is bf16 (the masters' hi halves, read from src and written to p) and `low` their lo halves (in place).
template <typename O, bool SCALE, typename S, typename P, typename G, bool SPLIT = false>
void adamw_lean_t(const P* src, P* p, const G* g, S* m, S* v, O* out, int64_t n, int threads, AdamArgs args,
                  uint32_t key, uint64_t offset, uint16_t* low = nullptr) {
    // the buffer this update only writes, streamed when large: the bf16 copy, else a bf16 master written out of place
    const bool large = n * 2 >= STREAM_MIN_BYTES;
    [[maybe_unused]] const bool stream_copy = std::is_same<O, bf16>::value && large;
    [[maybe_unused]] const bool stream_master = std::is_same<O, NoOut>::value && std::is_same<P, bf16>::value &&
                                                static_cast<const void*>(src) != static_cast<const void*>(p) && large;
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
        const AdamArgs a = args;  // a local copy: the loop vectorizes (see for_blocks)
        const uint32_t k = key;
        const uint32_t base = static_cast<uint32_t>(offset);  // the element's offset mod 2^32
        auto scalar = [=](int64_t from, int64_t to) {  // the update of [from, to), element by element
#pragma omp simd
            for (int64_t i = from; i < to; ++i) {
                const float gi = SCALE ? to_float(g[i]) * a.factor : to_float(g[i]);
                const float m0 = to_float(m[i]), v0 = to_float(v[i]);
                float pi;
                if constexpr (SPLIT) pi = split_value(src[i], low[i]) * a.decay;
                else pi = to_float(src[i]) * a.decay;
                const float mi = std::fma(a.w1, gi - m0, m0);
                const float vi = std::fma(a.w2 * gi, gi, v0 * a.beta2);
                const float denom = std::sqrt(vi) / a.bc2_sqrt + a.eps;
                pi = pi + a.neg_step * mi / denom;
                const uint32_t at = base + static_cast<uint32_t>(i);
                constexpr bool drawn = std::is_same<S, bf16>::value || (std::is_same<P, bf16>::value && !SPLIT);
                const uint32_t r = drawn ? hash32(at ^ k) : 0u;
                m[i] = keep<S>(mi, r & 0xFFFFu);
                v[i] = keep<S>(vi, r >> 16);
                if constexpr (SPLIT) {
                    const uint32_t u = split_bits(pi);
                    const bf16 h = split_hi(u);
                    p[i] = h;
                    low[i] = static_cast<uint16_t>(u);
                    if constexpr (std::is_same<O, bf16>::value) out[i] = h;  // the bf16 copy is hi itself
                    else store(out, i, bits_to_float(u));
                } else {
                    const P stored = keep<P>(pi, master_draw<P>(r));
                    p[i] = stored;
                    store(out, i, to_float(stored));
                }
            }
        };
#if RP_AVX512
        auto aligned = [=](const void* buf, int64_t lo, int64_t hi) {  // up to buf's first 64-byte boundary here
            int64_t at = lo;
            while (at < hi && (reinterpret_cast<uintptr_t>(static_cast<const bf16*>(buf) + at) & 63) != 0) ++at;
            scalar(lo, at);
            return at;
        };
        if constexpr (std::is_same<O, bf16>::value) {  // then the AVX-512 loop, streaming from there
            if (stream_copy) lo = v512::adamw_lean<O, SCALE, v512::STREAM_COPY, SPLIT>(
                src, p, g, m, v, out, aligned(out, lo, hi), hi, a, k, base, low);
        }
        if constexpr (std::is_same<O, NoOut>::value && std::is_same<P, bf16>::value) {
            if (stream_master) lo = v512::adamw_lean<O, SCALE, v512::STREAM_MASTER, SPLIT>(
                src, p, g, m, v, out, aligned(p, lo, hi), hi, a, k, base, low);
        }
        if constexpr (!std::is_same<O, f16>::value) {  // the AVX-512 loop, then the scalar one for the last < 32
            if (!stream_copy && !stream_master) {
                lo = v512::adamw_lean<O, SCALE, v512::CACHED, SPLIT>(src, p, g, m, v, out, lo, hi, a, k, base, low);
            }
        }
#endif
        scalar(lo, hi);
    });
}

// ---- sgd: torch.optim.SGD (single tensor), one pass ------------------------------------------------
struct SgdArgs {
    float factor, wd, momentum, damp, neg_lr;
    bool nesterov, first, has_momentum;
};

template <typename O, typename P, typename G>
void sgd_t(const P* src, P* p, const G* g, float* buf, O* out, int64_t n, int threads, SgdArgs args, uint32_t key,
           uint64_t offset) {
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
        const SgdArgs a = args;  // a local copy: the loop vectorizes (see for_blocks)
        const uint32_t k = key, base = static_cast<uint32_t>(offset);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) {
            float gi = a.factor != 1.0f ? to_float(g[i]) * a.factor : to_float(g[i]);
            float pi = to_float(src[i]);
            if (a.wd != 0.0f) gi = std::fma(pi, a.wd, gi);             // grad.add(param, alpha=wd)
            if (a.has_momentum) {
                const float bi = a.first ? gi : std::fma(gi, a.damp, buf[i] * a.momentum);  // buf.mul_(mom).add_(g)
                buf[i] = bi;
                gi = a.nesterov ? std::fma(bi, a.momentum, gi) : bi;    // grad.add(buf, alpha=momentum)
            }
            pi = std::fma(gi, a.neg_lr, pi);                            // param.add_(grad, alpha=-lr)
            const uint32_t r = std::is_same<P, bf16>::value ? hash32((base + static_cast<uint32_t>(i)) ^ k) : 0u;
            const P stored = keep<P>(pi, master_draw<P>(r));
            p[i] = stored;
            store(out, i, to_float(stored));
        }
    });
}

}  // namespace
