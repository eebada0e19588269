/* test_quant.c — blockwise int8/int4 quantization (zx_quant*.c), under ASan + UBSan.
 *
 * For bits 8 and 4, block sizes around the vector widths and the chunk size, lengths
 * that are not multiples of anything (0, 1, odd, longer than a chunk), fp32/bf16/fp16
 * inputs and outputs, and pointers offset by one element (codes: by one byte):
 *   - the scalar path against an oracle written here from the spec (Note [Blockwise
 *     quantization] in zx_quant.c): the same scales bit for bit, the same codes, and
 *     every dequantized element within half a step of its block (+ fp32 rounding);
 *   - every SIMD ISA this CPU has against the scalar path: codes, scales, residuals and
 *     dequantized outputs bit for bit (Note [Bit-exact SIMD]);
 *   - padding codes are 0; all-zero blocks give scale 0; a block with an inf or NaN gives
 *     a NaN scale and NaN for every dequantized element of that block only (so an fp16
 *     overflow still reaches the inf/nan scan), and leaves its residual alone;
 *   - subnormal blocks keep the half-step bound (the scale's one-ulp raise);
 *   - error feedback: residual' = (x + residual) - dequantized, exactly;
 *   - dequantize_sum equals zx_sum_slices of the dequantized slices bit for bit, also
 *     when split into ranges of whole blocks with slice_blocks > the range's blocks;
 *   - bad arguments give the documented status codes.
 *
 * Run: make -C csrc/core test
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zx_core.h"
#include "zx_kernels_internal.h"

#include "check.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint32_t rnd_u32(void) {  /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545f4914f6cdd1dull) >> 32);
}
static float rnd_sym(void) { return 2.0f * ((float)(rnd_u32() >> 8) * 0x1p-24f) - 1.0f; }

static uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static zx_isa g_isas[3];
static int g_num_isas;   /* SIMD ISAs this CPU supports */

static const size_t k_blocks[] = {2, 6, 32, 100, 1024, 3000};
static const size_t k_lengths[] = {0, 1, 7, 31, 33, 1000, 3001, 5001};
#define NUM(a) (sizeof a / sizeof a[0])

/* x as dtype (bf16/fp16 through the reference rounding), written at dst[i] */
static void put(void *dst, zx_dtype d, size_t i, float x) {
    if (d == ZX_F32) ((float *)dst)[i] = x;
    else if (d == ZX_BF16) ((uint16_t *)dst)[i] = zx_f32_to_bf16_ref(x);
    else ((uint16_t *)dst)[i] = zx_f32_to_f16_ref(x);
}
static float get(const void *src, zx_dtype d, size_t i) {
    if (d == ZX_F32) return ((const float *)src)[i];
    if (d == ZX_BF16) return zx_bf16_to_f32_ref(((const uint16_t *)src)[i]);
    return zx_f16_to_f32_ref(((const uint16_t *)src)[i]);
}

/* code of element i of a payload (int8 or packed int4) */
static int code_at(const uint8_t *q, int bits, size_t i) {
    if (bits == 8) return (int8_t)q[i];
    int v = (i & 1) ? q[i / 2] >> 4 : q[i / 2] & 0x0f;
    return v >= 8 ? v - 16 : v;
}

/* The spec's scale of a finite block with largest |x| = amax. */
static float spec_scale(float amax, float qmax) {
    if (amax == 0.0f) return 0.0f;
    float s = amax / qmax;
    if (s * qmax < amax) s = nextafterf(s, INFINITY);
    return s;
}

/* ------------------------------------------------------------------ random inputs */
/* Values of a few magnitudes per block, sometimes an all-zero block, a subnormal one. */
static void fill(float *x, size_t n, size_t block) {
    for (size_t lo = 0; lo < n; lo += block) {
        size_t len = n - lo < block ? n - lo : block;
        uint32_t kind = rnd_u32() % 8;
        float mag = kind == 0 ? 0.0f : kind == 1 ? 1e-40f : kind == 2 ? 3e4f : 0.01f + (float)(rnd_u32() % 100);
        for (size_t i = 0; i < len; i++) x[lo + i] = mag * rnd_sym();
    }
}

