/* zx_simd_avx512.h — the AVX-512 (F, BW, VL) vocabulary: 16 fp32 lanes in a __m512.
 *
 * Shared by zx_kernels_avx512.c and zx_quant_avx512.c; the contract every vocabulary
 * keeps is in zx_simd.h (Note [One SIMD body, two vocabularies]). Include it only
 * where ZX_HAVE_X86_SIMD; nothing here runs before zx_cpu_supports(ZX_ISA_AVX512).
 * ZX_SIMD_TARGET_BF16 adds AVX512-BF16 (vcvtneps2bf16), for functions reached only
 * after zx_cpu_has_avx512_bf16().
 */
#ifndef ZX_SIMD_AVX512_H
#define ZX_SIMD_AVX512_H

#include "zx_simd.h"   /* defines: ZX_SIMD_NAME, the vocabulary contract */

#define ZX_SIMD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define ZX_SIMD_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ZX_SIMD_SUFFIX avx512

typedef __m512 vec;      /* 16 x fp32 */
typedef __m256i vec_u16; /* 16 x 16-bit bf16/fp16 bit patterns */
#define VEC_WIDTH 16
#define VEC_LP_ALIGN 32  /* bytes: a vec_u16 streams only to a 32-byte aligned address */

/* ---- fp32 arithmetic ---- */
static inline ZX_SIMD_TARGET vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline ZX_SIMD_TARGET void vec_store(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline ZX_SIMD_TARGET vec vec_set1(float a) { return _mm512_set1_ps(a); }
static inline ZX_SIMD_TARGET vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_div(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sqrt(vec a) { return _mm512_sqrt_ps(a); }
static inline ZX_SIMD_TARGET vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline ZX_SIMD_TARGET vec vec_min(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_max(vec a, vec b) { return _mm512_max_ps(a, b); }
/* torch.maximum: vmaxps gives (a > b ? a : b); lanes with a NaN get a + b (NaN). */
static inline ZX_SIMD_TARGET vec vec_max_nan(vec a, vec b) {
    __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_add_ps(_mm512_max_ps(a, b), nan, a, b);
}
static inline ZX_SIMD_TARGET vec vec_round_even(vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* ---- bf16 / fp16 ---- */
static inline ZX_SIMD_TARGET vec vec_load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline ZX_SIMD_TARGET vec vec_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* Round 16 fp32 to bf16 exactly like zx_f32_to_bf16_ref, with integer arithmetic
 * (zx_kernels_avx512.c uses vcvtneps2bf16 where the CPU has it). */
static inline ZX_SIMD_TARGET vec_u16 vec_to_bf16(vec x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x0040));  /* quiet NaN */
    return _mm512_cvtepi32_epi16(r);
}
static inline ZX_SIMD_TARGET vec_u16 vec_to_f16(vec x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}
static inline ZX_SIMD_TARGET vec_u16 vec_u16_load(const uint16_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline ZX_SIMD_TARGET void vec_u16_store(uint16_t *dst, vec_u16 r, int stream) {
    if (stream)
        _mm256_stream_si256((__m256i *)dst, r);
    else
        _mm256_storeu_si256((__m256i *)dst, r);
}
static inline ZX_SIMD_TARGET void vec_store_fence(void) { _mm_sfence(); }
/* One vector of the low-precision copy (lp_dtype ZX_BF16 or ZX_F16). */
static inline ZX_SIMD_TARGET void vec_store_lp(uint16_t *dst, vec a, int lp_dtype, int stream) {
    vec_u16_store(dst, lp_dtype == ZX_BF16 ? vec_to_bf16(a) : vec_to_f16(a), stream);
}

/* ---- 32-bit integer lanes (the stochastic-rounding hash, zx_sr.h) ---- */
typedef __m512i vec_u32; /* 16 x uint32 */
static inline ZX_SIMD_TARGET vec_u32 vec_u32_set1(uint32_t a) { return _mm512_set1_epi32((int)a); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_iota(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline ZX_SIMD_TARGET vec_u32 vec_u32_add(vec_u32 a, vec_u32 b) { return _mm512_add_epi32(a, b); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_xor(vec_u32 a, vec_u32 b) { return _mm512_xor_si512(a, b); }
static inline ZX_SIMD_TARGET vec_u32 vec_u32_and(vec_u32 a, vec_u32 b) { return _mm512_and_si512(a, b); }
/* the low 32 bits of the product, as C's uint32_t * */
static inline ZX_SIMD_TARGET vec_u32 vec_u32_mul(vec_u32 a, vec_u32 b) { return _mm512_mullo_epi32(a, b); }
#define vec_u32_shr(a, k) _mm512_srli_epi32((a), (k))
/* Round 16 fp32 to bf16 stochastically exactly like zx_bf16_sr (r: 16 values < 2^16). */
static inline ZX_SIMD_TARGET vec_u16 vec_to_bf16_sr(vec x, vec_u32 r) {
    __m512i u = _mm512_castps_si512(x);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __m512i inf = _mm512_set1_epi32(0x7f800000);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
    /* a finite value that reached the Inf pattern saturates to the largest finite bf16 */
    __mmask16 sat = _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, _mm512_set1_epi32(0x7fff)),
                                            _mm512_set1_epi32(0x7f80)) &
                    _mm512_cmpneq_epi32_mask(a, inf);
    h = _mm512_mask_sub_epi32(h, sat, h, _mm512_set1_epi32(1));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(a, inf);
    h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(h);
}

/* ---- the split master (Note [Split master], zx_master_split.c) ---- */
/* 16 masters from their top halves hi, remainders rem and tie bits t (bit k: lane k) */
static inline ZX_SIMD_TARGET vec vec_join(const uint16_t *hi, const int16_t *rem, unsigned t) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)hi));
    __m512i d = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)rem));
    d = _mm512_mask_mov_epi32(d, (__mmask16)t, _mm512_set1_epi32(0x8000));
    /* an edited zero with a negative remainder: no wrap into NaN */
    const __mmask16 edited = _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, _mm512_set1_epi32(0x7fff)), zero) &
                             _mm512_cmplt_epi32_mask(d, zero);
    d = _mm512_maskz_mov_epi32((__mmask16)~edited, d);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 16), d));
}
/* the remainders of a over its top halves h (the rounding of a) into rem; returns the tie bits */
static inline ZX_SIMD_TARGET unsigned vec_split(vec a, vec_u16 h, int16_t *rem) {
    const __m512i d = _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i *)rem, _mm512_cvtepi32_epi16(d));   /* the low halves */
    return (unsigned)_mm512_cmpeq_epi32_mask(d, _mm512_set1_epi32(0x8000));
}

/* ---- int8 ---- */
/* 16 integral floats -> 16 int32 -> 16 int8 (vpmovdb truncates; the values fit) */
static inline ZX_SIMD_TARGET void vec_store_i8(int8_t *p, vec a) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
}
static inline ZX_SIMD_TARGET vec vec_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#endif /* ZX_SIMD_AVX512_H */
