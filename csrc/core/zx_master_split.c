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

static inline float join1(uint16_t hi, int16_t rem, int tie) {
    int32_t d = tie ? 0x8000 : (int32_t)rem;
    if ((hi & 0x7fffu) == 0 && d < 0) d = 0;   /* an edited zero: no wrap into NaN */
    return bits_f32(((uint32_t)hi << 16) + (uint32_t)d);
}

zx_status zx_master_join(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) {
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !out) return ZX_ERR_INVALID_ARG;
    for (size_t i = 0; i < n; i++) out[i] = join1(hi[i], rem[i], (ties[i >> 3] >> (i & 7)) & 1);
    return ZX_OK;
}

zx_status zx_master_split(size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) {
    if (n == 0) return ZX_OK;
    if (!m || !hi || !rem || !ties) return ZX_ERR_INVALID_ARG;
    for (size_t b = 0; b < (n + 7) / 8; b++) {
        uint8_t t = 0;
        const size_t end = b * 8 + 8 < n ? b * 8 + 8 : n;
        for (size_t i = b * 8; i < end; i++) {
            const uint32_t d = f32_bits(m[i]) - ((uint32_t)hi[i] << 16);
            rem[i] = (int16_t)(uint16_t)d;
            t |= (uint8_t)((d == 0x8000u) << (i & 7));
        }
        ties[b] = t;
    }
    return ZX_OK;
}