/* ------------------------------------------------------------------ quantize / dequantize */
static void test_roundtrip(int bits, size_t block, size_t n, zx_dtype dt, size_t mis) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    size_t qbytes = 0, nb = zx_quant_blocks(n, block);
    CHECK(zx_quant_bytes(bits, block, n, &qbytes) == ZX_OK, "bytes");
    CHECK(qbytes == nb * block * (size_t)bits / 8, "qbytes %zu", qbytes);
    size_t esz = zx_dtype_size(dt);
    char *src_base = malloc((n + 1) * esz + 1);
    void *src = src_base + mis * esz;
    float *x = malloc((n + 1) * sizeof(float));
    fill(x, n, block);
    for (size_t i = 0; i < n; i++) put(src, dt, i, x[i]);
    for (size_t i = 0; i < n; i++) x[i] = get(src, dt, i);   /* what the kernel sees */

    uint8_t *q[3];
    float *sc[3];
    void *out[3][3];   /* [isa slot][dst dtype] */
    int nslots = 1 + g_num_isas;
    for (int k = 0; k < nslots; k++) {
        zx_isa isa = k == 0 ? ZX_ISA_SCALAR : g_isas[k - 1];
        uint8_t *qbase = malloc(qbytes + 2);
        memset(qbase, 0xa5, qbytes + 2);   /* padding must be overwritten with 0 */
        q[k] = qbase + mis;
        sc[k] = malloc((nb + 1) * sizeof(float));
        zx_status s = zx_quantize(isa, bits, block, n, src, dt, NULL, q[k], sc[k]);
        CHECK(s == ZX_OK, "quantize %s status %d", zx_isa_name(isa), s);
        for (int d = 0; d < 3; d++) {
            char *ob = malloc((n + 1) * 4 + 4);
            out[k][d] = ob + mis * zx_dtype_size((zx_dtype)d);
            s = zx_dequantize(isa, bits, block, n, q[k], sc[k], out[k][d], (zx_dtype)d);
            CHECK(s == ZX_OK, "dequantize %s status %d", zx_isa_name(isa), s);
        }
    }
    /* the scalar path against the spec */
    size_t bad_scale = 0, bad_code = 0, bad_err = 0, bad_pad = 0, bad_cast = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * block, len = n - lo < block ? n - lo : block;
        float amax = 0.0f;
        for (size_t i = 0; i < len; i++) amax = fmaxf(amax, fabsf(x[lo + i]));
        float s = spec_scale(amax, qmax);
        bad_scale += f32_bits(sc[0][b]) != f32_bits(s);
        for (size_t i = 0; i < len; i++) {
            float xi = x[lo + i];
            int want = amax == 0.0f ? 0 : (int)nearbyintf(xi / s);
            int got = code_at(q[0], bits, lo + i);
            bad_code += got != want || got > (int)qmax || got < -(int)qmax;
            float deq = ((float *)out[0][ZX_F32])[lo + i];
            bad_err += !(fabs((double)xi - (double)deq) <=
                         0.5 * s * (1.0 + 0x1p-20) + fabs(xi) * 0x1p-23 + FLT_TRUE_MIN);
            bad_cast += f32_bits((float)got * s) != f32_bits(deq);
            bad_cast += zx_f32_to_bf16_ref(deq) != ((uint16_t *)out[0][ZX_BF16])[lo + i];
            bad_cast += zx_f32_to_f16_ref(deq) != ((uint16_t *)out[0][ZX_F16])[lo + i];
        }
        for (size_t i = len; i < block; i++) bad_pad += code_at(q[0], bits, lo + i) != 0;
    }
    CHECK(!bad_scale && !bad_code && !bad_err && !bad_pad && !bad_cast,
          "spec bits=%d block=%zu n=%zu dtype=%d mis=%zu: scales %zu codes %zu error %zu padding %zu "
          "dequantized %zu wrong", bits, block, n, (int)dt, mis, bad_scale, bad_code, bad_err,
          bad_pad, bad_cast);
    CHECK(q[0][qbytes] == 0xa5, "quantize wrote past the payload");
    /* every ISA against the scalar path, bit for bit */
    for (int k = 1; k < nslots; k++) {
        int same = memcmp(q[0], q[k], qbytes) == 0 && memcmp(sc[0], sc[k], nb * sizeof(float)) == 0;
        for (int d = 0; d < 3; d++)
            same = same && memcmp(out[0][d], out[k][d], n * zx_dtype_size((zx_dtype)d)) == 0;
        CHECK(same, "%s differs from scalar: bits=%d block=%zu n=%zu dtype=%d mis=%zu",
              zx_isa_name(g_isas[k - 1]), bits, block, n, (int)dt, mis);
    }
    for (int k = 0; k < nslots; k++) {
        free(q[k] - mis);
        free(sc[k]);
        for (int d = 0; d < 3; d++) free((char *)out[k][d] - mis * zx_dtype_size((zx_dtype)d));
    }
    free(src_base);
    free(x);
}

