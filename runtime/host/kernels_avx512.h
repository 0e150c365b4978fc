// The lean AdamW update (kernels.cpp's adamw_lean) in AVX-512 intrinsics, 32 elements a step.
//
// Included by kernels_update.h at file scope, after the scalar helpers. GCC vectorises the scalar loop too, but not
// well for 16-bit buffers: it loads each one twice, narrows with two cross-lane moves where one permute packs 32
// values, recomputes a bf16 master's bf16 copy through a float round trip, and tests NaN with integer compares. On one
// core that made the lean update compute-bound (the divides, a hash and three roundings per element), no faster than
// the fp32 one that moves twice the bytes. Each operation here is the scalar loop's (the same IEEE float32 operations
// in the same order, FMA where it has std::fma, the same integer hash and rounding), so the bits are the scalar loop's,
// which does the tail of a block (fewer than 32 left) and everything on a CPU without AVX-512 (F and BW).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace v512 {

using V = __m512;
using I = __m512i;

inline V load(const float* x) { return _mm512_loadu_ps(x); }
inline V load(const bf16* x) {  // bf16 -> float32: the bits shifted up
    const I w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

inline I hash32(I x) {  // lowbias32, lane by lane (the scalar hash32)
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// The roundings, NaN lanes to 0x7FC0 (CHECKED) or, where the caller has seen no NaN, without that test (a float
// compare and a merge: a sixth of the work per value, and one test covers an element's three values).
template <bool CHECKED> inline I with_nan(V x, I sum_of, I addend) {  // the sum's bits, NaN lanes 0x7FC0 << 16
    if (!CHECKED) return _mm512_add_epi32(sum_of, addend);
    const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    return _mm512_mask_add_epi32(_mm512_set1_epi32(0x7FC00000), number, sum_of, addend);
}
template <bool CHECKED> inline I round_stochastic(V x, I r16) {  // the scalar round_stochastic, bf16 bits in the
    return with_nan<CHECKED>(x, _mm512_castps_si512(x), r16);   // high 16 of each lane
}
template <bool CHECKED> inline I round_nearest(V x) {  // from_float<bf16> (c10's round to nearest even), in the high 16
    const I u = _mm512_castps_si512(x);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return with_nan<CHECKED>(x, u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

// The bits a lean value is stored with: bf16 rounded stochastically (the high 16 bits of each lane; the low 16
// are left over from the rounding), fp32 as is.
template <typename T, bool CHECKED> inline I keep(V x, I r16) {
    return std::is_same<T, bf16>::value ? round_stochastic<CHECKED>(x, r16) : _mm512_castps_si512(x);
}
// 32 values into dst[i, i + 32): two vectors of bits from `keep` (bf16: their high halves, packed in order)
inline void put(float* dst, int64_t i, I a, I b) {
    _mm512_storeu_si512(dst + i, a);
    _mm512_storeu_si512(dst + i + 16, b);
}
inline I pack(I a, I b) {  // the high halves of a's and b's 16 lanes, in order: one cross-lane permute (vpmovdw: two,
    const I odd = _mm512_setr_epi32(0x30001, 0x70005, 0xB0009, 0xF000D, 0x130011, 0x170015, 0x1B0019, 0x1F001D,  // slower)
                                    0x230021, 0x270025, 0x2B0029, 0x2F002D, 0x330031, 0x370035, 0x3B0039, 0x3F003D);
    return _mm512_permutex2var_epi16(a, odd, b);
}
inline void put(bf16* dst, int64_t i, I a, I b) { _mm512_storeu_si512(dst + i, pack(a, b)); }
inline void put(NoOut*, int64_t, I, I) {}
// A bf16 buffer the update only writes (its compute copy, a bf16 master out of place): around the cache (non-temporal)
// when STREAM, which needs dst + i on a 64-byte boundary (the caller's loop aligns it), so a line written whole is not
// read first. Other buffers: `put`.
template <bool STREAM> inline void put_to(bf16* dst, int64_t i, I a, I b) {
    if (STREAM) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), pack(a, b));
    else put(dst, i, a, b);
}
template <bool STREAM, typename T> inline void put_to(T* dst, int64_t i, I a, I b) { put(dst, i, a, b); }

// The compute copy's bits from the stored master's (`keep`'s) for an output of type O.
template <typename O, typename P, bool CHECKED> inline I copy_bits(I stored) {
    if (std::is_same<P, bf16>::value) {  // a bf16 master's bits are its bf16 copy's; widened for float32
        return std::is_same<O, float>::value ? _mm512_and_si512(stored, _mm512_set1_epi32(~0xFFFF)) : stored;
    }
    return std::is_same<O, bf16>::value ? round_nearest<CHECKED>(_mm512_castsi512_ps(stored)) : stored;
}

struct Consts {  // AdamArgs broadcast, and the key
    V factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
    I key;
};
struct Update {  // 16 elements' new values in float32, and the random bits each is rounded with
    V m, v, p;
    I rm, rv, rp;
};

// A split master's 16 values from i: (hi << 16) + lo, lo sign-extended (kernels_update.h's split_value).
inline V load_split(const bf16* hi, const uint16_t* lo, int64_t i) {
    const I h = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i))),
                                  16);
    const I l = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i)));
    return _mm512_castsi512_ps(_mm512_add_epi32(h, l));
}
template <bool SPLIT, typename P> inline V load_master(const P* p, const uint16_t* low, int64_t i) {
    if constexpr (SPLIT) return load_split(p, low, i);
    else return load(p + i);
}

