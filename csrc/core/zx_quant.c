/* zx_quant.c — blockwise symmetric int8 / int4 quantization (entry points of zx_core.h).
 *
 * Note [Blockwise quantization]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * The communication-reducing modes (quantized parameter gathers, quantized gradient
 * reduction) send codes + one fp32 scale per block of block_numel elements instead of
 * the values. For one block of len <= block_numel elements x (fp32; bf16/fp16 inputs
 * are converted exactly first; with error feedback x = src + residual):
 *   1. amax_bits = max over the block of the bit pattern of |x| (zx_q_absmax_*):
 *      exact and order-free, so every ISA and the GPU agree; NaN > inf > finite.
 *   2. zx_quant_block_scale: inf/NaN anywhere -> scale = NaN, every code 0 (each
 *      dequantized element is then 0 * NaN = NaN, so an overflowing fp16 gradient
 *      still reaches the inf/nan scan and skips the step; the residual is left alone).
 *      amax 0 -> scale 0, codes 0 (divisor 1, so the arithmetic needs no special case).
 *      Otherwise scale = amax / qmax, raised by one ulp when scale * qmax < amax, so
 *      |x / scale| <= qmax for every x of the block and no code is clamped away
 *      (this matters for subnormal blocks, where amax / qmax loses most of its bits).
 *   3. code = round_half_even(x / scale), in [-qmax, qmax] (zx_q_encode_*).
 *   4. dequantized = (float) code * scale, one rounding (zx_q_decode_*): an error of
 *      at most scale / 2 plus the fp32 rounding of the division and the product.
 * Padding: a payload is whole blocks; codes past n are 0 (the receiver never reads
 * them). int4 codes are packed two per byte, low nibble first (block_numel even, so a
 * block starts on a byte). Nothing falls back to an unquantized path for any size.
 *
 * The block loop below is the same for every ISA; only the chunk kernels differ
 * (zx_quant_ref.c is the oracle). Work is done ZX_QUANT_CHUNK elements at a time
 * through stack buffers, so a block of any size needs no allocation.
 * Build/test: make -C csrc/core test
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "zx_quant_internal.h"

/* ------------------------------------------------------------------ block logic */

/* The quiet NaN written as the scale of a block with an inf/NaN (the GPU writes the same). */
#define ZX_QUANT_NAN_BITS 0x7fc00000u

typedef struct zx_quant_block {
    float scale;     /* what is stored and multiplies the codes */
    float divisor;   /* what the values are divided by (1 for an all-zero block) */
    int finite;      /* 0: inf/NaN in the block, codes all 0, scale NaN */
} zx_quant_block;

static float bits_to_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static uint32_t f32_to_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* Step 2 of Note [Blockwise quantization]. */
static zx_quant_block zx_quant_block_scale(uint32_t amax_bits, float qmax) {
    zx_quant_block blk;
    if (amax_bits >= 0x7f800000u) {             /* inf or NaN somewhere in the block */
        blk.scale = bits_to_f32(ZX_QUANT_NAN_BITS);
        blk.divisor = 0.0f;
        blk.finite = 0;
        return blk;
    }
    if (amax_bits == 0) {                       /* all zeros (either sign) */
        blk.scale = 0.0f;
        blk.divisor = 1.0f;
        blk.finite = 1;
        return blk;
    }
    float amax = bits_to_f32(amax_bits);
    float scale = amax / qmax;
    if (scale * qmax < amax)                    /* rounded down (or to 0): one ulp up */
        scale = bits_to_f32(f32_to_bits(scale) + 1u);
    blk.scale = scale;
    blk.divisor = scale;
    blk.finite = 1;
    return blk;
}

static int valid_format(int32_t bits, size_t block_numel) {
    if (block_numel == 0) return 0;
    if (bits == 8) return 1;
    if (bits == 4) return block_numel % 2 == 0;   /* blocks start on a byte */
    return 0;
}

static float qmax_of(int32_t bits) { return bits == 8 ? 127.0f : 7.0f; }

/* Bytes of codes of one whole block. */
static size_t block_bytes(int32_t bits, size_t block_numel) {
    return bits == 8 ? block_numel : block_numel / 2;
}

static int valid_dtype(zx_dtype d) { return d == ZX_F32 || d == ZX_BF16 || d == ZX_F16; }

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------ dispatch */

static uint32_t absmax_isa(zx_isa isa, size_t n, const float *x) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: return zx_q_absmax_avx512(n, x);
    case ZX_ISA_AVX2: return zx_q_absmax_avx2(n, x);
#endif
    default: return zx_q_absmax_ref(n, x);
    }
}

static void encode_isa(zx_isa isa, size_t n, const float *x, const zx_quant_block *blk,
                       float qmax, int8_t *q, float *residual) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_q_encode_avx512(n, x, blk->divisor, qmax, blk->scale, q, residual); return;
    case ZX_ISA_AVX2: zx_q_encode_avx2(n, x, blk->divisor, qmax, blk->scale, q, residual); return;