/* ------------------------------------------------------------------ ties */
/* Values at and next to the half-way points between codes, where x / scale and
 * x * (1 / scale) round differently: every ISA must divide, as the reference does. */
static void test_ties(int bits) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const size_t block = 256, n = 64 * block;
    float *x = malloc(n * 4);
    for (size_t lo = 0; lo < n; lo += block) {
        float s0 = 0.5f + (float)(rnd_u32() >> 8) * 0x1p-24f;   /* a random mantissa */
        float amax = s0 * qmax;
        float s = spec_scale(amax, qmax);
        x[lo] = amax;
        for (size_t i = 1; i < block; i++) {
            float m = (float)(int)(rnd_u32() % (uint32_t)qmax) + 0.5f;
            float t = m * s;                                  /* near a tie */
            uint32_t k = rnd_u32() % 3;
            if (k == 1) t = nextafterf(t, INFINITY);
            if (k == 2) t = nextafterf(t, 0.0f);
            x[lo + i] = (rnd_u32() & 1) ? -t : t;
        }
    }
    size_t qbytes = 0, nb = n / block;
    zx_quant_bytes(bits, block, n, &qbytes);
    uint8_t *q[3];
    float *sc[3];
    for (int k = 0; k <= g_num_isas; k++) {
        zx_isa isa = k == 0 ? ZX_ISA_SCALAR : g_isas[k - 1];
        q[k] = malloc(qbytes);
        sc[k] = malloc(nb * 4);
        CHECK(zx_quantize(isa, bits, block, n, x, ZX_F32, NULL, q[k], sc[k]) == ZX_OK, "ties");
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            bad += code_at(q[k], bits, i) != (int)nearbyintf(x[i] / sc[k][i / block]);
        CHECK(bad == 0, "%s ties bits=%d: %zu codes are not round_half_even(x / scale)",
              zx_isa_name(isa), bits, bad);
        if (k > 0) CHECK(memcmp(q[0], q[k], qbytes) == 0, "%s ties differ from scalar",
                         zx_isa_name(isa));
    }
    for (int k = 0; k <= g_num_isas; k++) { free(q[k]); free(sc[k]); }
    free(x);
}

/* ------------------------------------------------------------------ inf / nan / zero */
static void test_special_blocks(int bits) {
    const size_t block = 8, n = 40;   /* 5 blocks: normal, inf, nan, zero, -inf + normal */
    float x[40];
    for (size_t i = 0; i < n; i++) x[i] = rnd_sym();
    x[8 + 3] = INFINITY;
    x[16 + 5] = NAN;
    for (size_t i = 24; i < 32; i++) x[i] = (i & 1) ? -0.0f : 0.0f;
    x[39] = -INFINITY;
    for (int k = 0; k <= g_num_isas; k++) {
        zx_isa isa = k == 0 ? ZX_ISA_SCALAR : g_isas[k - 1];
        uint8_t q[40];
        float sc[5], y[40], r[40], r0[40];
        for (size_t i = 0; i < n; i++) r[i] = r0[i] = 1e-3f * rnd_sym();
        for (size_t i = 24; i < 32; i++) r[i] = r0[i] = 0.0f;
        CHECK(zx_quantize(isa, bits, block, n, x, ZX_F32, r, q, sc) == ZX_OK, "quantize");
        CHECK(zx_dequantize(isa, bits, block, n, q, sc, y, ZX_F32) == ZX_OK, "dequantize");
        CHECK(isfinite(sc[0]) && sc[0] > 0, "%s normal block scale %g", zx_isa_name(isa), sc[0]);
        CHECK(isnan(sc[1]) && isnan(sc[2]) && isnan(sc[4]), "%s inf/nan blocks have NaN scales",
              zx_isa_name(isa));
        CHECK(sc[3] == 0.0f, "%s zero block scale %g", zx_isa_name(isa), sc[3]);
        size_t nan_ok = 0, zero_ok = 0, res_kept = 0;
        for (size_t i = 8; i < 24; i++) nan_ok += isnan(y[i]) != 0;
        for (size_t i = 32; i < 40; i++) nan_ok += isnan(y[i]) != 0;
        for (size_t i = 24; i < 32; i++) zero_ok += y[i] == 0.0f && r[i] == 0.0f;
        for (size_t i = 8; i < 24; i++) res_kept += f32_bits(r[i]) == f32_bits(r0[i]);
        for (size_t i = 32; i < 40; i++) res_kept += f32_bits(r[i]) == f32_bits(r0[i]);
        CHECK(nan_ok == 24, "%s: %zu of 24 elements of inf/nan blocks dequantize to NaN",
              zx_isa_name(isa), nan_ok);
        CHECK(zero_ok == 8, "%s: zero block", zx_isa_name(isa));
        CHECK(res_kept == 24, "%s: inf/nan blocks keep their residual", zx_isa_name(isa));
        size_t fin = 0;
        for (size_t i = 0; i < 8; i++) fin += isfinite(y[i]) != 0;
        CHECK(fin == 8, "%s: the finite block stays finite", zx_isa_name(isa));
        /* the inf/nan scan of the dequantized gradient sees the overflow */
        double sumsq = 0.0;
        int64_t nonfinite = 0;
        CHECK(zx_grad_sumsq(isa, n, y, 1.0f, &sumsq, &nonfinite) == ZX_OK && nonfinite == 24,
              "%s: grad_sumsq counts %lld non-finite", zx_isa_name(isa), (long long)nonfinite);
        /* and so does the all-to-all sum */
        float dst[40];
        CHECK(zx_dequantize_sum(isa, bits, block, n, 1, 5, q, sc, dst, 0, 0.5f) == ZX_OK, "sum");
        nan_ok = 0;
        for (size_t i = 8; i < 24; i++) nan_ok += isnan(dst[i]) != 0;
        CHECK(nan_ok == 16, "%s: dequantize_sum propagates NaN", zx_isa_name(isa));
    }
}

