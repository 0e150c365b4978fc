// The host optimizer's memory-speed kernels (runtime/host/kernels.py builds and loads this file).
//
// A plain CPython module (no torch headers: it builds in seconds) whose functions take raw
// pointers of contiguous CPU tensors that the Python side has checked, release the GIL and run
// OpenMP loops over fixed blocks. Every value is computed with the float operations of torch's
// eager CPU kernels, in their order (FMA where ATen's vectorised kernels use `vec::fmadd`: lerp,
// addcmul and `add(alpha=)`); the build passes -ffp-contract=off so the compiler adds no other FMA.
//
//   land(dst, src, src_kind, n, add, threads, divisor) -> (sum of squares, non-finite)
//       dst[i] = ((add ? dst[i] : 0) + float(src[i])) / divisor (no division when divisor is 1);
//       statistics of the result, in the same pass. dst == src: in place (data parallel: the average). A first
//       landing (no sum, no division) of 1 MiB or more with non-temporal stores (the squares in that loop's order).
//   land_bf16(dst, src, src_kind, n, add, threads, divisor, key, offset) -> (sum of squares, non-finite)
//       the same into a bf16 dst (`grad_dtype=torch.bfloat16`): the sum and division in float32, stored rounded
//       stochastically with the low 16 bits of hash32((offset + i) mod 2^32 ^ key) (a bf16 src written alone is
//       copied: exact, the bits rounding would give, NaNs as they are; 1 MiB or more with non-temporal stores);
//       statistics of the stored values.
//   adamw(p, g, m, v, out, out_kind, n, threads, factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt)
//       torch.optim.AdamW's single-tensor update of p, m, v with g * factor; out = cast(new p) (a bf16 out of
//       1 MiB or more with non-temporal stores, as cast's).
//   adamw_lean(p, g, m, v, out, out_kind, n, threads, factor, ..., bc2_sqrt, key, offset, lean, src)
//       the same update with bf16 m, v (lean bit 1), a bf16 master p (bit 2) and/or a bf16 gradient g (bit 4;
//       read and widened) (runtime/host/lean.py); the master is read from src (0: p itself) and written to p (a
//       bf16 master out of place: the alternating copies of runtime/host/layout.py): read and widened, the
//       update in float32, stored rounded stochastically with the bits of r = hash32((offset + i) mod 2^32 ^ key):
//       low 16 for m, high 16 for v, and master_bits(r) = (low 16 ^ high 16 ^ 0x8000) for p (pairwise independent
//       of each, so one hash serves all three); out = cast(the stored p). A bf16 out of 1 MiB or more, else (no
//       out) a bf16 p written out of place, with non-temporal stores.
//   sgd(p, g, buf, out, out_kind, n, threads, factor, wd, momentum, damp, nesterov, first, neg_lr, key, offset,
//       p_kind, g_kind, src)
//       torch.optim.SGD's update (buf = 0 for no momentum) of an fp32 or a bf16 master p (rounded as above) with
//       an fp32 or bf16 gradient g, the master read from src (0: p itself);
//       out = cast(the stored p).
//   cast(src, out, out_kind, n, threads, bf16_src=0)
//       out = cast(src): fp32 -> fp32, bf16 or fp16, round to nearest even (as Tensor.to), or bf16 -> bf16 (a copy);
//       a bf16 out of 1 MiB or more with non-temporal stores (written around the cache: not read first).
//
// Kinds: 0 none (no output), 1 float32, 2 bfloat16, 3 float16.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

