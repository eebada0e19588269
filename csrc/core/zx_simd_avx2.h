/* zx_simd_avx2.h — the AVX2 + FMA + F16C vocabulary: 8 fp32 lanes in a __m256.
 *
 * Shared by zx_kernels_avx2.c and zx_quant_avx2.c; the contract every vocabulary
 * keeps is in zx_simd.h (Note [One SIMD body, two vocabularies]). Include it only
 * where ZX_HAVE_X86_SIMD; nothing here runs before zx_cpu_supports(ZX_ISA_AVX2).
 */
#ifndef ZX_SIMD_AVX2_H
#define ZX_SIMD_AVX2_H

#include "zx_simd.h"   /* defines: ZX_SIMD_NAME, the vocabulary contract */

#define ZX_SIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define ZX_SIMD_SUFFIX avx2

typedef __m256 vec;      /* 8 x fp32 */
typedef __m128i vec_u16; /* 8 x 16-bit bf16/fp16 bit patterns */
#define VEC_WIDTH 8
#define VEC_LP_ALIGN 16  /* bytes: a vec_u16 streams only to a 16-byte aligned address */

/* ---- fp32 arithmetic ---- */
static inline ZX_SIMD_TARGET vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline ZX_SIMD_TARGET void vec_store(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline ZX_SIMD_TARGET vec vec_set1(float a) { return _mm256_set1_ps(a); }
static inline ZX_SIMD_TARGET vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_div(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sqrt(vec a) { return _mm256_sqrt_ps(a); }
static inline ZX_SIMD_TARGET vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline ZX_SIMD_TARGET vec vec_min(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_max(vec a, vec b) { return _mm256_max_ps(a, b); }
/* torch.maximum: vmaxps gives (a > b ? a : b); lanes with a NaN get a + b (NaN). */
static inline ZX_SIMD_TARGET vec vec_max_nan(vec a, vec b) {
    vec nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b), nan);
}
static inline ZX_SIMD_TARGET vec vec_round_even(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* ---- bf16 / fp16 ---- */
static inline ZX_SIMD_TARGET vec vec_load_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline ZX_SIMD_TARGET vec vec_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
/* Round 8 fp32 to bf16 exactly like zx_f32_to_bf16_ref, with integer arithmetic. */
static inline ZX_SIMD_TARGET vec_u16 vec_to_bf16(vec x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* 8 x u32 (each <= 0xffff) -> 8 x u16 */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline ZX_SIMD_TARGET vec_u16 vec_to_f16(vec x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}
static inline ZX_SIMD_TARGET vec_u16 vec_u16_load(const uint16_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline ZX_SIMD_TARGET void vec_u16_store(uint16_t *dst, vec_u16 r, int stream) {
    if (stream)
        _mm_stream_si128((__m128i *)dst, r);
    else
        _mm_storeu_si128((__m128i *)dst, r);
}
static inline ZX_SIMD_TARGET void vec_store_fence(void) { _mm_sfence(); }
/* One vector of the low-precision copy (lp_dtype ZX_BF16 or ZX_F16). */
static inline ZX_SIMD_TARGET void vec_store_lp(uint16_t *dst, vec a, int lp_dtype, int stream) {
    vec_u16_store(dst, lp_dtype == ZX_BF16 ? vec_to_bf16(a) : vec_to_f16(a), stream);
}

/* ---- 32-bit integer lanes (the stochastic-rounding hash, zx_sr.h) ---- */
typedef __m256i vec_u32; /* 8 x uint32 */
static inline ZX_SIMD_TARGET vec_u32 vec_u32_set1(uint32_t a) { return _mm256_set1_epi32((int)a); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_add(vec_u32 a, vec_u32 b) { return _mm256_add_epi32(a, b); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_xor(vec_u32 a, vec_u32 b) { return _mm256_xor_si256(a, b); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_and(vec_u32 a, vec_u32 b) { return _mm256_and_si256(a, b); }
/* the low 32 bits of the product, as C's uint32_t * */
static inline ZX_SIMD_TARGET vec_u32 vec_u32_mul(vec_u32 a, vec_u32 b) { return _mm256_mullo_epi32(a, b); }
#define vec_u32_shr(a, k) _mm256_srli_epi32((a), (k))
/* Round 8 fp32 to bf16 stochastically exactly like zx_bf16_sr (r: 8 values < 2^16). */
static inline ZX_SIMD_TARGET vec_u16 vec_to_bf16_sr(vec x, vec_u32 r) {
    __m256i u = _mm256_castps_si256(x);
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i inf = _mm256_set1_epi32(0x7f800000);
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, r), 16);
    /* a finite value that reached the Inf pattern saturates: h - 1 (mask is all ones) */
    __m256i reached = _mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)),
                                         _mm256_set1_epi32(0x7f80));
    __m256i sat = _mm256_andnot_si256(_mm256_cmpeq_epi32(a, inf), reached);
    h = _mm256_add_epi32(h, sat);
    __m256i nan = _mm256_cmpgt_epi32(a, inf);   /* a <= 0x7fffffff: signed compare works */
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    h = _mm256_blendv_epi8(h, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* ---- the split master (Note [Split master], zx_master_split.c) ---- */
/* 8 masters from their top halves hi, remainders rem and tie bits t (bit k: lane k) */
static inline ZX_SIMD_TARGET vec vec_join(const uint16_t *hi, const int16_t *rem, unsigned t) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), zero = _mm256_setzero_si256();
    const __m256i tie = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)t), bit), bit);
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)hi));
    __m256i d = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)rem));
    d = _mm256_blendv_epi8(d, _mm256_set1_epi32(0x8000), tie);
    /* an edited zero with a negative remainder: no wrap into NaN */
    const __m256i edited = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)), zero),
                                            _mm256_cmpgt_epi32(zero, d));
    d = _mm256_andnot_si256(edited, d);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(h, 16), d));
}
/* the remainders of a over its top halves h (the rounding of a) into rem; returns the tie bits */
static inline ZX_SIMD_TARGET unsigned vec_split(vec a, vec_u16 h, int16_t *rem) {
    const __m256i d = _mm256_sub_epi32(_mm256_castps_si256(a), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    /* the low halves, in order: pack (no saturation below 0x10000), then the two 64-bit middles swap */
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(d, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256()), 0xd8);
    _mm_storeu_si128((__m128i *)rem, _mm256_castsi256_si128(packed));
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(d, _mm256_set1_epi32(0x8000))));
}

/* ---- int8 ---- */
/* 8 integral floats -> 8 int32 -> 8 int16 -> 8 int8 (saturating packs never saturate:
 * the values are within [-127, 127]) */
static inline ZX_SIMD_TARGET void vec_store_i8(int8_t *p, vec a) {
    __m256i i32 = _mm256_cvtps_epi32(a);
    __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(i16, i16));
}
static inline ZX_SIMD_TARGET vec vec_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#endif /* ZX_SIMD_AVX2_H */
