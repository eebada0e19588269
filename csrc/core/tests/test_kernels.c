/* test_kernels.c — the CPU kernels against the scalar reference, under ASan + UBSan.
 *
 * Every ISA this CPU supports is run next to ZX_ISA_SCALAR (the reference) on the
 * same random data: lengths around the vector widths, pointers offset by one float,
 * every optimizer variant. Note [Bit-exact SIMD] promises identical fp32 results, so
 * fp32 outputs are compared with a tolerance of ZX_TEST_MAX_ULP = 0 ulps, and the
 * bf16/fp16 copies must equal the reference conversion of the SIMD fp32 result.
 * The reference conversions themselves are checked on known values and on every
 * 16-bit pattern. Also: bad arguments give the documented status codes.
 *
 * Run: make -C csrc/core test   (prints "N passed, N failed"; exit 1 on failure)
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zx_core.h"
#include "zx_kernels_internal.h"

#include "check.h"

#define ZX_TEST_MAX_ULP 0

/* ------------------------------------------------------------------ helpers */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd_u32(void) {  /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545f4914f6cdd1dull) >> 32);
}
static float rnd_unit(void) { return (float)(rnd_u32() >> 8) * 0x1p-24f; }   /* [0, 1) */
static float rnd_sym(void) { return 2.0f * rnd_unit() - 1.0f; }            /* [-1, 1) */

static uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* ulps between two floats (0 when bit-equal or both NaN; huge when one is NaN) */
static int64_t ulp_dist(float a, float b) {
    if (isnan(a) || isnan(b)) return (isnan(a) && isnan(b)) ? 0 : INT64_MAX;
    int64_t ia = (int32_t)f32_bits(a), ib = (int32_t)f32_bits(b);
    if (ia < 0) ia = INT32_MIN - ia;   /* map sign-magnitude to a monotone line */
    if (ib < 0) ib = INT32_MIN - ib;
    return ia > ib ? ia - ib : ib - ia;
}

/* number of elements further apart than max_ulp; *first gets the first such index */
static size_t count_ulp_diff(const float *a, const float *b, size_t n, int64_t max_ulp,
                             size_t *first) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (ulp_dist(a[i], b[i]) > max_ulp) {
            if (!bad) *first = i;
            bad++;
        }
    }
    return bad;
}

static size_t count_u16_diff(const uint16_t *a, const uint16_t *b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += a[i] != b[i];
    return bad;
}

/* an fp32 array of n elements starting `mis` floats into a fresh allocation */
typedef struct buf { float *base; float *p; } buf;
static buf buf_new(size_t n, size_t mis) {
    buf b;
    b.base = (float *)malloc((n + mis + 1) * sizeof(float));
    b.p = b.base + mis;
    return b;
}
static void buf_copy(buf *dst, const buf *src, size_t n) { memcpy(dst->p, src->p, n * sizeof(float)); }

static const size_t k_lengths[] = {0, 1, 7, 15, 16, 17, 31, 33, 63, 65, 1000, 4097};
#define NUM_LENGTHS (sizeof k_lengths / sizeof k_lengths[0])

static zx_isa g_isas[3];
static int g_num_isas;   /* SIMD ISAs this CPU supports */