// ---- land: write the gradient, with its statistics -------------------------------------------------
// finite_squares: a block's sum of squares, in double, is finite exactly when every value is. A float32's square
// is at most 2^256 and at least 2^-298 (exact in double), and a block of 2^16 of them sums to at most 2^272, far
// from double's overflow; an inf or NaN makes the sum inf or NaN (squares are never negative: no inf - inf). So
// the non-finite flag costs no work per element.
// A first landing (no sum, no division) of a large gradient writes it around the cache: an update reads it much later
// (a bf16 gradient's: the copy of a bf16 one).
// Its statistics then add the squares in another order (the AVX-512 loop's), fixed by the element offsets and dst's
// alignment, which the same buffers keep from run to run.
}  // namespace
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RP_STREAMED_LANDING 1
namespace v512 {  // kernels_avx512.h, included below
template <typename S, typename D> int64_t land_stream(const S* src, D* dst, int64_t lo, int64_t hi, double* s);
}
#else
#define RP_STREAMED_LANDING 0
#endif
namespace {

template <typename S, bool ADD, bool DIV>
void land_t(float* dst, const S* src, int64_t n, int threads, float divisor, double* sumsq, int* bad) {
    const int64_t nb = blocks(n);
    std::vector<double> part(nb);
    std::vector<int> nonfinite(nb);
    [[maybe_unused]] const bool stream = !ADD && !DIV && !std::is_same<S, f16>::value && n * 4 >= STREAM_MIN_BYTES;
    for_blocks(n, threads, [&](int64_t b, int64_t lo, int64_t hi) {
        float* const d = dst;  // locals, not the closure's references: the loop vectorizes (see for_blocks)
        const S* const in = src;
        const float div = divisor;
        double s = 0.0;
#if RP_STREAMED_LANDING
        if constexpr (!ADD && !DIV && !std::is_same<S, f16>::value) {
            if (stream) lo = v512::land_stream(in, d, lo, hi, &s);  // then this loop for the tail
        }
#endif
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) {
            const float y = ADD ? d[i] + to_float(in[i]) : to_float(in[i]);
            const float x = DIV ? y / div : y;  // Tensor.div_
            d[i] = x;
            s += static_cast<double>(x) * static_cast<double>(x);
        }
        part[b] = s;
        nonfinite[b] = !std::isfinite(s);  // see finite_squares
    });
    double s = 0.0;
    int f = 0;
    for (int64_t b = 0; b < nb; ++b) {
        s += part[b];
        f |= nonfinite[b];
    }
    *sumsq = s;
    *bad = f;
}

template <typename S, bool ADD, bool DIV>
void land_bf16_t(bf16* dst, const S* src, int64_t n, int threads, float divisor, uint32_t key, uint64_t offset,
                 double* sumsq, int* bad) {
    const int64_t nb = blocks(n);
    std::vector<double> part(nb);
    std::vector<int> nonfinite(nb);
    [[maybe_unused]] const bool stream = n * 2 >= STREAM_MIN_BYTES;  // a large copy (below) streams
    for_blocks(n, threads, [&](int64_t b, int64_t lo, int64_t hi) {
        bf16* const d = dst;  // locals, not the closure's references: the loop vectorizes (see for_blocks)
        const S* const in = src;
        const float div = divisor;
        const uint32_t k = key, base = static_cast<uint32_t>(offset);
        constexpr bool copy = std::is_same<S, bf16>::value && !ADD && !DIV;  // exact: the bits rounding would give
        double s = 0.0;
#if RP_STREAMED_LANDING
        if constexpr (copy) {
            if (stream) lo = v512::land_stream(in, d, lo, hi, &s);  // then the loop below for the tail
        }
#endif
        if constexpr (!copy) {
#pragma omp simd
            for (int64_t i = lo; i < hi; ++i) {
                const float y = ADD ? to_float(d[i]) + to_float(in[i]) : to_float(in[i]);
                const float x = DIV ? y / div : y;
                d[i] = round_stochastic(x, hash32((base + static_cast<uint32_t>(i)) ^ k) & 0xFFFFu);
            }
        }
        // the statistics of the stored block, still in the cache (GCC does not vectorize the rounding and this
        // reduction as one loop); a copy's in the copying loop
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) {
            if constexpr (copy) d[i] = in[i];
            const float z = to_float(d[i]);
            s += static_cast<double>(z) * static_cast<double>(z);
        }
        part[b] = s;
        nonfinite[b] = !std::isfinite(s);  // see finite_squares
    });
    double s = 0.0;
    int f = 0;
    for (int64_t b = 0; b < nb; ++b) {
        s += part[b];
        f |= nonfinite[b];
    }
    *sumsq = s;
    *bad = f;
}