#endif
    default: zx_q_encode_ref(n, x, blk->divisor, qmax, blk->scale, q, residual); return;
    }
}

static void decode_isa(zx_isa isa, size_t n, const int8_t *q, float scale, float *y,
                       int32_t accumulate) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_q_decode_avx512(n, q, scale, y, accumulate); return;
    case ZX_ISA_AVX2: zx_q_decode_avx2(n, q, scale, y, accumulate); return;
#endif
    default: zx_q_decode_ref(n, q, scale, y, accumulate); return;
    }
}

/* ------------------------------------------------------------------ chunks */

/* Elements [lo, lo + len) of src as fp32, plus residual[lo + i] when residual is not
 * NULL: a pointer into src itself when it is fp32 and there is nothing to add, else
 * buf (len <= ZX_QUANT_CHUNK) filled with the exact conversion (+ one fp32 add). */
static const float *load_chunk(zx_isa isa, const void *src, zx_dtype dtype, size_t lo,
                               size_t len, const float *residual, float *buf) {
    if (dtype == ZX_F32) {
        const float *x = (const float *)src + lo;
        if (!residual) return x;
        for (size_t i = 0; i < len; i++) buf[i] = x[i] + residual[lo + i];
        return buf;
    }
    zx_cast_to_f32(isa, len, (const uint16_t *)src + lo, dtype, buf);  /* cannot fail here */
    if (residual)
        for (size_t i = 0; i < len; i++) buf[i] = buf[i] + residual[lo + i];
    return buf;
}

/* int4: codes[k] (k < len) into nibbles at out (element 2m -> low nibble of out[m]);
 * an odd len pads the last high nibble with 0. */
static void pack_int4(const int8_t *codes, size_t len, uint8_t *out) {
    for (size_t k = 0; k < len; k += 2) {
        uint8_t lo = (uint8_t)(codes[k] & 0x0f);
        uint8_t hi = (uint8_t)(k + 1 < len ? codes[k + 1] & 0x0f : 0);
        out[k / 2] = (uint8_t)(lo | (hi << 4));
    }
}

/* int4: len codes from nibbles at in, sign-extended from 4 bits. */
static void unpack_int4(const uint8_t *in, size_t len, int8_t *codes) {
    for (size_t k = 0; k < len; k++) {
        int v = (k & 1) ? in[k / 2] >> 4 : in[k / 2] & 0x0f;
        codes[k] = (int8_t)(v >= 8 ? v - 16 : v);
    }
}

/* ------------------------------------------------------------------ entry points */

size_t zx_quant_blocks(size_t n, size_t block_numel) {
    if (block_numel == 0) return 0;
    return n / block_numel + (n % block_numel != 0);
}

zx_status zx_quant_bytes(int32_t bits, size_t block_numel, size_t n, size_t *bytes) {
    if (!bytes || !valid_format(bits, block_numel)) return ZX_ERR_INVALID_ARG;
    size_t nblocks = zx_quant_blocks(n, block_numel);
    if (nblocks && block_numel > SIZE_MAX / nblocks) return ZX_ERR_OVERFLOW;
    *bytes = nblocks * block_bytes(bits, block_numel);
    return ZX_OK;
}

zx_status zx_quantize(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                      const void *src, zx_dtype src_dtype, float *residual,
                      void *q, float *scales) {
    if (!valid_format(bits, block_numel) || !valid_dtype(src_dtype)) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    size_t total_bytes;
    zx_status st = zx_quant_bytes(bits, block_numel, n, &total_bytes);
    if (st != ZX_OK) return st;
    if (n == 0) return ZX_OK;
    if (!src || !q || !scales) return ZX_ERR_INVALID_ARG;

    const float qmax = qmax_of(bits);
    const size_t nblocks = zx_quant_blocks(n, block_numel);
    const size_t bbytes = block_bytes(bits, block_numel);
    float buf[ZX_QUANT_CHUNK];
    int8_t codes[ZX_QUANT_CHUNK];
    for (size_t b = 0; b < nblocks; b++) {
        const size_t lo = b * block_numel;
        const size_t len = min_size(block_numel, n - lo);
        uint8_t *qb = (uint8_t *)q + b * bbytes;
        /* pass 1: the block's amax */
        uint32_t amax_bits = 0;
        for (size_t c = 0; c < len; c += ZX_QUANT_CHUNK) {
            size_t cl = min_size(ZX_QUANT_CHUNK, len - c);
            const float *x = load_chunk(isa, src, src_dtype, lo + c, cl, residual, buf);
            uint32_t a = absmax_isa(isa, cl, x);
            if (a > amax_bits) amax_bits = a;
        }
        zx_quant_block blk = zx_quant_block_scale(amax_bits, qmax);
        scales[b] = blk.scale;
        if (!blk.finite) {
            memset(qb, 0, bbytes);
            continue;
        }
        /* pass 2: codes (and the new residual) */
        for (size_t c = 0; c < len; c += ZX_QUANT_CHUNK) {
            size_t cl = min_size(ZX_QUANT_CHUNK, len - c);
            const float *x = load_chunk(isa, src, src_dtype, lo + c, cl, residual, buf);
            float *r = residual ? residual + lo + c : NULL;
            if (bits == 8) {
                encode_isa(isa, cl, x, &blk, qmax, (int8_t *)qb + c, r);
            } else {
                encode_isa(isa, cl, x, &blk, qmax, codes, r);
                pack_int4(codes, cl, qb + c / 2);
            }
        }
        /* padding of a partial last block */
        size_t used = bits == 8 ? len : (len + 1) / 2;
        if (used < bbytes) memset(qb + used, 0, bbytes - used);
    }
    return ZX_OK;
}