/* bf16/fp16 inputs with inf: the same NaN scale (an fp16 overflow is an inf in fp16). */
static void test_lowp_inf(void) {
    uint16_t h[10];
    for (int i = 0; i < 10; i++) h[i] = zx_f32_to_f16_ref(0.1f * (float)i);
    h[7] = 0x7c00;   /* +inf */
    uint8_t q[10];
    float sc[2], y[10];
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 5, 10, h, ZX_F16, NULL, q, sc) == ZX_OK, "f16 quantize");
    CHECK(zx_dequantize(ZX_ISA_SCALAR, 8, 5, 10, q, sc, y, ZX_F32) == ZX_OK, "f16 dequantize");
    CHECK(isfinite(sc[0]) && isnan(sc[1]) && isnan(y[5]) && isnan(y[9]) && isfinite(y[4]),
          "fp16 inf block");
}

/* Subnormal blocks: the step is tiny but the half-step bound still holds. */
static void test_subnormal(void) {
    for (int bits = 4; bits <= 8; bits += 4) {
        for (uint32_t top = 1; top < 400; top += 7) {
            float x[6];
            for (int i = 0; i < 6; i++) x[i] = bits_f32((uint32_t)(rnd_u32() % (top + 1)));
            x[5] = bits_f32(top);   /* amax = top * 2^-149 */
            uint8_t q[6];
            float sc[1], y[6];
            zx_quantize(ZX_ISA_SCALAR, bits, 6, 6, x, ZX_F32, NULL, q, sc);
            zx_dequantize(ZX_ISA_SCALAR, bits, 6, 6, q, sc, y, ZX_F32);
            size_t bad = 0;
            for (int i = 0; i < 6; i++) bad += !(fabs((double)x[i] - (double)y[i]) <= 0.5 * sc[0]);
            CHECK(bad == 0, "subnormal bits=%d amax=%u*2^-149: %zu elements off by more than "
                  "half a step (scale %g)", bits, top, bad, sc[0]);
        }
    }
}