template <typename S>
void land_bf16_s(bf16* dst, const void* src, int64_t n, bool add, int threads, float divisor, uint32_t key,
                 uint64_t off, double* s, int* f) {
    auto in = static_cast<const S*>(src);
    if (divisor != 1.0f) {
        add ? land_bf16_t<S, true, true>(dst, in, n, threads, divisor, key, off, s, f)
            : land_bf16_t<S, false, true>(dst, in, n, threads, divisor, key, off, s, f);
    } else {
        add ? land_bf16_t<S, true, false>(dst, in, n, threads, divisor, key, off, s, f)
            : land_bf16_t<S, false, false>(dst, in, n, threads, divisor, key, off, s, f);
    }
}

template <typename S>
void land_s(float* dst, const void* src, int64_t n, bool add, int threads, float divisor, double* s, int* f) {
    auto in = static_cast<const S*>(src);
    if (divisor != 1.0f) {
        add ? land_t<S, true, true>(dst, in, n, threads, divisor, s, f)
            : land_t<S, false, true>(dst, in, n, threads, divisor, s, f);
    } else {
        add ? land_t<S, true, false>(dst, in, n, threads, divisor, s, f)
            : land_t<S, false, false>(dst, in, n, threads, divisor, s, f);
    }
}

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

}  // namespace
#include "kernels_avx512.h"  // v512::adamw_lean: the loop below in AVX-512 intrinsics, where the CPU has them
namespace {

template <typename O, bool SCALE, typename S, typename P, typename G>
void adamw_lean_t(const P* src, P* p, const G* g, S* m, S* v, O* out, int64_t n, int threads, AdamArgs args,
                  uint32_t key, uint64_t offset) {
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
                float pi = to_float(src[i]) * a.decay;
                const float mi = std::fma(a.w1, gi - m0, m0);
                const float vi = std::fma(a.w2 * gi, gi, v0 * a.beta2);
                const float denom = std::sqrt(vi) / a.bc2_sqrt + a.eps;
                pi = pi + a.neg_step * mi / denom;
                const uint32_t at = base + static_cast<uint32_t>(i);
                constexpr bool drawn = std::is_same<S, bf16>::value || std::is_same<P, bf16>::value;
                const uint32_t r = drawn ? hash32(at ^ k) : 0u;
                m[i] = keep<S>(mi, r & 0xFFFFu);
                v[i] = keep<S>(vi, r >> 16);
                const P stored = keep<P>(pi, master_draw<P>(r));
                p[i] = stored;
                store(out, i, to_float(stored));
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
            if (stream_copy) lo = v512::adamw_lean<O, SCALE, v512::STREAM_COPY>(src, p, g, m, v, out,
                                                                                aligned(out, lo, hi), hi, a, k, base);
        }
        if constexpr (std::is_same<O, NoOut>::value && std::is_same<P, bf16>::value) {
            if (stream_master) lo = v512::adamw_lean<O, SCALE, v512::STREAM_MASTER>(src, p, g, m, v, out,
                                                                                    aligned(p, lo, hi), hi, a, k, base);
        }
        if constexpr (!std::is_same<O, f16>::value) {  // the AVX-512 loop, then the scalar one for the last < 32
            if (!stream_copy && !stream_master) {
                lo = v512::adamw_lean<O, SCALE, v512::CACHED>(src, p, g, m, v, out, lo, hi, a, k, base);
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

// ---- cast: the compute copy ------------------------------------------------------------------------

template <typename O>
void cast_t(const float* src, O* out, int64_t n, int threads) {
    const bool stream = std::is_same<O, bf16>::value && n * 2 >= STREAM_MIN_BYTES;
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
#if RP_AVX512
        if constexpr (std::is_same<O, bf16>::value) {
            if (stream) lo = v512::stream_bf16(src, out, lo, hi);  // the intrinsics' loop, then this one for the tail
        }
#endif
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) out[i] = from_float<O>(src[i]);
    });
}

void copy_t(const bf16* src, bf16* out, int64_t n, int threads) {  // a bf16 master's compute copy
    const bool stream = n * 2 >= STREAM_MIN_BYTES;
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
#if RP_AVX512
        if (stream) lo = v512::stream_bf16(src, out, lo, hi);
#endif
        std::memcpy(out + lo, src + lo, static_cast<size_t>(hi - lo) * 2);
    });
}

