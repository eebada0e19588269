/* zx_master_split.c — an fp32 master weight held as its bf16 rounding plus a
 * 16-bit remainder and a tie bit (Note [Split master]).
 *
 * Note [Split master]
 *   With param_dtype bf16, stages 0-2 keep every parameter in bf16 (the model
 *   computes with it) and, for this rank's shard, an fp32 master that the
 *   optimizer steps. The bf16 parameter is the master rounded to nearest even,
 *   hi = RNE(m), so it already holds the master's top 16 bits up to one carry;
 *   the master is kept as what is missing:
 *       d = bits(m) - (hi << 16)          (as 32-bit integers)
 *   Rounding to nearest puts d in [-0x8000, 0x8000] (the sign bit rides along:
 *   a negative number's bits are its magnitude's, so the difference is taken on
 *   the magnitude). That is 65,537 values, one more than 16 bits hold: the two
 *   ends are the ties, where m lies exactly halfway between two bf16 numbers,
 *   and both round to an even hi, so hi cannot tell them apart. So:
 *       rem  = (int16_t)d                 (d = +0x8000 wraps to -0x8000)
 *       tie  = d == +0x8000               (one bit per element)
 *   and the master comes back exactly, bit for bit:
 *       bits(m) = (hi << 16) + (tie ? +0x8000 : rem)
 *   Storage per shard element: 2 bytes + 1 bit instead of 4 bytes; the fused
 *   step joins a chunk into fp32 scratch, steps it (writing hi as it always
 *   does) and splits it again, so the fp32 trajectory is the same as with a
 *   separate fp32 master (csrc/engine/master_split.h). Neither direction rounds:
 *   split reads the hi the step wrote, so it needs no rounding rule of its own.
 *
 *   The tie bits of elements [0, n) are bit (i & 7) of ties[i >> 3]; a partial
 *   last byte's unused bits are written 0, so callers keep chunks 8-aligned.
 *   A hi that does not come from rounding m (the parameter was edited through
 *   p.data, unseen) still joins to a nearby number: the edit is kept with the
 *   old remainder. Only a zero hi with a negative remainder would wrap across
 *   the sign into a NaN; there the remainder is taken as 0 (a legitimate split
 *   never has it: m = +-0 + d has d >= 0). NaN masters stay NaN (payload not kept).
 */
#include <string.h>

#include "zx_core.h"
#include "zx_kernels_internal.h"   /* defines: ZX_HAVE_X86_SIMD */

#if ZX_HAVE_X86_SIMD
#include <immintrin.h>
#endif

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float join1(uint16_t hi, int16_t rem, unsigned tie) {
    int32_t d = tie ? 0x8000 : (int32_t)rem;
    d = (hi & 0x7fffu) == 0 && d < 0 ? 0 : d;   /* an edited zero: no wrap into NaN */
    return bits_f32(((uint32_t)hi << 16) + (uint32_t)d);
}

static inline uint8_t split1(float m, uint16_t hi, int16_t *rem, unsigned j) {
    const uint32_t d = f32_bits(m) - ((uint32_t)hi << 16);
    *rem = (int16_t)(uint16_t)d;
    return (uint8_t)((d == 0x8000u) << j);
}

#if ZX_HAVE_X86_SIMD
/* AVX2: one tie byte = one vector of 8 elements. Returns the whole bytes done. */
#define ZX_MS_TARGET __attribute__((target("avx2")))

static ZX_MS_TARGET __m256i tie_lanes(unsigned t) {   /* all ones where bit j of t is set */
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)t), bit), bit);
}

static ZX_MS_TARGET size_t join_avx2(size_t whole, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                                     float *out) {
    const __m256i half = _mm256_set1_epi32(0x8000), mag = _mm256_set1_epi32(0x7fff), zero = _mm256_setzero_si256();
    for (size_t b = 0; b < whole; b++) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(hi + b * 8)));
        __m256i d = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(rem + b * 8)));
        d = _mm256_blendv_epi8(d, half, tie_lanes(ties[b]));
        const __m256i edited = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h, mag), zero),
                                                _mm256_cmpgt_epi32(zero, d));
        d = _mm256_andnot_si256(edited, d);
        _mm256_storeu_si256((__m256i *)(out + b * 8), _mm256_add_epi32(_mm256_slli_epi32(h, 16), d));
    }
    return whole;
}