/* The codes of elements [c, c + cl) of the block at qb, as int8: a pointer into qb
 * (int8) or `codes` filled from the nibbles (int4; c is even). */
static const int8_t *block_codes(int32_t bits, const uint8_t *qb, size_t c, size_t cl,
                                 int8_t *codes) {
    if (bits == 8) return (const int8_t *)qb + c;
    unpack_int4(qb + c / 2, cl, codes);
    return codes;
}

zx_status zx_dequantize(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                        const void *q, const float *scales, void *dst, zx_dtype dst_dtype) {
    if (!valid_format(bits, block_numel) || !valid_dtype(dst_dtype)) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    size_t total_bytes;
    zx_status st = zx_quant_bytes(bits, block_numel, n, &total_bytes);
    if (st != ZX_OK) return st;
    if (n == 0) return ZX_OK;
    if (!q || !scales || !dst) return ZX_ERR_INVALID_ARG;

    const size_t nblocks = zx_quant_blocks(n, block_numel);
    const size_t bbytes = block_bytes(bits, block_numel);
    float buf[ZX_QUANT_CHUNK];
    int8_t codes[ZX_QUANT_CHUNK];
    for (size_t b = 0; b < nblocks; b++) {
        const size_t lo = b * block_numel;
        const size_t len = min_size(block_numel, n - lo);
        const uint8_t *qb = (const uint8_t *)q + b * bbytes;
        for (size_t c = 0; c < len; c += ZX_QUANT_CHUNK) {
            size_t cl = min_size(ZX_QUANT_CHUNK, len - c);
            const int8_t *k = block_codes(bits, qb, c, cl, codes);
            if (dst_dtype == ZX_F32) {
                decode_isa(isa, cl, k, scales[b], (float *)dst + lo + c, 0);
            } else {
                decode_isa(isa, cl, k, scales[b], buf, 0);
                zx_cast_from_f32(isa, cl, buf, (uint16_t *)dst + lo + c, dst_dtype);
            }
        }
    }
    return ZX_OK;
}

zx_status zx_dequantize_sum(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                            int32_t nslices, size_t slice_blocks, const void *q,
                            const float *scales, float *dst, int32_t accumulate, float scale) {
    if (!valid_format(bits, block_numel) || nslices < 1) return ZX_ERR_INVALID_ARG;
    if (!zx_cpu_supports(isa)) return ZX_ERR_UNSUPPORTED;
    const size_t nblocks = zx_quant_blocks(n, block_numel);
    if (slice_blocks < nblocks) return ZX_ERR_INVALID_ARG;
    const size_t bbytes = block_bytes(bits, block_numel);
    if (slice_blocks && (size_t)nslices > SIZE_MAX / slice_blocks / bbytes) return ZX_ERR_OVERFLOW;
    if (n == 0) return ZX_OK;
    if (!q || !scales || !dst) return ZX_ERR_INVALID_ARG;

    float buf[ZX_QUANT_CHUNK];
    int8_t codes[ZX_QUANT_CHUNK];
    for (size_t b = 0; b < nblocks; b++) {
        const size_t lo = b * block_numel;
        const size_t len = min_size(block_numel, n - lo);
        for (size_t c = 0; c < len; c += ZX_QUANT_CHUNK) {
            size_t cl = min_size(ZX_QUANT_CHUNK, len - c);
            for (int32_t j = 0; j < nslices; j++) {
                size_t blk = (size_t)j * slice_blocks + b;   /* block b of slice j */
                const uint8_t *qb = (const uint8_t *)q + blk * bbytes;
                const int8_t *k = block_codes(bits, qb, c, cl, codes);
                decode_isa(isa, cl, k, scales[blk], buf, j > 0);  /* fp32 running sum */
            }
            /* dst = (accumulate ? dst : 0) + scale * sum: zx_sum_slices of one slice */
            zx_sum_slices(isa, cl, 1, buf, dst + lo + c, accumulate, scale);
        }
    }
    return ZX_OK;
}