template <template <typename> class F, typename... Args>
bool by_kind(int kind, void* out, Args... args) {  // dispatch on the output kind; false if unknown
    switch (kind) {
        case 0: F<NoOut>::run(static_cast<NoOut*>(out), args...); return true;
        case 1: F<float>::run(static_cast<float*>(out), args...); return true;
        case 2: F<bf16>::run(static_cast<bf16*>(out), args...); return true;
        case 3: F<f16>::run(static_cast<f16*>(out), args...); return true;
        default: return false;
    }
}

template <typename O> struct AdamF {
    static void run(O* out, float* p, const float* g, float* m, float* v, int64_t n, int t, AdamArgs a) {
        if (RP_AVX512 && std::is_same<O, bf16>::value && n * 2 >= STREAM_MIN_BYTES) {  // the lean loop with fp32
            // values (the same operations, so the same bits), for its streamed copy
            a.factor != 1.0f ? adamw_lean_t<O, true, float, float, float>(p, p, g, m, v, out, n, t, a, 0, 0)
                             : adamw_lean_t<O, false, float, float, float>(p, p, g, m, v, out, n, t, a, 0, 0);
            return;
        }
        a.factor != 1.0f ? adamw_t<O, true>(p, g, m, v, out, n, t, a) : adamw_t<O, false>(p, g, m, v, out, n, t, a);
    }
};
template <typename O, typename S, typename P, typename G>
void adamw_lean_s(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                  uint32_t key, uint64_t off) {
    auto ps = static_cast<const P*>(src);
    auto pp = static_cast<P*>(p);
    auto gg = static_cast<const G*>(g);
    auto mm = static_cast<S*>(m), vv = static_cast<S*>(v);
    a.factor != 1.0f ? adamw_lean_t<O, true, S, P, G>(ps, pp, gg, mm, vv, out, n, t, a, key, off)
                     : adamw_lean_t<O, false, S, P, G>(ps, pp, gg, mm, vv, out, n, t, a, key, off);
}
template <typename O, typename S, typename P>
void adamw_lean_g(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                  uint32_t key, uint64_t off, bool bf16_grad) {
    bf16_grad ? adamw_lean_s<O, S, P, bf16>(out, src, p, g, m, v, n, t, a, key, off)
              : adamw_lean_s<O, S, P, float>(out, src, p, g, m, v, n, t, a, key, off);
}
template <typename O> struct AdamLeanF {  // lean: bits 1 bf16 moments, 2 a bf16 master, 4 a bf16 gradient (1..7)
    static void run(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                    uint32_t key, uint64_t off, int lean) {
        const bool bg = lean & 4;
        switch (lean & 3) {
            case 0: adamw_lean_g<O, float, float>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            case 1: adamw_lean_g<O, bf16, float>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            case 2: adamw_lean_g<O, float, bf16>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            default: adamw_lean_g<O, bf16, bf16>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
        }
    }
};
template <typename O, typename P>
void sgd_g(O* out, const void* src, void* p, const void* g, float* buf, int64_t n, int t, SgdArgs a, uint32_t key,
           uint64_t off, bool bf16_grad) {
    auto ps = static_cast<const P*>(src);
    bf16_grad ? sgd_t<O, P, bf16>(ps, static_cast<P*>(p), static_cast<const bf16*>(g), buf, out, n, t, a, key, off)
              : sgd_t<O, P, float>(ps, static_cast<P*>(p), static_cast<const float*>(g), buf, out, n, t, a, key, off);
}
template <typename O> struct SgdF {
    static void run(O* out, const void* src, void* p, const void* g, float* buf, int64_t n, int t, SgdArgs a,
                    uint32_t key, uint64_t off, bool bf16_master, bool bf16_grad) {
        bf16_master ? sgd_g<O, bf16>(out, src, p, g, buf, n, t, a, key, off, bf16_grad)
                    : sgd_g<O, float>(out, src, p, g, buf, n, t, a, key, off, bf16_grad);
    }
};
template <typename O> struct CastF {
    static void run(O* out, const float* src, int64_t n, int t) { cast_t<O>(src, out, n, t); }
};
template <> struct CastF<NoOut> {
    static void run(NoOut*, const float*, int64_t, int) {}
};