// Software prefetch of the lines of x[i, i + 32) + AHEAD_BYTES (one line of 16-bit values, two of 32-bit ones): a
// stream the update (or a streamed landing) reads, 2 KiB ahead of the loop in every stream. Without it one core of a
// server keeps too few of the lean loop's 16-bit lines in flight, and the lean update ran at the fp32 one's time per
// element (48M parameters on one core of a Xeon: 52 ms instead of 42 for bf16 moments), bound by memory latency
// rather than by its bytes; the fp32 update gained about 10%. A prefetch past a buffer's end is harmless (it never
// faults). No value changes.
constexpr int64_t AHEAD_BYTES = 2048;
template <typename T> inline void prefetch(const T* x, int64_t i) {
    const char* at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(x + i) + AHEAD_BYTES);  // no UB
    _mm_prefetch(at, _MM_HINT_T0);
    if constexpr (sizeof(T) == 4) _mm_prefetch(at + 64, _MM_HINT_T0);
}

// 16 elements from i, at their offsets `at` (mod 2^32): the scalar loop's update.
template <bool SCALE, bool SPLIT, typename S, typename P, typename G>
inline Update update(const P* p, const uint16_t* low, const G* g, const S* m, const S* v, int64_t i, I at,
                     const Consts& c) {
    V gi = load(g + i);
    if (SCALE) gi = _mm512_mul_ps(gi, c.factor);
    const V m0 = load(m + i), v0 = load(v + i);
    V pi = _mm512_mul_ps(load_master<SPLIT>(p, low, i), c.decay);
    const V mi = _mm512_fmadd_ps(c.w1, _mm512_sub_ps(gi, m0), m0);
    const V vi = _mm512_fmadd_ps(_mm512_mul_ps(c.w2, gi), gi, _mm512_mul_ps(v0, c.beta2));
    const V denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), c.bc2_sqrt), c.eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(c.neg_step, mi), denom));
    const I low16 = _mm512_set1_epi32(0xFFFF);
    I r = _mm512_setzero_si512(), high = r, rp = r;
    if (std::is_same<S, bf16>::value || (std::is_same<P, bf16>::value && !SPLIT)) {
        r = hash32(_mm512_xor_si512(at, c.key));
        high = _mm512_srli_epi32(r, 16);
    }
    if (std::is_same<P, bf16>::value && !SPLIT) {  // master_bits: (r ^ high ^ 0x8000) & 0xFFFF, the xor and the mask as one
        rp = _mm512_ternarylogic_epi32(_mm512_xor_si512(r, high), _mm512_set1_epi32(0x8000), low16, 0x28);
    }
    return Update{mi, vi, pi, _mm512_and_si512(r, low16), high, rp};
}