/* ------------------------------------------------------------------ Adam */
static void test_adam(void) {
    for (int ii = 0; ii < g_num_isas; ii++) {
        zx_isa isa = g_isas[ii];
        for (size_t li = 0; li < NUM_LENGTHS; li++) {
            for (size_t mis = 0; mis < 2; mis++) {
                for (int cfg = 0; cfg < 32; cfg++) {
                    size_t n = k_lengths[li];
                    zx_adam_hparams hp = {
                        .lr = 1e-3, .beta1 = (cfg & 16) ? 0.3 : 0.9, .beta2 = 0.999,
                        .eps = 1e-8, .weight_decay = (cfg & 8) ? 0.1 : 0.0, .step = 1,
                        .decoupled = cfg & 1, .amsgrad = (cfg >> 1) & 1,
                        .maximize = (cfg >> 2) & 1,
                        .grad_scale = (cfg + (int)li) % 3 == 0 ? 0.37f : 1.0f};
                    zx_dtype lp_dtype = (zx_dtype)((cfg + (int)li) % 3); /* F32 = none */
                    buf p[2], g = buf_new(n, mis), m[2], v[2], vm[2];
                    uint16_t *lp[2];
                    for (int k = 0; k < 2; k++) {
                        p[k] = buf_new(n, mis); m[k] = buf_new(n, mis);
                        v[k] = buf_new(n, mis); vm[k] = buf_new(n, mis);
                        lp[k] = (uint16_t *)malloc((n + 1) * sizeof(uint16_t)) ;
                    }
                    for (size_t i = 0; i < n; i++) {
                        p[0].p[i] = rnd_sym();
                        m[0].p[i] = 0.01f * rnd_sym();
                        v[0].p[i] = 1e-4f * rnd_unit();
                        vm[0].p[i] = (rnd_u32() & 1) ? v[0].p[i] * 2.0f : 0.0f;
                    }
                    buf_copy(&p[1], &p[0], n); buf_copy(&m[1], &m[0], n);
                    buf_copy(&v[1], &v[0], n); buf_copy(&vm[1], &vm[0], n);
                    int ok = 1;
                    for (int64_t step = 1; step <= 3 && ok; step++) {
                        for (size_t i = 0; i < n; i++) g.p[i] = 0.1f * rnd_sym();
                        hp.step = step;
                        void *lp0 = lp_dtype == ZX_F32 ? NULL : lp[0];
                        void *lp1 = lp_dtype == ZX_F32 ? NULL : lp[1];
                        zx_status s0 = zx_adam_step(ZX_ISA_SCALAR, n, p[0].p, g.p, m[0].p, v[0].p,
                                                    vm[0].p, lp0, lp_dtype, &hp);
                        zx_status s1 = zx_adam_step(isa, n, p[1].p, g.p, m[1].p, v[1].p,
                                                    vm[1].p, lp1, lp_dtype, &hp);
                        CHECK(s0 == ZX_OK && s1 == ZX_OK, "adam status %d %d", s0, s1);
                        size_t first = 0, dp, dm, dv, dvm = 0;
                        dp = count_ulp_diff(p[0].p, p[1].p, n, ZX_TEST_MAX_ULP, &first);
                        dm = count_ulp_diff(m[0].p, m[1].p, n, ZX_TEST_MAX_ULP, &first);
                        dv = count_ulp_diff(v[0].p, v[1].p, n, ZX_TEST_MAX_ULP, &first);
                        if (hp.amsgrad)
                            dvm = count_ulp_diff(vm[0].p, vm[1].p, n, ZX_TEST_MAX_ULP, &first);
                        ok = !(dp || dm || dv || dvm);
                        CHECK(ok, "adam %s n=%zu mis=%zu cfg=%d step=%lld: %zu/%zu/%zu/%zu "
                              "elements differ (p/m/v/vmax), first at %zu",
                              zx_isa_name(isa), n, mis, cfg, (long long)step, dp, dm, dv, dvm,
                              first);
                        if (lp_dtype != ZX_F32) {
                            size_t bad = 0;
                            for (size_t i = 0; i < n; i++) {
                                uint16_t want = lp_dtype == ZX_BF16 ? zx_f32_to_bf16_ref(p[1].p[i])
                                                                    : zx_f32_to_f16_ref(p[1].p[i]);
                                bad += lp[1][i] != want;
                            }
                            CHECK(bad == 0, "adam %s n=%zu cfg=%d: %zu low-precision copies differ",
                                  zx_isa_name(isa), n, cfg, bad);
                        }
                    }
                    free(g.base);
                    for (int k = 0; k < 2; k++) {
                        free(p[k].base); free(m[k].base); free(v[k].base); free(vm[k].base);
                        free(lp[k]);
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ SGD */
static void test_sgd(void) {
    for (int ii = 0; ii < g_num_isas; ii++) {
        zx_isa isa = g_isas[ii];
        for (size_t li = 0; li < NUM_LENGTHS; li++) {
            for (size_t mis = 0; mis < 2; mis++) {
                for (int cfg = 0; cfg < 64; cfg++) {
                    size_t n = k_lengths[li];
                    zx_sgd_hparams hp = {
                        .lr = 0.05, .momentum = (cfg & 1) ? 0.9 : 0.0,
                        .dampening = (cfg & 4) ? 0.2 : 0.0,
                        .weight_decay = (cfg & 32) ? 0.1 : 0.0, .nesterov = (cfg >> 1) & 1,
                        .maximize = (cfg >> 4) & 1, .first_step = 0,
                        .grad_scale = (cfg + (int)li) % 3 == 0 ? 0.37f : 1.0f};
                    if (hp.nesterov && (hp.momentum == 0.0 || hp.dampening != 0.0)) continue;
                    int starts_fresh = (cfg >> 3) & 1;
                    zx_dtype lp_dtype = (zx_dtype)((cfg + (int)li) % 3);
                    buf p[2], b[2], g = buf_new(n, mis);
                    uint16_t *lp = (uint16_t *)malloc((n + 1) * sizeof(uint16_t));
                    for (int k = 0; k < 2; k++) { p[k] = buf_new(n, mis); b[k] = buf_new(n, mis); }
                    for (size_t i = 0; i < n; i++) {
                        p[0].p[i] = rnd_sym();
                        b[0].p[i] = 0.1f * rnd_sym();
                    }
                    buf_copy(&p[1], &p[0], n); buf_copy(&b[1], &b[0], n);
                    int ok = 1;
                    for (int step = 1; step <= 3 && ok; step++) {
                        for (size_t i = 0; i < n; i++) g.p[i] = 0.1f * rnd_sym();
                        hp.first_step = starts_fresh && step == 1;
                        void *lp1 = lp_dtype == ZX_F32 ? NULL : lp;
                        zx_status s0 = zx_sgd_step(ZX_ISA_SCALAR, n, p[0].p, g.p, b[0].p, NULL,
                                                   ZX_F32, &hp);
                        zx_status s1 = zx_sgd_step(isa, n, p[1].p, g.p, b[1].p, lp1, lp_dtype, &hp);
                        CHECK(s0 == ZX_OK && s1 == ZX_OK, "sgd status %d %d", s0, s1);
                        size_t first = 0;
                        size_t dp = count_ulp_diff(p[0].p, p[1].p, n, ZX_TEST_MAX_ULP, &first);
                        size_t db = count_ulp_diff(b[0].p, b[1].p, n, ZX_TEST_MAX_ULP, &first);
                        ok = !(dp || db);
                        CHECK(ok, "sgd %s n=%zu mis=%zu cfg=%d step=%d: %zu/%zu differ (p/buf), "
                              "first at %zu", zx_isa_name(isa), n, mis, cfg, step, dp, db, first);
                        if (lp_dtype != ZX_F32) {
                            size_t bad = 0;
                            for (size_t i = 0; i < n; i++) {
                                uint16_t want = lp_dtype == ZX_BF16 ? zx_f32_to_bf16_ref(p[1].p[i])
                                                                    : zx_f32_to_f16_ref(p[1].p[i]);
                                bad += lp[i] != want;
                            }
                            CHECK(bad == 0, "sgd %s n=%zu cfg=%d: %zu low-precision copies differ",
                                  zx_isa_name(isa), n, cfg, bad);
                        }
                    }
                    free(g.base); free(lp);
                    for (int k = 0; k < 2; k++) { free(p[k].base); free(b[k].base); }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ grad scan */
static void test_grad_sumsq(void) {
    for (int ii = 0; ii < g_num_isas; ii++) {
        zx_isa isa = g_isas[ii];
        for (size_t li = 0; li < NUM_LENGTHS; li++) {
            for (int cfg = 0; cfg < 4; cfg++) {
                size_t n = k_lengths[li], mis = cfg & 1;
                buf g = buf_new(n, mis);
                int64_t injected = 0;
                for (size_t i = 0; i < n; i++) g.p[i] = rnd_sym() * 3.0f;
                if (cfg & 2) {  /* inject inf, -inf, nan at random places */
                    const float bad[3] = {INFINITY, -INFINITY, NAN};
                    for (size_t k = 0; k < n / 5 + 1 && n > 0; k++) {
                        size_t at = rnd_u32() % n;
                        if (isfinite(g.p[at])) injected++;
                        g.p[at] = bad[k % 3];
                    }
                }
                float scale = cfg & 1 ? 0.125f : 1.7f;
                double s_ref = 1.5, s_isa = 1.5;   /* kernels add to what is there */
                int64_t nf_ref = 2, nf_isa = 2;
                CHECK(zx_grad_sumsq(ZX_ISA_SCALAR, n, g.p, scale, &s_ref, &nf_ref) == ZX_OK, "sumsq");
                CHECK(zx_grad_sumsq(isa, n, g.p, scale, &s_isa, &nf_isa) == ZX_OK, "sumsq");
                CHECK(nf_ref == 2 + injected && nf_isa == nf_ref,
                      "sumsq %s n=%zu: nonfinite %lld vs %lld (injected %lld)", zx_isa_name(isa),
                      n, (long long)nf_isa, (long long)nf_ref, (long long)injected);
                double rel = fabs(s_isa - s_ref) / s_ref;
                CHECK(rel <= 1e-12, "sumsq %s n=%zu: %.17g vs %.17g", zx_isa_name(isa), n, s_isa,
                      s_ref);
                free(g.base);
            }
        }
    }
    /* a known value: 3^2 + 4^2 scaled by 0.5 -> 6.25, the nan counted */
    float g[5] = {3.0f, NAN, 4.0f, 0.0f, -0.0f};
    for (int ii = -1; ii < g_num_isas; ii++) {
        zx_isa isa = ii < 0 ? ZX_ISA_SCALAR : g_isas[ii];
        double s = 0.0;
        int64_t nf = 0;
        CHECK(zx_grad_sumsq(isa, 5, g, 0.5f, &s, &nf) == ZX_OK && s == 6.25 && nf == 1,
              "sumsq known value %s: %g %lld", zx_isa_name(isa), s, (long long)nf);
    }
}

/* ------------------------------------------------------------------ sum_slices, scale */
static void test_sum_slices_and_scale(void) {
    const int32_t slices[] = {1, 2, 3, 5};
    for (int ii = 0; ii < g_num_isas; ii++) {
        zx_isa isa = g_isas[ii];
        for (size_t li = 0; li < NUM_LENGTHS; li++) {
            for (int si = 0; si < 4; si++) {
                for (int cfg = 0; cfg < 8; cfg++) {
                    size_t n = k_lengths[li], mis = cfg & 1;
                    int32_t ns = slices[si], acc = (cfg >> 1) & 1, alias = (cfg >> 2) & 1;
                    if (alias && acc) continue;
                    float scale = (cfg & 2) ? 0.25f : 1.0f;
                    buf src[2], dst[2];
                    for (int k = 0; k < 2; k++) { src[k] = buf_new(n * ns, mis); dst[k] = buf_new(n, mis); }
                    for (size_t i = 0; i < n * ns; i++) src[0].p[i] = rnd_sym();
                    for (size_t i = 0; i < n; i++) dst[0].p[i] = rnd_sym();
                    buf_copy(&src[1], &src[0], n * ns); buf_copy(&dst[1], &dst[0], n);
                    float *d0 = alias ? src[0].p : dst[0].p, *d1 = alias ? src[1].p : dst[1].p;
                    CHECK(zx_sum_slices(ZX_ISA_SCALAR, n, ns, src[0].p, d0, acc, scale) == ZX_OK, "sum_slices");
                    CHECK(zx_sum_slices(isa, n, ns, src[1].p, d1, acc, scale) == ZX_OK, "sum_slices");
                    size_t first = 0;
                    size_t bad = count_ulp_diff(d0, d1, n, ZX_TEST_MAX_ULP, &first);
                    CHECK(bad == 0, "sum_slices %s n=%zu ns=%d cfg=%d: %zu differ", zx_isa_name(isa),
                          n, ns, cfg, bad);
                    for (int k = 0; k < 2; k++) { free(src[k].base); free(dst[k].base); }
                }
            }
            /* zx_scale */
            size_t n = k_lengths[li];
            buf x[2];
            for (int k = 0; k < 2; k++) x[k] = buf_new(n, 1);
            for (size_t i = 0; i < n; i++) x[0].p[i] = rnd_sym();
            buf_copy(&x[1], &x[0], n);
            CHECK(zx_scale(ZX_ISA_SCALAR, n, x[0].p, -0.3f) == ZX_OK, "scale");
            CHECK(zx_scale(isa, n, x[1].p, -0.3f) == ZX_OK, "scale");
            size_t first = 0;
            CHECK(count_ulp_diff(x[0].p, x[1].p, n, 0, &first) == 0, "scale %s n=%zu", zx_isa_name(isa), n);
            for (int k = 0; k < 2; k++) free(x[k].base);
        }
    }
    /* a known value: 3 slices of 2, accumulate onto dst, scale 0.5 */
    float src[6] = {1, 2, 10, 20, 100, 200}, dst[2] = {1000, 2000};
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 2, 3, src, dst, 1, 0.5f) == ZX_OK && dst[0] == 1055.5f &&
          dst[1] == 2111.0f, "sum_slices known value %g %g", dst[0], dst[1]);
}

/* sum_slices16: bit for bit zx_sum_slices of the widened slices, every ISA */
static void test_sum_slices16(void) {
    const int32_t slices[] = {1, 2, 3, 5};
    const zx_dtype dts[] = {ZX_BF16, ZX_F16};
    for (int ii = 0; ii < g_num_isas; ii++) {
        for (size_t li = 0; li < NUM_LENGTHS; li++) {
            for (int si = 0; si < 4; si++) {
                for (int cfg = 0; cfg < 8; cfg++) {
                    size_t n = k_lengths[li], m = n * (size_t)slices[si];
                    int32_t ns = slices[si], acc = cfg & 1;
                    zx_dtype dt = dts[(cfg >> 1) & 1];
                    float scale = (cfg & 4) ? 0.25f : 1.0f;
                    uint16_t *h = malloc((m + 1) * sizeof *h);
                    buf wide = buf_new(m, 0), d0 = buf_new(n, 0), d1 = buf_new(n, 1);
                    for (size_t i = 0; i < m; i++) {
                        float x = rnd_sym();
                        h[i] = dt == ZX_BF16 ? zx_f32_to_bf16_ref(x) : zx_f32_to_f16_ref(x);
                        wide.p[i] = dt == ZX_BF16 ? zx_bf16_to_f32_ref(h[i]) : zx_f16_to_f32_ref(h[i]);
                    }
                    for (size_t i = 0; i < n; i++) d0.p[i] = d1.p[i] = rnd_sym();
                    CHECK(zx_sum_slices(ZX_ISA_SCALAR, n, ns, wide.p, d0.p, acc, scale) == ZX_OK, "sum_slices");
                    CHECK(zx_sum_slices16(g_isas[ii], n, ns, h, dt, d1.p, acc, scale) == ZX_OK, "sum_slices16");
                    size_t first = 0;
                    CHECK(count_ulp_diff(d0.p, d1.p, n, 0, &first) == 0, "sum_slices16 %s n=%zu ns=%d cfg=%d",
                          zx_isa_name(g_isas[ii]), n, ns, cfg);
                    free(h); free(wide.base); free(d0.base); free(d1.base);
                }
            }
        }
    }
    uint16_t h[4] = {0};
    float d[4] = {0};
    CHECK(zx_sum_slices16(ZX_ISA_SCALAR, 2, 2, h, ZX_F32, d, 0, 1.0f) == ZX_ERR_INVALID_ARG, "sum_slices16 f32");
    CHECK(zx_sum_slices16(ZX_ISA_SCALAR, 2, 0, h, ZX_BF16, d, 0, 1.0f) == ZX_ERR_INVALID_ARG, "sum_slices16 0");
    CHECK(zx_sum_slices16(ZX_ISA_SCALAR, 1, 2, h, ZX_BF16, (float *)(void *)h, 0, 1.0f) == ZX_ERR_INVALID_ARG,
          "sum_slices16 in place");
}

/* ------------------------------------------------------------------ conversions */
static void test_reference_conversions(void) {
    /* known values */
    struct { float x; uint16_t bf16, f16; } known[] = {
        {1.0f, 0x3f80, 0x3c00},
        {-2.0f, 0xc000, 0xc000},
        {0.0f, 0x0000, 0x0000},
        {-0.0f, 0x8000, 0x8000},
        {65504.0f, 0x4780, 0x7bff},      /* half max; bf16 rounds up to 2^16 */
        {65519.996f, 0x4780, 0x7bff},    /* just below the half overflow tie */
        {65520.0f, 0x4780, 0x7c00},      /* the tie rounds to even: inf */
        {0x1p-24f, 0x3380, 0x0001},      /* smallest half subnormal */
        {0x1p-25f, 0x3300, 0x0000},      /* tie between 0 and 2^-24: even is 0 */
        {0x1.8p-25f, 0x3340, 0x0001},    /* above the tie */
        {0x1.8p-24f, 0x33c0, 0x0002},    /* 1.5 * 2^-24: tie, even is 2 */
        {0x1p-14f, 0x3880, 0x0400},      /* smallest normal half */
        {0x1.ffcp-15f, 0x3880, 0x0400},  /* largest subnormal + half ulp: rounds up to normal */
        {1.00390625f, 0x3f80, 0x3c04},   /* 1 + 2^-8: bf16 tie, even is 1.0 */
        {1.01171875f, 0x3f82, 0x3c0c},   /* 1 + 3*2^-8: bf16 tie, even is 1 + 2^-6 */
        {FLT_MAX, 0x7f80, 0x7c00},       /* rounds to inf in both */
        {INFINITY, 0x7f80, 0x7c00},
        {-INFINITY, 0xff80, 0xfc00},
        {0x1p-149f, 0x0000, 0x0000},     /* fp32 min subnormal: 0x00000001 -> bf16 0 */
        {0x1.fffffcp-127f, 0x0080, 0x0000}, /* fp32 max subnormal rounds up to bf16 min normal */
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        uint16_t b = zx_f32_to_bf16_ref(known[k].x), h = zx_f32_to_f16_ref(known[k].x);
        CHECK(b == known[k].bf16 && h == known[k].f16, "ref conversion of %a: bf16 %04x (want %04x), "
              "f16 %04x (want %04x)", (double)known[k].x, b, known[k].bf16, h, known[k].f16);
    }
    /* NaN stays NaN, quiet, sign kept */
    uint16_t bn = zx_f32_to_bf16_ref(bits_f32(0xff800001u)), hn = zx_f32_to_f16_ref(bits_f32(0x7f800001u));
    CHECK((bn & 0x7fc0) == 0x7fc0 && (bn & 0x8000), "bf16 NaN %04x", bn);
    CHECK((hn & 0x7e00) == 0x7e00 && !(hn & 0x8000), "f16 NaN %04x", hn);

    /* every 16-bit pattern: decode, re-encode gives it back (NaNs stay NaN) */
    size_t bad_bf = 0, bad_h = 0, bad_mid = 0;
    for (uint32_t b = 0; b < 0x10000; b++) {
        float fb = zx_bf16_to_f32_ref((uint16_t)b), fh = zx_f16_to_f32_ref((uint16_t)b);
        if (isnan(fb)) bad_bf += !isnan(zx_bf16_to_f32_ref(zx_f32_to_bf16_ref(fb)));
        else bad_bf += zx_f32_to_bf16_ref(fb) != b;
        if (isnan(fh)) bad_h += !isnan(zx_f16_to_f32_ref(zx_f32_to_f16_ref(fh)));
        else bad_h += zx_f32_to_f16_ref(fh) != b;
        /* halfway to the next finite half goes to the even one; nudged off the
         * midpoint it goes to the nearer one */
        if ((b & 0x7fff) < 0x7bff) {
            float lo = fh, hi = zx_f16_to_f32_ref((uint16_t)(b + 1));
            float mid = lo + (hi - lo) * 0.5f;   /* exact: few mantissa bits */
            uint16_t even = (b & 1) ? (uint16_t)(b + 1) : (uint16_t)b;
            bad_mid += zx_f32_to_f16_ref(mid) != even;
            bad_mid += zx_f32_to_f16_ref(nextafterf(mid, lo)) != b;
            bad_mid += zx_f32_to_f16_ref(nextafterf(mid, hi)) != b + 1;
        }
    }
    CHECK(bad_bf == 0, "bf16 round trip: %zu patterns differ", bad_bf);
    CHECK(bad_h == 0, "f16 round trip: %zu patterns differ", bad_h);
    CHECK(bad_mid == 0, "f16 rounding at midpoints: %zu wrong", bad_mid);
    /* f16 decode of known values */
    CHECK(zx_f16_to_f32_ref(0x0001) == 0x1p-24f && zx_f16_to_f32_ref(0x7bff) == 65504.0f &&
          zx_f16_to_f32_ref(0x83ff) == -0x1.ff8p-15f && isinf(zx_f16_to_f32_ref(0xfc00)),
          "f16 decode of known values");
}

static void test_simd_conversions(void) {
    /* special values, then random bit patterns, then ordinary numbers */
    const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
        0x7f800001u, 0xff812345u, 0x7fbfffffu, 0x00000001u, 0x807fffffu, 0x00400000u,
        0x7f7fffffu, 0xff7fffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x33000000u,
        0x33000001u, 0x38800000u, 0x387fe000u, 0x3f808000u, 0x3f818000u, 0x3f808001u,
        0x3f80ffffu, 0x00008000u, 0x00018000u, 0x0001ffffu, 0x3f800000u, 0xbf800000u};
    const size_t n_special = sizeof special / sizeof special[0];
    const size_t n = 5000;
    for (int ii = 0; ii < g_num_isas; ii++) {
        zx_isa isa = g_isas[ii];
        for (size_t mis = 0; mis < 2; mis++) {
            buf x = buf_new(n, mis);
            for (size_t i = 0; i < n; i++) {
                if (i < 4 * n_special) x.p[i] = bits_f32(special[i % n_special]);
                else if (i < n / 2) x.p[i] = bits_f32(rnd_u32());
                else x.p[i] = rnd_sym() * (float)(1u << (rnd_u32() % 20));
            }
            for (int d = ZX_BF16; d <= ZX_F16; d++) {
                uint16_t *a = (uint16_t *)malloc(n * 2 + 2), *b = (uint16_t *)malloc(n * 2 + 2);
                uint16_t *bm = b + mis;   /* misaligned by one element */
                CHECK(zx_cast_from_f32(ZX_ISA_SCALAR, n, x.p, a, (zx_dtype)d) == ZX_OK, "cast");
                CHECK(zx_cast_from_f32(isa, n, x.p, bm, (zx_dtype)d) == ZX_OK, "cast");
                size_t bad = count_u16_diff(a, bm, n);
                for (size_t i = 0; i < n && bad; i++) {
                    if (a[i] != bm[i]) {
                        fprintf(stderr, "  first %s diff: %08x -> ref %04x, simd %04x\n",
                                d == ZX_BF16 ? "bf16" : "f16", f32_bits(x.p[i]), a[i], bm[i]);
                        break;
                    }
                }
                CHECK(bad == 0, "cast_from_f32 %s %s mis=%zu: %zu differ", zx_isa_name(isa),
                      d == ZX_BF16 ? "bf16" : "f16", mis, bad);
                /* back to fp32: SIMD equals the reference, bit for bit (NaN included) */
                buf y0 = buf_new(n, 0), y1 = buf_new(n, mis);
                CHECK(zx_cast_to_f32(ZX_ISA_SCALAR, n, a, (zx_dtype)d, y0.p) == ZX_OK, "cast");
                CHECK(zx_cast_to_f32(isa, n, bm, (zx_dtype)d, y1.p) == ZX_OK, "cast");
                size_t bad_back = 0;
                for (size_t i = 0; i < n; i++) bad_back += f32_bits(y0.p[i]) != f32_bits(y1.p[i]);
                CHECK(bad_back == 0, "cast_to_f32 %s %s: %zu differ", zx_isa_name(isa),
                      d == ZX_BF16 ? "bf16" : "f16", bad_back);
                /* round trip: fp32 -> lp -> fp32 -> lp is stable */
                uint16_t *c = (uint16_t *)malloc(n * 2);
                CHECK(zx_cast_from_f32(isa, n, y1.p, c, (zx_dtype)d) == ZX_OK, "cast");
                CHECK(count_u16_diff(c, a, n) == 0, "round trip %s %s", zx_isa_name(isa),
                      d == ZX_BF16 ? "bf16" : "f16");
                free(a); free(b); free(c); free(y0.base); free(y1.base);
            }
            /* F32 -> F32 is a copy */
            buf z = buf_new(n, 0);
            CHECK(zx_cast_from_f32(isa, n, x.p, z.p, ZX_F32) == ZX_OK &&
                  memcmp(z.p, x.p, n * 4) == 0, "f32 copy");
            free(z.base);
            free(x.base);
        }
    }
}

/* ------------------------------------------------------------------ bad arguments */
static void test_errors(void) {
    float p[4] = {0}, g[4] = {0}, m[4] = {0}, v[4] = {0};
    uint16_t lp[4];
    zx_adam_hparams ah = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                          .weight_decay = 0.0, .step = 1, .grad_scale = 1.0f};
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &ah) == ZX_OK, "adam ok");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, NULL) == ZX_ERR_INVALID_ARG, "adam NULL hp");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, NULL, g, m, v, NULL, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "adam NULL param");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, NULL, m, v, NULL, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "adam NULL grad");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 0, NULL, NULL, NULL, NULL, NULL, NULL, ZX_F32, &ah) == ZX_OK, "adam n=0");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, lp, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "adam lp F32");
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, lp, (zx_dtype)7, &ah) == ZX_ERR_INVALID_ARG, "adam lp dtype 7");
    CHECK(zx_adam_step((zx_isa)7, 4, p, g, m, v, NULL, NULL, ZX_F32, &ah) == ZX_ERR_UNSUPPORTED, "adam isa 7");
    zx_adam_hparams bad = ah;
    bad.amsgrad = 1;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "amsgrad no buffer");
    bad = ah; bad.step = 0;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "step 0");
    bad = ah; bad.beta1 = 1.0;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "beta1 1");
    bad = ah; bad.beta2 = NAN;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "beta2 nan");
    bad = ah; bad.lr = -1.0;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "lr < 0");
    bad = ah; bad.eps = -1.0;
    CHECK(zx_adam_step(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "eps < 0");

    zx_sgd_hparams sh = {.lr = 0.1, .momentum = 0.9, .grad_scale = 1.0f};
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, m, NULL, ZX_F32, &sh) == ZX_OK, "sgd ok");
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, NULL, NULL, ZX_F32, &sh) == ZX_ERR_INVALID_ARG, "momentum no buffer");
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, m, NULL, ZX_F32, NULL) == ZX_ERR_INVALID_ARG, "sgd NULL hp");
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, m, lp, ZX_F32, &sh) == ZX_ERR_INVALID_ARG, "sgd lp F32");
    CHECK(zx_sgd_step((zx_isa)-1, 4, p, g, m, NULL, ZX_F32, &sh) == ZX_ERR_UNSUPPORTED, "sgd isa -1");
    zx_sgd_hparams sbad = sh;
    sbad.nesterov = 1; sbad.dampening = 0.1;
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, m, NULL, ZX_F32, &sbad) == ZX_ERR_INVALID_ARG, "nesterov dampening");
    sbad = sh; sbad.nesterov = 1; sbad.momentum = 0.0;
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, NULL, NULL, ZX_F32, &sbad) == ZX_ERR_INVALID_ARG, "nesterov no momentum");
    sbad = sh; sbad.momentum = 0.0;
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 4, p, g, NULL, NULL, ZX_F32, &sbad) == ZX_OK, "no momentum, no buffer");
    CHECK(zx_sgd_step(ZX_ISA_SCALAR, 0, NULL, NULL, NULL, NULL, ZX_F32, &sh) == ZX_OK, "sgd n=0");

    double s = 0.0;
    int64_t nf = 0;
    CHECK(zx_grad_sumsq(ZX_ISA_SCALAR, 4, g, 1.0f, NULL, &nf) == ZX_ERR_INVALID_ARG, "sumsq NULL out");
    CHECK(zx_grad_sumsq(ZX_ISA_SCALAR, 4, g, 1.0f, &s, NULL) == ZX_ERR_INVALID_ARG, "sumsq NULL count");
    CHECK(zx_grad_sumsq(ZX_ISA_SCALAR, 4, NULL, 1.0f, &s, &nf) == ZX_ERR_INVALID_ARG, "sumsq NULL grad");
    CHECK(zx_grad_sumsq(ZX_ISA_SCALAR, 0, NULL, 1.0f, &s, &nf) == ZX_OK && s == 0.0 && nf == 0, "sumsq n=0");

    float src[8] = {0};
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 4, 0, src, p, 0, 1.0f) == ZX_ERR_INVALID_ARG, "nslices 0");
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 4, 2, NULL, p, 0, 1.0f) == ZX_ERR_INVALID_ARG, "slices NULL src");
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 4, 2, src, src, 1, 1.0f) == ZX_ERR_INVALID_ARG, "alias + accumulate");
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 4, 2, src, src + 4, 0, 1.0f) == ZX_ERR_INVALID_ARG, "alias slice 1");
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, 4, 2, src, src, 0, 1.0f) == ZX_OK, "alias slice 0");
    CHECK(zx_sum_slices(ZX_ISA_SCALAR, SIZE_MAX / 2, 4, src, p, 0, 1.0f) == ZX_ERR_OVERFLOW, "overflow");
    CHECK(zx_scale(ZX_ISA_SCALAR, 4, NULL, 2.0f) == ZX_ERR_INVALID_ARG, "scale NULL");
    CHECK(zx_cast_from_f32(ZX_ISA_SCALAR, 4, p, lp, (zx_dtype)3) == ZX_ERR_INVALID_ARG, "cast dtype 3");
    CHECK(zx_cast_to_f32(ZX_ISA_SCALAR, 4, lp, (zx_dtype)3, p) == ZX_ERR_INVALID_ARG, "cast dtype 3");
    CHECK(zx_cast_from_f32(ZX_ISA_SCALAR, 4, NULL, lp, ZX_BF16) == ZX_ERR_INVALID_ARG, "cast NULL");
    CHECK(zx_cast_from_f32((zx_isa)5, 4, p, lp, ZX_BF16) == ZX_ERR_UNSUPPORTED, "cast isa 5");
    for (int isa = ZX_ISA_AVX2; isa <= ZX_ISA_AVX512; isa++) {
        if (!zx_cpu_supports((zx_isa)isa))
            CHECK(zx_scale((zx_isa)isa, 4, p, 2.0f) == ZX_ERR_UNSUPPORTED, "unsupported %s",
                  zx_isa_name((zx_isa)isa));
    }
    CHECK(zx_cpu_supports(ZX_ISA_SCALAR) && !zx_cpu_supports((zx_isa)9), "cpu_supports");
    CHECK(zx_cpu_supports(zx_cpu_best_isa()), "best isa supported");
    CHECK(strcmp(zx_isa_name(ZX_ISA_AVX512), "avx512") == 0 && strcmp(zx_isa_name(ZX_ISA_AVX2), "avx2") == 0 &&
          strcmp(zx_isa_name(ZX_ISA_SCALAR), "scalar") == 0, "isa names");
}

int main(void) {
    for (int isa = ZX_ISA_AVX2; isa <= ZX_ISA_AVX512; isa++)
        if (zx_cpu_supports((zx_isa)isa)) g_isas[g_num_isas++] = (zx_isa)isa;
    printf("test_kernels: SIMD ISAs on this CPU:");
    for (int i = 0; i < g_num_isas; i++) printf(" %s", zx_isa_name(g_isas[i]));
    printf("%s; best %s; avx512-bf16 %s\n", g_num_isas ? "" : " none",
           zx_isa_name(zx_cpu_best_isa()), zx_cpu_has_avx512_bf16() ? "yes" : "no");

    test_reference_conversions();
    test_simd_conversions();
    test_adam();
    test_sgd();
    test_grad_sumsq();
    test_sum_slices_and_scale();
    test_sum_slices16();
    test_errors();

    printf("%ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
