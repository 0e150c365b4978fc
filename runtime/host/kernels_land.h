// The landing: a downloaded gradient written into its fp32 or bf16 host buffer (a first write, or a sum with the
// earlier rounds'), divided where the data-parallel average asks, with its statistics in the same pass (kernels.cpp's
// `land` and `land_bf16`). Included by kernels.cpp after kernels_common.h.
#pragma once
#include "kernels_common.h"

// ---- land: write the gradient, with its statistics -------------------------------------------------
// finite_squares: a block's sum of squares, in double, is finite exactly when every value is. A float32's square
// is at most 2^256 and at least 2^-298 (exact in double), and a block of 2^16 of them sums to at most 2^272, far
// from double's overflow; an inf or NaN makes the sum inf or NaN (squares are never negative: no inf - inf). So
// the non-finite flag costs no work per element.
// A first landing (no sum, no division) of a large gradient writes it around the cache: an update reads it much later
// (a bf16 gradient's: the copy of a bf16 one).
// Its statistics then add the squares in another order (the AVX-512 loop's), fixed by the element offsets and dst's
// alignment, which the same buffers keep from run to run.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RP_STREAMED_LANDING 1
namespace v512 {  // kernels_avx512.h, included below
template <typename S, typename D> int64_t land_stream(const S* src, D* dst, int64_t lo, int64_t hi, double* s);
}
#else
#define RP_STREAMED_LANDING 0
#endif
namespace {

// The statistics of a landing: each block's sum of squares and whether it is finite (see finite_squares), set by the
// block's thread, then added in block order (the same sum on any number of threads).
struct BlockSums {
    std::vector<double> part;
    std::vector<int> nonfinite;
    explicit BlockSums(int64_t nb) : part(nb), nonfinite(nb) {}
    void set(int64_t b, double s) {
        part[b] = s;
        nonfinite[b] = !std::isfinite(s);  // see finite_squares
    }
    void total(double* sumsq, int* bad) const {
        double s = 0.0;
        int f = 0;
        for (size_t b = 0; b < part.size(); ++b) {
            s += part[b];
            f |= nonfinite[b];
        }
        *sumsq = s;
        *bad = f;
    }
};

template <typename S, bool ADD, bool DIV>
void land_t(float* dst, const S* src, int64_t n, int threads, float divisor, double* sumsq, int* bad) {
    BlockSums sums(blocks(n));
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
        sums.set(b, s);
    });
    sums.total(sumsq, bad);
}

template <typename S, bool ADD, bool DIV>
void land_bf16_t(bf16* dst, const S* src, int64_t n, int threads, float divisor, uint32_t key, uint64_t offset,
                 double* sumsq, int* bad) {
    BlockSums sums(blocks(n));
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
        sums.set(b, s);
    });
    sums.total(sumsq, bad);
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

}  // namespace