PyObject* bad_kind(int kind) {
    PyErr_Format(PyExc_ValueError, "unknown dtype kind %d", kind);
    return nullptr;
}

template <template <typename> class F, typename... Args>
PyObject* released(int kind, unsigned long long out, Args... args) {  // by_kind without the GIL; None or an error
    bool ok;
    Py_BEGIN_ALLOW_THREADS
    ok = by_kind<F>(kind, reinterpret_cast<void*>(out), args...);
    Py_END_ALLOW_THREADS
    if (!ok) return bad_kind(kind);
    Py_RETURN_NONE;
}

PyObject* land(PyObject*, PyObject* args) {
    unsigned long long dst, src;
    int kind, add, threads;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "KKiLpid", &dst, &src, &kind, &n, &add, &threads, &divisor)) return nullptr;
    double s = 0.0;
    int f = 0;
    auto d = reinterpret_cast<float*>(dst);
    auto in = reinterpret_cast<const void*>(src);
    if (kind < 1 || kind > 3) return bad_kind(kind);
    Py_BEGIN_ALLOW_THREADS
    const float div = float(divisor);
    if (kind == 1) land_s<float>(d, in, n, add, threads, div, &s, &f);
    else if (kind == 2) land_s<bf16>(d, in, n, add, threads, div, &s, &f);
    else land_s<f16>(d, in, n, add, threads, div, &s, &f);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dO)", s, f ? Py_True : Py_False);
}

PyObject* land_bf16(PyObject*, PyObject* args) {
    unsigned long long dst, src, offset;
    unsigned int key;
    int kind, add, threads;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "KKiLpidIK", &dst, &src, &kind, &n, &add, &threads, &divisor, &key, &offset))
        return nullptr;
    double s = 0.0;
    int f = 0;
    auto d = reinterpret_cast<bf16*>(dst);
    auto in = reinterpret_cast<const void*>(src);
    if (kind < 1 || kind > 3) return bad_kind(kind);
    Py_BEGIN_ALLOW_THREADS
    const float div = float(divisor);
    const uint32_t k = key;
    const uint64_t off = offset;
    if (kind == 1) land_bf16_s<float>(d, in, n, add, threads, div, k, off, &s, &f);
    else if (kind == 2) land_bf16_s<bf16>(d, in, n, add, threads, div, k, off, &s, &f);
    else land_bf16_s<f16>(d, in, n, add, threads, div, k, off, &s, &f);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dO)", s, f ? Py_True : Py_False);
}

PyObject* adamw(PyObject*, PyObject* args) {
    unsigned long long p, g, m, v, out;
    int kind, threads;
    long long n;
    double factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
    if (!PyArg_ParseTuple(args, "KKKKKiLidddddddd", &p, &g, &m, &v, &out, &kind, &n, &threads, &factor, &decay,
                          &w1, &beta2, &w2, &eps, &neg_step, &bc2_sqrt))
        return nullptr;
    // each double becomes a float, as torch turns a Python scalar into the tensor's dtype
    AdamArgs a{float(factor), float(decay), float(w1), float(beta2), float(w2), float(eps), float(neg_step),
               float(bc2_sqrt)};
    return released<AdamF>(kind, out, reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g),
                           reinterpret_cast<float*>(m), reinterpret_cast<float*>(v), int64_t(n), threads, a);
}

PyObject* adamw_lean(PyObject*, PyObject* args) {
    unsigned long long p, g, m, v, out, offset, src = 0;
    unsigned int key;
    int kind, threads, lean;
    long long n;
    double factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
    if (!PyArg_ParseTuple(args, "KKKKKiLiddddddddIKi|K", &p, &g, &m, &v, &out, &kind, &n, &threads, &factor, &decay,
                          &w1, &beta2, &w2, &eps, &neg_step, &bc2_sqrt, &key, &offset, &lean, &src))
        return nullptr;
    if (lean < 0 || lean > 7 || (lean == 0 && src == 0)) {
        PyErr_Format(PyExc_ValueError, "adamw_lean: unknown lean mode %d", lean);
        return nullptr;
    }
    AdamArgs a{float(factor), float(decay), float(w1), float(beta2), float(w2), float(eps), float(neg_step),
               float(bc2_sqrt)};
    return released<AdamLeanF>(kind, out, reinterpret_cast<const void*>(src ? src : p), reinterpret_cast<void*>(p),
                               reinterpret_cast<const void*>(g),
                               reinterpret_cast<void*>(m), reinterpret_cast<void*>(v), int64_t(n), threads, a,
                               uint32_t(key), uint64_t(offset), lean);
}

