/* zx_sr.h — the counter-based random bits and the stochastic rounding to bf16 of
 * one value, written once for the CPU kernels (zx_adam_bf16s_ref in zx_kernels_ref.c,
 * the oracle; the SIMD bodies in zx_kernels_sr_simd.inc repeat it in vectors) and the
 * CUDA kernel (csrc/cuda/zx_cuda_adam_sr.cu). Internal, not part of the API.
 *
 * Note [Counter-based stochastic rounding]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * zx_adam_step_bf16_states stores its two states in bf16 with stochastic rounding
 * (SR): a value between two neighbouring bf16 numbers goes to the upper one with a
 * probability equal to its distance from the lower one (in units of their gap), so
 * the expected stored value is the exact value and updates far smaller than half a
 * bf16 ulp still move the state on average instead of being lost.
 *
 * The random bits of element i depend only on (seed, counter = offset + i), through
 * a stateless hash, so results do not depend on the ISA, the thread count or how a
 * caller cuts [0, n) into ranges (a range passes the global index of its first
 * element as offset). Every SIMD ISA lacks a 64-bit multiply (AVX2, AVX-512F), so
 * the hash works on 32-bit words with 32-bit multiplies only:
 *
 *   mix(x)        x ^= x >> 16; x *= 0x85ebca6b; x ^= x >> 13; x *= 0xc2b2ae35;
 *                 x ^= x >> 16        (a bijective avalanche step on 32 bits)
 *   s0            mix(lo32(seed) ^ 0x9e3779b9)
 *   s1            mix(hi32(seed) ^ s0 ^ 0x7f4a7c15)
 *   block_key     mix(hi32(counter) ^ s1)       (constant over 2^32 counters)
 *   bits          mix(mix(lo32(counter) ^ s0) ^ block_key)
 *
 * For one seed, the 2^32 counters of one block map one-to-one onto the 2^32 values
 * of `bits` (every step is a bijection of the low word), so within a block the
 * 16-bit halves are exactly uniform. The low 16 bits round exp_avg, the high 16
 * bits exp_avg_sq.
 *
 * Rounding (zx_bf16_sr): add the 16 random bits to the low 16 bits of the fp32
 * pattern and keep the high 16 bits (truncation). On sign-magnitude bits this
 * rounds the magnitude, so it is unbiased for negative values and subnormals too.
 *   NaN      stays NaN: the result of zx_f32_to_bf16_ref (sign, top payload bits, quiet).
 *   +-Inf    stays +-Inf (its low bits are zero: nothing to round).
 *   finite   never becomes Inf: a finite value above the largest finite bf16
 *            (3.3895e38 = 0x7f7f) would round up into Inf with some probability;
 *            it gets +-0x7f7f instead (saturation; a state at Inf would freeze or
 *            poison the parameter for good).
 *   +-0      stays +-0 (the low bits are zero).
 */
#ifndef ZX_SR_H
#define ZX_SR_H

#include <stdint.h>

#if defined(__CUDACC__)
#define ZX_SR_FN static __host__ __device__ __forceinline__
#else
#define ZX_SR_FN static inline
#endif

#define ZX_SR_MUL1 0x85ebca6bu
#define ZX_SR_MUL2 0xc2b2ae35u
#define ZX_SR_SEED_LO 0x9e3779b9u
#define ZX_SR_SEED_HI 0x7f4a7c15u

/* The avalanche step of Note [Counter-based stochastic rounding]. */
ZX_SR_FN uint32_t zx_sr_mix(uint32_t x) {
    x ^= x >> 16;
    x *= ZX_SR_MUL1;
    x ^= x >> 13;
    x *= ZX_SR_MUL2;
    x ^= x >> 16;
    return x;
}

/* The two key words of one seed (once per call). */
typedef struct zx_sr_key {
    uint32_t s0, s1;
} zx_sr_key;

ZX_SR_FN zx_sr_key zx_sr_key_of(uint64_t seed) {
    zx_sr_key k;
    k.s0 = zx_sr_mix((uint32_t)seed ^ ZX_SR_SEED_LO);
    k.s1 = zx_sr_mix((uint32_t)(seed >> 32) ^ k.s0 ^ ZX_SR_SEED_HI);
    return k;
}

/* The key of the block of 2^32 counters whose high word is hi. */
ZX_SR_FN uint32_t zx_sr_block_key(zx_sr_key k, uint32_t hi) { return zx_sr_mix(hi ^ k.s1); }

/* The 32 random bits of one counter, given its block's key. */
ZX_SR_FN uint32_t zx_sr_bits_in_block(zx_sr_key k, uint32_t block_key, uint32_t lo) {
    return zx_sr_mix(zx_sr_mix(lo ^ k.s0) ^ block_key);
}

/* The 32 random bits of counter c under seed. */
ZX_SR_FN uint32_t zx_sr_bits(uint64_t seed, uint64_t c) {
    zx_sr_key k = zx_sr_key_of(seed);
    return zx_sr_bits_in_block(k, zx_sr_block_key(k, (uint32_t)(c >> 32)), (uint32_t)c);
}

/* fp32 bit pattern u -> bf16 bits, stochastically rounded with r (0 <= r < 2^16). */
ZX_SR_FN uint16_t zx_bf16_sr(uint32_t u, uint32_t r) {
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);   /* NaN: quiet */
    uint32_t h = (u + r) >> 16;             /* no carry into the sign: a + r < 2^31 */
    if ((h & 0x7fffu) == 0x7f80u && a != 0x7f800000u) h -= 1u;      /* finite: saturate */
    return (uint16_t)h;
}

#endif /* ZX_SR_H */
