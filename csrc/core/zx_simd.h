/* zx_simd.h — what every SIMD vocabulary header of the core promises, not part of the API.
 *
 *   zx_simd_avx2.h     the AVX2 + FMA + F16C vocabulary, 8 fp32 lanes
 *   zx_simd_avx512.h   the AVX-512 (F, BW, VL) vocabulary, 16 fp32 lanes
 *
 * Note [One SIMD body, two vocabularies]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * The SIMD algorithms are written once, in zx_kernels_simd.inc (the optimizers, slice
 * sums, casts), zx_kernels_sr_simd.inc (Adam with bf16 states) and zx_quant_simd.inc
 * (blockwise quantization), in a small vocabulary of vector operations. Each ISA
 * defines that vocabulary once, in its header; a file such as zx_kernels_avx2.c
 * includes zx_simd_avx2.h and then the body, which becomes zx_adam_avx2, zx_sgd_avx2,
 * ... The bodies read like the reference (zx_kernels_ref.c, zx_quant_ref.c), line for
 * line and in the same operation order (Note [Bit-exact SIMD]); a vector body walks
 * whole vectors and the reference finishes the tail.
 * What only one ISA can do (the gradient scan, the amax scan, AVX-512 BF16) stays in
 * that ISA's .c file, in its own intrinsics.
 *
 * Every vocabulary header defines (all static inline, each with ZX_SIMD_TARGET):
 *   ZX_SIMD_TARGET   the function attribute enabling the ISA; callers only reach
 *                    these functions after zx_cpu_supports() said yes
 *   ZX_SIMD_SUFFIX   avx2 / avx512 (the suffix ZX_SIMD_NAME appends)
 *   vec, VEC_WIDTH   the fp32 vector type and its lane count
 *   vec_u16          VEC_WIDTH 16-bit lanes (bf16 / fp16 bit patterns)
 *   arithmetic       vec_load / vec_store (unaligned), vec_set1, vec_add, vec_sub,
 *                    vec_mul, vec_div, vec_sqrt, vec_fma(a, b, c) = a*b + c rounded
 *                    once, vec_min / vec_max (no NaN may reach them), vec_max_nan
 *                    (torch.maximum: NaN wins), vec_round_even (to nearest, ties to even)
 *   16-bit floats    vec_load_bf16, vec_load_f16 (VEC_WIDTH uint16 -> fp32, exact);
 *                    vec_to_bf16, vec_to_f16 (fp32 -> bits, rounded like
 *                    zx_f32_to_bf16_ref / zx_f32_to_f16_ref); vec_u16_load(src),
 *                    vec_u16_store(dst, r,
 *                    stream) (stream: a non-temporal store, dst VEC_LP_ALIGN-aligned;
 *                    Note [Streaming copy-out] in zx_kernels_avx512.c), vec_store_fence;
 *                    vec_store_lp(dst, a, lp_dtype, stream) = convert + store
 *   32-bit integers  vec_u32 (VEC_WIDTH uint32 lanes), vec_u32_set1, vec_u32_iota (lane
 *                    k holds k), vec_u32_add / _xor / _and / _mul (low 32 bits, as C's
 *                    uint32_t arithmetic), vec_u32_shr(a, k) (logical, k a constant);
 *                    vec_to_bf16_sr(x, r) (fp32 -> bf16 bits, stochastically rounded
 *                    with r < 2^16 per lane exactly like zx_bf16_sr in zx_sr.h)
 *   split master     vec_join(hi, rem, t) (VEC_WIDTH masters from bf16 top halves, int16
 *                    remainders and tie bits t, bit k for lane k), vec_split(a, h, rem) (the
 *                    remainders of a over h = its bf16 rounding, stored; returns the tie
 *                    bits): Note [Split master] in zx_master_split.c, bit for bit
 *   int8             vec_store_i8 (VEC_WIDTH integral values in [-127, 127] -> int8),
 *                    vec_load_i8 (VEC_WIDTH int8 -> fp32)
 */
#ifndef ZX_SIMD_H
#define ZX_SIMD_H

#include "zx_kernels_internal.h"

#if !ZX_HAVE_X86_SIMD
#error "the SIMD vocabularies need a compiler with x86 target attributes (ZX_HAVE_X86_SIMD)"
#endif

#include <immintrin.h>

/* ZX_SIMD_NAME(zx_adam_) -> zx_adam_avx2 in a file that included zx_simd_avx2.h */
#define ZX_SIMD_CAT2(a, b) a##b
#define ZX_SIMD_CAT(a, b) ZX_SIMD_CAT2(a, b)
#define ZX_SIMD_NAME(base) ZX_SIMD_CAT(base, ZX_SIMD_SUFFIX)

#endif /* ZX_SIMD_H */