inline bool has_nan(const Update& u) {
    return (_mm512_cmp_ps_mask(u.m, u.v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(u.p, u.p, _CMP_UNORD_Q)) != 0;
}

// How the update writes the buffer it only writes: through the cache, or streamed (the compute copy; with no copy, a
// bf16 master written out of place).
enum Stream { CACHED = 0, STREAM_COPY = 1, STREAM_MASTER = 2 };

inline I pack_low(I a, I b) {  // the low halves of a's and b's 16 lanes, in order (pack's other half)
    const I even = _mm512_setr_epi32(0x20000, 0x60004, 0xA0008, 0xE000C, 0x120010, 0x160014, 0x1A0018, 0x1E001C,
                                     0x220020, 0x260024, 0x2A0028, 0x2E002C, 0x320030, 0x360034, 0x3A0038, 0x3E003C);
    return _mm512_permutex2var_epi16(a, even, b);
}

// 32 elements' values into their buffers from i: two updates' roundings and stores. SPLIT: the master's bits u (a
// NaN the canonical one) as hi = the high half of u + 0x8000 into p (and a bf16 copy), lo = u's low half into low.
template <bool CHECKED, int STREAM, bool SPLIT, typename O, typename S, typename P>
inline void store(P* p, uint16_t* low, S* m, S* v, O* o, int64_t i, const Update& x, const Update& y) {
    put(m, i, keep<S, CHECKED>(x.m, x.rm), keep<S, CHECKED>(y.m, y.rm));
    put(v, i, keep<S, CHECKED>(x.v, x.rv), keep<S, CHECKED>(y.v, y.rv));
    if constexpr (SPLIT) {
        const I zero = _mm512_setzero_si512(), half = _mm512_set1_epi32(0x8000);
        const I ux = with_nan<CHECKED>(x.p, _mm512_castps_si512(x.p), zero);
        const I uy = with_nan<CHECKED>(y.p, _mm512_castps_si512(y.p), zero);
        const I hx = _mm512_add_epi32(ux, half), hy = _mm512_add_epi32(uy, half);
        put_to<STREAM == STREAM_MASTER>(p, i, hx, hy);
        _mm512_storeu_si512(low + i, pack_low(ux, uy));
        if constexpr (std::is_same<O, bf16>::value) put_to<STREAM == STREAM_COPY>(o, i, hx, hy);
        else put_to<STREAM == STREAM_COPY>(o, i, ux, uy);
    } else {
        const I px = keep<P, CHECKED>(x.p, x.rp), py = keep<P, CHECKED>(y.p, y.rp);
        put_to<STREAM == STREAM_MASTER>(p, i, px, py);
        put_to<STREAM == STREAM_COPY>(o, i, copy_bits<O, P, CHECKED>(px), copy_bits<O, P, CHECKED>(py));
    }
}

// adamw_lean_t's loop over [lo, hi) in steps of 32, the master read from src and written to p (the same pointer in
// place); returns where it stopped (the scalar loop does the rest).
// O: no output, float32 or bf16 (fp16 copies take the scalar loop). STREAM: a `Stream`; the buffer streamed starts a
// 64-byte line at lo (the caller's scalar loop does the elements before it).
template <typename O, bool SCALE, int STREAM, bool SPLIT, typename S, typename P, typename G>
int64_t adamw_lean(const P* src, P* p, const G* g, S* m, S* v, O* o, int64_t lo, int64_t hi, const AdamArgs& a,
                   uint32_t key, uint32_t base, uint16_t* low) {
    const Consts c{_mm512_set1_ps(a.factor), _mm512_set1_ps(a.decay), _mm512_set1_ps(a.w1),
                   _mm512_set1_ps(a.beta2), _mm512_set1_ps(a.w2), _mm512_set1_ps(a.eps),
                   _mm512_set1_ps(a.neg_step), _mm512_set1_ps(a.bc2_sqrt),
                   _mm512_set1_epi32(static_cast<int>(key))};
    const I sixteen = _mm512_set1_epi32(16);
    I at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base + static_cast<uint32_t>(lo))),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        prefetch(src, i);
        prefetch(g, i);
        prefetch(m, i);
        prefetch(v, i);
        if constexpr (SPLIT) prefetch(low, i);
        const Update x = update<SCALE, SPLIT>(src, low, g, m, v, i, at, c);
        at = _mm512_add_epi32(at, sixteen);
        const Update y = update<SCALE, SPLIT>(src, low, g, m, v, i + 16, at, c);
        at = _mm512_add_epi32(at, sixteen);
        if (__builtin_expect(has_nan(x) || has_nan(y), 0)) store<true, STREAM, SPLIT>(p, low, m, v, o, i, x, y);
        else store<false, STREAM, SPLIT>(p, low, m, v, o, i, x, y);
    }
    if (STREAM != CACHED) _mm_sfence();  // the streamed lines before this thread's next stores (see stream_bf16)
    return i;
}

