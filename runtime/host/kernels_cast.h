// The compute copy: an fp32 master cast into its training dtype (`cast_t`), a bf16 master copied into its bf16 copy
// (`copy_t`). Included by kernels.cpp after kernels_update.h (whose kernels_avx512.h has the streamed loop).
#pragma once
#include "kernels_common.h"

namespace {

// ---- cast: the compute copy ------------------------------------------------------------------------

template <typename O>
void cast_t(const float* src, O* out, int64_t n, int threads) {
    [[maybe_unused]] const bool stream = std::is_same<O, bf16>::value && n * 2 >= STREAM_MIN_BYTES;
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
    [[maybe_unused]] const bool stream = n * 2 >= STREAM_MIN_BYTES;
    for_blocks(n, threads, [=](int64_t, int64_t lo, int64_t hi) {
#if RP_AVX512
        if (stream) lo = v512::stream_bf16(src, out, lo, hi);
#endif
        std::memcpy(out + lo, src + lo, static_cast<size_t>(hi - lo) * 2);
    });
}

}  // namespace
