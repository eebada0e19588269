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
#include "zx_kernels_internal.h"   /* defines: ZX_HAVE_X86_SIMD, zx_master_join_avx2, ... */

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

/* Whole vectors first (AVX-512 / AVX2 where the CPU has them and isa allows: their loops,
 * written with vec_join / vec_split, are in zx_kernels_simd.inc); an odd last whole byte
 * and the partial last byte in the narrower loops. */
zx_status zx_master_join(zx_isa isa, size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                         float *out) {
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !out) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    const size_t whole = n / 8;
    size_t v = 0;   /* elements the vector loops did: whole bytes */
#if ZX_HAVE_X86_SIMD
    if (isa == ZX_ISA_AVX512) v = zx_master_join_avx512(n, hi, rem, ties, out);
    if (isa != ZX_ISA_SCALAR) v += zx_master_join_avx2(n - v, hi + v, rem + v, ties + v / 8, out + v);
#endif
    const size_t done = v / 8;
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
    size_t v = 0;   /* elements the vector loops did: whole bytes */
#if ZX_HAVE_X86_SIMD
    if (isa == ZX_ISA_AVX512) v = zx_master_split_avx512(n, m, hi, rem, ties);
    if (isa != ZX_ISA_SCALAR) v += zx_master_split_avx2(n - v, m + v, hi + v, rem + v, ties + v / 8);
#endif
    const size_t done = v / 8;
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