/* ------------------------------------------------------------------ error feedback */
static void test_error_feedback(int bits, zx_dtype dt) {
    const size_t block = 64, n = 1000;
    size_t nb = zx_quant_blocks(n, block), qbytes = 0;
    zx_quant_bytes(bits, block, n, &qbytes);
    float *x = malloc(n * 4), *r[3], *y = malloc(n * 4), *sum = malloc(n * 4);
    uint16_t *src = malloc(n * 2);
    uint8_t *q[3];
    float *sc[3];
    fill(x, n, block);
    if (dt != ZX_F32)
        for (size_t i = 0; i < n; i++) put(src, dt, i, x[i]);
    const void *in = dt == ZX_F32 ? (const void *)x : (const void *)src;
    for (int k = 0; k <= g_num_isas; k++) {
        zx_isa isa = k == 0 ? ZX_ISA_SCALAR : g_isas[k - 1];
        r[k] = malloc(n * 4);
        q[k] = malloc(qbytes);
        sc[k] = malloc(nb * 4);
        for (size_t i = 0; i < n; i++) r[k][i] = 0.0f;
        for (int step = 0; step < 3; step++) {
            for (size_t i = 0; i < n; i++) sum[i] = get(in, dt, i) + r[k][i];   /* what is sent */
            CHECK(zx_quantize(isa, bits, block, n, in, dt, r[k], q[k], sc[k]) == ZX_OK, "ef");
            zx_dequantize(isa, bits, block, n, q[k], sc[k], y, ZX_F32);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++) bad += f32_bits(r[k][i]) != f32_bits(sum[i] - y[i]);
            CHECK(bad == 0, "%s ef bits=%d dtype=%d step %d: %zu residuals != (x + r) - deq",
                  zx_isa_name(isa), bits, (int)dt, step, bad);
        }
        if (k > 0) {
            CHECK(memcmp(r[0], r[k], n * 4) == 0 && memcmp(q[0], q[k], qbytes) == 0,
                  "%s ef differs from scalar", zx_isa_name(isa));
        }
    }
    for (int k = 0; k <= g_num_isas; k++) { free(r[k]); free(q[k]); free(sc[k]); }
    free(x); free(y); free(sum); free(src);
}

/* ------------------------------------------------------------------ dequantize_sum */
static void test_dequantize_sum(int bits, size_t block, size_t n, int32_t nslices, int accumulate) {
    size_t nb = zx_quant_blocks(n, block), bb = block * (size_t)bits / 8;
    size_t slice_blocks = nb + 1;   /* a gap after each slice: the stride is respected */
    uint8_t *q = calloc(nslices * slice_blocks * bb + 1, 1);
    float *sc = calloc(nslices * slice_blocks, 4);
    float *x = malloc((n + 1) * 4), *deq = malloc(nslices * (n + 1) * 4);
    for (int32_t j = 0; j < nslices; j++) {
        fill(x, n, block);
        zx_quantize(ZX_ISA_SCALAR, bits, block, n, x, ZX_F32, NULL, q + j * slice_blocks * bb,
                    sc + j * slice_blocks);
        zx_dequantize(ZX_ISA_SCALAR, bits, block, n, q + j * slice_blocks * bb,
                      sc + j * slice_blocks, deq + j * n, ZX_F32);
    }
    float *want = malloc((n + 1) * 4), *init = malloc((n + 1) * 4);
    for (size_t i = 0; i < n; i++) want[i] = init[i] = rnd_sym();
    zx_sum_slices(ZX_ISA_SCALAR, n, nslices, deq, want, accumulate, 0.25f);
    for (int k = 0; k <= g_num_isas; k++) {
        zx_isa isa = k == 0 ? ZX_ISA_SCALAR : g_isas[k - 1];
        float *got = malloc((n + 1) * 4);
        memcpy(got, init, n * 4);
        /* in two ranges of whole blocks, as a threaded caller would */
        size_t split = (nb / 2) * block;
        zx_status s0 = zx_dequantize_sum(isa, bits, block, split, nslices, slice_blocks, q, sc,
                                         got, accumulate, 0.25f);
        zx_status s1 = zx_dequantize_sum(isa, bits, block, n - split, nslices, slice_blocks,
                                         q + (split / block) * bb, sc + split / block,
                                         got + split, accumulate, 0.25f);
        CHECK(s0 == ZX_OK && s1 == ZX_OK, "dequantize_sum status %d %d", s0, s1);
        CHECK(memcmp(got, want, n * 4) == 0,
              "%s dequantize_sum bits=%d block=%zu n=%zu slices=%d acc=%d != sum_slices of the "
              "dequantized slices", zx_isa_name(isa), bits, block, n, nslices, accumulate);
        free(got);
    }
    free(q); free(sc); free(x); free(deq); free(want); free(init);
}