// 32 bf16 values from src + i: float32 rounded to nearest even (from_float<bf16>'s bits), bf16 as they are.
inline I bf16_bits(const float* src, int64_t i) {
    return pack(round_nearest<true>(load(src + i)), round_nearest<true>(load(src + i + 16)));
}
inline I bf16_bits(const bf16* src, int64_t i) { return _mm512_loadu_si512(src + i); }
inline bf16 one_bf16(float x) { return from_float<bf16>(x); }
inline bf16 one_bf16(bf16 x) { return x; }

// cast_t's and copy_t's loop for a large bf16 compute copy (`STREAM_MIN_BYTES` or more) over [lo, hi): one value at
// a time up to out's first 64-byte boundary, then 32 a step with non-temporal stores, which write each line
// around the cache instead of reading it first (a copy written whole, then read by the uploads: on one core of an
// EPYC 48M values from fp32 took 10 instead of 14 ms); returns where it stopped (the caller's loop does the rest).
template <typename S>
inline int64_t stream_bf16(const S* src, bf16* out, int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i < hi && (reinterpret_cast<uintptr_t>(out + i) & 63) != 0; ++i) out[i] = one_bf16(src[i]);
    for (; i + 32 <= hi; i += 32) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), bf16_bits(src, i));
    _mm_sfence();  // this thread's streamed lines before its next stores (the kernel's return: the caller's event)
    return i;
}

// A first landing of a large gradient over [lo, hi) (land_t's into fp32; land_bf16_t's copy of a bf16 one into bf16):
// up to dst's first 64-byte boundary one value at a time, then a line a step (16 or 32 values) with non-temporal
// stores, the squares added in double in two vectors of 8 lanes (reduced at the end, after the head's); returns where
// it stopped (the caller's loop does the tail and adds its squares to *s).
inline void add_squares(V x, __m512d& a, __m512d& b) {  // x's 16 squares, the low 8 into a, the high 8 into b
    const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a = _mm512_add_pd(a, _mm512_mul_pd(low, low));
    b = _mm512_add_pd(b, _mm512_mul_pd(high, high));
}
template <typename S, typename D>
int64_t land_stream(const S* src, D* dst, int64_t lo, int64_t hi, double* s) {
    constexpr bool copy = std::is_same<D, bf16>::value;  // a bf16 dst takes a bf16 src's bits as they are
    int64_t i = lo;
    double head = 0.0;
    for (; i < hi && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; ++i) {
        const float x = to_float(src[i]);
        if constexpr (copy) dst[i] = src[i];
        else dst[i] = x;
        head += static_cast<double>(x) * static_cast<double>(x);
    }
    __m512d a = _mm512_setzero_pd(), b = a;
    constexpr int64_t step = 64 / sizeof(D);
    for (; i + step <= hi; i += step) {
        prefetch(src, i);  // (the update's; on a Xeon 48M values landed in 16-17 instead of 18-19 ms)
        if constexpr (copy) {
            _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
            add_squares(load(src + i), a, b);
            add_squares(load(src + i + 16), a, b);
        } else {
            const V x = load(src + i);
            _mm512_stream_ps(dst + i, x);
            add_squares(x, a, b);
        }
    }
    _mm_sfence();  // the streamed lines before this thread's next stores
    *s = head + _mm512_reduce_add_pd(_mm512_add_pd(a, b));
    return i;
}
template int64_t land_stream<float, float>(const float*, float*, int64_t, int64_t, double*);
template int64_t land_stream<bf16, float>(const bf16*, float*, int64_t, int64_t, double*);
template int64_t land_stream<bf16, bf16>(const bf16*, bf16*, int64_t, int64_t, double*);

}  // namespace v512
#define RP_AVX512 1
#else
#define RP_AVX512 0
#endif