PyObject* sgd(PyObject*, PyObject* args) {
    unsigned long long p, g, buf, out, offset, src = 0;
    unsigned int key;
    int kind, threads, nesterov, first, has_momentum, bf16_master, bf16_grad;
    long long n;
    double factor, wd, momentum, damp, neg_lr;
    if (!PyArg_ParseTuple(args, "KKKKiLidddddpppIKpp|K", &p, &g, &buf, &out, &kind, &n, &threads, &factor, &wd,
                          &momentum, &damp, &neg_lr, &nesterov, &first, &has_momentum, &key, &offset, &bf16_master,
                          &bf16_grad, &src))
        return nullptr;
    SgdArgs a{float(factor), float(wd), float(momentum), float(damp), float(neg_lr), bool(nesterov), bool(first),
              bool(has_momentum)};
    return released<SgdF>(kind, out, reinterpret_cast<const void*>(src ? src : p), reinterpret_cast<void*>(p),
                          reinterpret_cast<const void*>(g),
                          reinterpret_cast<float*>(buf), int64_t(n), threads, a, uint32_t(key), uint64_t(offset),
                          bool(bf16_master), bool(bf16_grad));
}

PyObject* cast(PyObject*, PyObject* args) {
    unsigned long long src, out;
    int kind, threads;
    long long n;
    int bf16_src = 0;
    if (!PyArg_ParseTuple(args, "KKiLi|i", &src, &out, &kind, &n, &threads, &bf16_src)) return nullptr;
    if (bf16_src) {  // a bf16 master into its bf16 copy
        if (kind != 2) return bad_kind(kind);
        Py_BEGIN_ALLOW_THREADS
        copy_t(reinterpret_cast<const bf16*>(src), reinterpret_cast<bf16*>(out), int64_t(n), threads);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    return released<CastF>(kind, out, reinterpret_cast<const float*>(src), int64_t(n), threads);
}

PyMethodDef methods[] = {
    {"land", land, METH_VARARGS, "land(dst, src, kind, n, add, threads, divisor) -> (sum of squares, non-finite)"},
    {"land_bf16", land_bf16, METH_VARARGS, "land_bf16(dst, src, kind, n, add, threads, divisor, key, offset) -> "
                                           "(sum of squares, non-finite)"},
    {"adamw", adamw, METH_VARARGS, "adamw(p, g, m, v, out, kind, n, threads, factor, decay, w1, beta2, w2, eps, "
                                   "neg_step, bc2_sqrt)"},
    {"adamw_lean", adamw_lean, METH_VARARGS, "adamw_lean(p, g, m, v, out, kind, n, threads, factor, decay, w1, "
                                             "beta2, w2, eps, neg_step, bc2_sqrt, key, offset, lean)"},
    {"sgd", sgd, METH_VARARGS, "sgd(p, g, buf, out, kind, n, threads, factor, wd, momentum, damp, neg_lr, "
                               "nesterov, first, has_momentum, key, offset, bf16_master, bf16_grad)"},
    {"cast", cast, METH_VARARGS, "cast(src, out, kind, n, threads, bf16_src=0)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#ifndef TORCH_EXTENSION_NAME  // torch.utils.cpp_extension defines it: the module's name
#define TORCH_EXTENSION_NAME rpcompile_host_kernels
#endif
#define RP_MODULE TORCH_EXTENSION_NAME
#define RP_CAT(a, b) a##b
#define RP_INIT(name) RP_CAT(PyInit_, name)
#define RP_STR2(x) #x
#define RP_STR(x) RP_STR2(x)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, RP_STR(RP_MODULE), "rpcompile host optimizer kernels", -1,
                                 methods};

PyMODINIT_FUNC RP_INIT(RP_MODULE)(void) { return PyModule_Create(&module_def); }