/* ------------------------------------------------------------------ errors */
static void test_errors(void) {
    float x[4] = {1, 2, 3, 4}, sc[4], y[4];
    uint8_t q[8];
    size_t bytes;
    CHECK(zx_quant_bytes(3, 4, 4, &bytes) == ZX_ERR_INVALID_ARG, "bits 3");
    CHECK(zx_quant_bytes(4, 3, 4, &bytes) == ZX_ERR_INVALID_ARG, "int4 odd block");
    CHECK(zx_quant_bytes(8, 0, 4, &bytes) == ZX_ERR_INVALID_ARG, "block 0");
    CHECK(zx_quant_bytes(8, 4, 4, NULL) == ZX_ERR_INVALID_ARG, "NULL bytes");
    CHECK(zx_quant_bytes(8, SIZE_MAX / 2, SIZE_MAX, &bytes) == ZX_ERR_OVERFLOW, "overflow");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 16, 4, 4, x, ZX_F32, NULL, q, sc) == ZX_ERR_INVALID_ARG, "q16");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 4, 4, x, (zx_dtype)7, NULL, q, sc) == ZX_ERR_INVALID_ARG,
          "dtype");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 4, 4, NULL, ZX_F32, NULL, q, sc) == ZX_ERR_INVALID_ARG, "src");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 4, 4, x, ZX_F32, NULL, NULL, sc) == ZX_ERR_INVALID_ARG, "q");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 4, 4, x, ZX_F32, NULL, q, NULL) == ZX_ERR_INVALID_ARG, "sc");
    CHECK(zx_quantize(ZX_ISA_SCALAR, 8, 4, 0, NULL, ZX_F32, NULL, NULL, NULL) == ZX_OK, "n=0");
    CHECK(zx_quantize((zx_isa)9, 8, 4, 4, x, ZX_F32, NULL, q, sc) == ZX_ERR_UNSUPPORTED, "isa");
    CHECK(zx_dequantize(ZX_ISA_SCALAR, 8, 4, 4, q, sc, NULL, ZX_F32) == ZX_ERR_INVALID_ARG, "dst");
    CHECK(zx_dequantize(ZX_ISA_SCALAR, 4, 5, 4, q, sc, y, ZX_F32) == ZX_ERR_INVALID_ARG, "odd");
    CHECK(zx_dequantize_sum(ZX_ISA_SCALAR, 8, 4, 8, 2, 1, q, sc, y, 0, 1.0f) == ZX_ERR_INVALID_ARG,
          "slice_blocks < blocks");
    CHECK(zx_dequantize_sum(ZX_ISA_SCALAR, 8, 4, 4, 0, 1, q, sc, y, 0, 1.0f) == ZX_ERR_INVALID_ARG,
          "nslices 0");
    CHECK(zx_dequantize_sum(ZX_ISA_SCALAR, 8, 4, 4, 1, 1, NULL, sc, y, 0, 1.0f) == ZX_ERR_INVALID_ARG,
          "q NULL");
}

int main(void) {
    for (int isa = ZX_ISA_AVX2; isa <= ZX_ISA_AVX512; isa++)
        if (zx_cpu_supports((zx_isa)isa)) g_isas[g_num_isas++] = (zx_isa)isa;
    printf("test_quant: SIMD ISAs on this CPU:");
    for (int i = 0; i < g_num_isas; i++) printf(" %s", zx_isa_name(g_isas[i]));
    printf("%s\n", g_num_isas ? "" : " none (only the scalar path is checked)");

    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t bi = 0; bi < NUM(k_blocks); bi++)
            for (size_t li = 0; li < NUM(k_lengths); li++)
                for (int dt = 0; dt < 3; dt++)
                    for (size_t mis = 0; mis < 2; mis++)
                        test_roundtrip(bits, k_blocks[bi], k_lengths[li], (zx_dtype)dt, mis);
    test_roundtrip(8, 1, 17, ZX_F32, 1);   /* block of one element (int8 only) */
    test_roundtrip(8, 5, 17, ZX_BF16, 1);  /* odd block */
    for (int bits = 4; bits <= 8; bits += 4) {
        test_special_blocks(bits);
        test_ties(bits);
        for (int dt = 0; dt < 3; dt++) test_error_feedback(bits, (zx_dtype)dt);
        for (int acc = 0; acc < 2; acc++) {
            test_dequantize_sum(bits, 32, 1001, 3, acc);
            test_dequantize_sum(bits, 2048, 5000, 4, acc);
            test_dequantize_sum(bits, 6, 1, 1, acc);
        }
    }
    test_lowp_inf();
    test_subnormal();
    test_errors();

    printf("%ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