static ZX_MS_TARGET size_t split_avx2(size_t whole, const float *m, const uint16_t *hi, int16_t *rem,
                                      uint8_t *ties) {
    const __m256i half = _mm256_set1_epi32(0x8000), low = _mm256_set1_epi32(0xffff);
    for (size_t b = 0; b < whole; b++) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(hi + b * 8)));
        const __m256i d = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(m + b * 8)), _mm256_slli_epi32(h, 16));
        /* the low halves, in order: pack (no saturation below 0x10000), then the two 64-bit middles swap */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(d, low), _mm256_setzero_si256()), 0xd8);
        _mm_storeu_si128((__m128i *)(rem + b * 8), _mm256_castsi256_si128(packed));
        ties[b] = (uint8_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(d, half)));
    }
    return whole;
}

/* AVX-512: two tie bytes = one 16-bit lane mask = 16 elements. Returns the whole bytes done. */
#define ZX_MS_TARGET512 __attribute__((target("avx512f,avx512bw")))

static ZX_MS_TARGET512 size_t join_avx512(size_t whole, const uint16_t *hi, const int16_t *rem,
                                          const uint8_t *ties, float *out) {
    const __m512i half = _mm512_set1_epi32(0x8000), mag = _mm512_set1_epi32(0x7fff), zero = _mm512_setzero_si512();
    size_t b = 0;
    for (; b + 2 <= whole; b += 2) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(hi + b * 8)));
        __m512i d = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(rem + b * 8)));
        d = _mm512_mask_mov_epi32(d, (__mmask16)(ties[b] | ties[b + 1] << 8), half);
        const __mmask16 edited = _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, mag), zero) &
                                 _mm512_cmplt_epi32_mask(d, zero);
        d = _mm512_maskz_mov_epi32((__mmask16)~edited, d);
        _mm512_storeu_si512(out + b * 8, _mm512_add_epi32(_mm512_slli_epi32(h, 16), d));
    }
    return b;
}

static ZX_MS_TARGET512 size_t split_avx512(size_t whole, const float *m, const uint16_t *hi, int16_t *rem,
                                           uint8_t *ties) {
    const __m512i half = _mm512_set1_epi32(0x8000);
    size_t b = 0;
    for (; b + 2 <= whole; b += 2) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(hi + b * 8)));
        const __m512i d = _mm512_sub_epi32(_mm512_loadu_si512(m + b * 8), _mm512_slli_epi32(h, 16));
        _mm256_storeu_si256((__m256i *)(rem + b * 8), _mm512_cvtepi32_epi16(d));   /* the low halves */
        const __mmask16 t = _mm512_cmpeq_epi32_mask(d, half);
        ties[b] = (uint8_t)t;
        ties[b + 1] = (uint8_t)(t >> 8);
    }
    return b;
}
#endif

/* Whole bytes first (AVX-512 / AVX2 where the CPU has them and isa allows; an odd last
 * whole byte and the partial last byte in the narrower loops). */
zx_status zx_master_join(zx_isa isa, size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                         float *out) {
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !out) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    const size_t whole = n / 8;
    size_t done = 0;
#if ZX_HAVE_X86_SIMD
    if (isa == ZX_ISA_AVX512) done = join_avx512(whole, hi, rem, ties, out);
    if (isa != ZX_ISA_SCALAR) done += join_avx2(whole - done, hi + done * 8, rem + done * 8, ties + done,
                                                out + done * 8);
#endif
    for (size_t b = done; b < whole; b++) {
        const unsigned t = ties[b];
        for (unsigned j = 0; j < 8; j++) out[b * 8 + j] = join1(hi[b * 8 + j], rem[b * 8 + j], (t >> j) & 1u);
    }
    for (size_t i = whole * 8; i < n; i++) out[i] = join1(hi[i], rem[i], (ties[whole] >> (i & 7)) & 1u);
    return ZX_OK;
}

zx_status zx_master_split(zx_isa isa, size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) {
    if (n == 0) return ZX_OK;
    if (!m || !hi || !rem || !ties) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    const size_t whole = n / 8;
    size_t done = 0;
#if ZX_HAVE_X86_SIMD
    if (isa == ZX_ISA_AVX512) done = split_avx512(whole, m, hi, rem, ties);
    if (isa != ZX_ISA_SCALAR) done += split_avx2(whole - done, m + done * 8, hi + done * 8, rem + done * 8,
                                                 ties + done);
#endif
    for (size_t b = done; b < whole; b++) {
        uint8_t t = 0;
        for (unsigned j = 0; j < 8; j++) t |= split1(m[b * 8 + j], hi[b * 8 + j], &rem[b * 8 + j], j);
        ties[b] = t;
    }
    if (whole * 8 < n) {
        uint8_t t = 0;
        for (size_t i = whole * 8; i < n; i++) t |= split1(m[i], hi[i], &rem[i], (unsigned)(i & 7));
        ties[whole] = t;
    }
    return ZX_OK;
}
