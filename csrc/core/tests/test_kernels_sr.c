/* test_kernels_sr.c — Adam with bf16 states and stochastic rounding
 * (zx_adam_step_bf16_states, Note [Counter-based stochastic rounding] in zx_sr.h),
 * under ASan + UBSan.
 *
 *   ISAs        every SIMD ISA of this CPU is bit-identical to ZX_ISA_SCALAR (param,
 *               both states, the low-precision copy) on lengths around the vector
 *               widths, misaligned pointers, every variant, offsets that cross a 2^32
 *               block and wrap 2^64; a range cut into several calls (each passing its
 *               global offset) gives the same bits as one call.
 *   definition  with beta1 = 0 the stored states are exactly zx_bf16_sr of the fp32
 *               states with the bits zx_sr_bits(seed, offset + i) (low half: exp_avg,
 *               high half: exp_avg_sq); another seed or offset changes them.
 *   fp32 maths  param (and its copy) equal zx_adam_step's from the widened states, and
 *               each stored state is one of the two bf16 neighbours of the fp32 state.
 *   unbiased    a state moved by 1/8 of a bf16 ulp (which round to nearest loses) keeps
 *               its exact mean over many elements, within 4 standard errors; a value
 *               accumulated 4096 times by SR ends within 5 standard deviations of the
 *               exact sum; the hash's 16-bit halves are uniform (chi-square).
 *   specials    NaN stays NaN, Inf stays Inf, finite never becomes Inf, zeros keep
 *               their sign, representable values are unchanged.
 *   errors      bad arguments give the documented status codes.
 *
 * Run: make -C csrc/core test   (prints "N passed, N failed"; exit 1 on failure)
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zx_core.h"
#include "zx_kernels_internal.h"   /* zx_sr_bits, zx_bf16_sr, zx_f32_to_bf16_ref, ... */

#include "check.h"

/* ------------------------------------------------------------------ helpers */
static uint64_t g_rng = 0x243f6a8885a308d3ull;

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

static size_t count_f32_diff(const float *a, const float *b, size_t n, size_t *first) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (f32_bits(a[i]) != f32_bits(b[i])) {
            if (!bad) *first = i;
            bad++;
        }
    }
    return bad;
}

static size_t count_u16_diff(const uint16_t *a, const uint16_t *b, size_t n, size_t *first) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != b[i]) {
            if (!bad) *first = i;
            bad++;
        }
    }
    return bad;
}

/* The two bf16 neighbours of x: *lo has x's bits truncated, *hi one bf16 ulp further
 * from zero (equal to *lo when x is representable). */
static void bf16_neighbours(float x, uint16_t *lo, uint16_t *hi) {
    uint32_t u = f32_bits(x);
    *lo = (uint16_t)(u >> 16);
    *hi = (u & 0xffffu) ? (uint16_t)(*lo + 1) : *lo;
}

static zx_isa g_isas[3];
static int g_num_isas;   /* SIMD ISAs this CPU supports */

/* One run's arrays: param, grad, two bf16 states, an optional copy. Every array is
 * allocated with `mis` spare leading elements so that pointers can be misaligned. */
typedef struct run {
    float *p_base, *g_base;
    uint16_t *m_base, *v_base, *lp_base;
    float *p, *g;
    uint16_t *m, *v, *lp;
} run;

static run run_new(size_t n, size_t mis) {
    run r;
    r.p_base = (float *)malloc((n + mis + 1) * sizeof(float));
    r.g_base = (float *)malloc((n + mis + 1) * sizeof(float));
    r.m_base = (uint16_t *)malloc((n + mis + 1) * sizeof(uint16_t));
    r.v_base = (uint16_t *)malloc((n + mis + 1) * sizeof(uint16_t));
    r.lp_base = (uint16_t *)malloc((n + mis + 1) * sizeof(uint16_t));
    r.p = r.p_base + mis; r.g = r.g_base + mis;
    r.m = r.m_base + mis; r.v = r.v_base + mis; r.lp = r.lp_base + mis;
    return r;
}
static void run_copy(run *dst, const run *src, size_t n) {
    memcpy(dst->p, src->p, n * sizeof(float));
    memcpy(dst->g, src->g, n * sizeof(float));
    memcpy(dst->m, src->m, n * sizeof(uint16_t));
    memcpy(dst->v, src->v, n * sizeof(uint16_t));
    memset(dst->lp, 0, n * sizeof(uint16_t));
}
static void run_free(run *r) {
    free(r->p_base); free(r->g_base); free(r->m_base); free(r->v_base); free(r->lp_base);
}

/* random parameters, gradients and bf16 states (round to nearest of random fp32) */
static void run_fill(run *r, size_t n) {
    for (size_t i = 0; i < n; i++) {
        r->p[i] = rnd_sym();
        r->g[i] = 0.1f * rnd_sym();
        r->m[i] = zx_f32_to_bf16_ref(0.01f * rnd_sym());
        r->v[i] = zx_f32_to_bf16_ref(1e-4f * rnd_unit());
    }
}

/* 0 when a and b hold the same bits in every array (lp only when with_lp) */
static size_t run_diff(const run *a, const run *b, size_t n, int with_lp, size_t *first) {
    size_t f = 0, bad = count_f32_diff(a->p, b->p, n, &f);
    if (bad) *first = f;
    size_t d = count_u16_diff(a->m, b->m, n, &f);
    if (d && !bad) *first = f;
    bad += d;
    d = count_u16_diff(a->v, b->v, n, &f);
    if (d && !bad) *first = f;
    bad += d;
    if (with_lp) {
        d = count_u16_diff(a->lp, b->lp, n, &f);
        if (d && !bad) *first = f;
        bad += d;
    }
    return bad;
}

static zx_adam_hparams hparams(int cfg, int64_t step) {
    zx_adam_hparams hp = {
        .lr = 1e-3, .beta1 = (cfg & 4) ? 0.3 : 0.9, .beta2 = 0.999, .eps = 1e-8,
        .weight_decay = (cfg & 2) ? 0.1 : 0.0, .step = step, .decoupled = cfg & 1,
        .amsgrad = 0, .maximize = (cfg >> 3) & 1, .grad_scale = (cfg & 16) ? 0.37f : 1.0f};
    return hp;
}

static const size_t k_lengths[] = {0, 1, 7, 15, 16, 17, 31, 33, 63, 65, 1000, 4097};
#define NUM_LENGTHS (sizeof k_lengths / sizeof k_lengths[0])
/* offsets: 0, just below a 2^32 block boundary (vectors straddle it), just below 2^64
 * (counters wrap), an arbitrary large one */
static const uint64_t k_offsets[] = {0, 0xfffffffbull, 0x00000002fffffff9ull,
                                     0xfffffffffffffff5ull, 0x123456789abcdefull};
#define NUM_OFFSETS (sizeof k_offsets / sizeof k_offsets[0])

/* ------------------------------------------------------------------ ISAs and splits */
static void test_isas_bit_identical(void) {
    for (size_t li = 0; li < NUM_LENGTHS; li++) {
        for (size_t mis = 0; mis < 2; mis++) {
            for (int cfg = 0; cfg < 32; cfg++) {
                size_t n = k_lengths[li];
                uint64_t offset = k_offsets[(li + (size_t)cfg) % NUM_OFFSETS];
                uint64_t seed = 0x9e3779b97f4a7c15ull * (uint64_t)(cfg + 1);
                zx_dtype lp_dtype = (zx_dtype)(((size_t)cfg + li) % 3);   /* F32 = none */
                run ref = run_new(n, mis), alt = run_new(n, mis);
                run_fill(&ref, n);
                for (int ii = 0; ii < g_num_isas; ii++) {
                    zx_isa isa = g_isas[ii];
                    run_copy(&alt, &ref, n);
                    run sc = run_new(n, mis);   /* the scalar run, from the same inputs */
                    run_copy(&sc, &ref, n);
                    int ok = 1;
                    for (int64_t step = 1; step <= 3 && ok; step++) {
                        zx_adam_hparams hp = hparams(cfg, step);
                        uint64_t s = seed + (uint64_t)step;
                        void *lp0 = lp_dtype == ZX_F32 ? NULL : sc.lp;
                        void *lp1 = lp_dtype == ZX_F32 ? NULL : alt.lp;
                        zx_status s0 = zx_adam_step_bf16_states(ZX_ISA_SCALAR, n, sc.p, sc.g, sc.m,
                                                                sc.v, lp0, lp_dtype, &hp, s, offset);
                        zx_status s1 = zx_adam_step_bf16_states(isa, n, alt.p, alt.g, alt.m, alt.v,
                                                                lp1, lp_dtype, &hp, s, offset);
                        CHECK(s0 == ZX_OK && s1 == ZX_OK, "status %d %d", s0, s1);
                        size_t first = 0;
                        size_t bad = run_diff(&sc, &alt, n, lp_dtype != ZX_F32, &first);
                        ok = bad == 0;
                        CHECK(ok, "%s n=%zu mis=%zu cfg=%d offset=%#llx step=%lld: %zu values "
                              "differ from scalar, first at %zu", zx_isa_name(isa), n, mis, cfg,
                              (unsigned long long)offset, (long long)step, bad, first);
                        for (size_t i = 0; i < n; i++) sc.g[i] = alt.g[i] = 0.1f * rnd_sym();
                    }
                    run_free(&sc);
                }
                run_free(&ref);
                run_free(&alt);
            }
        }
    }
}

/* One call over [0, n) against calls over pieces [a, b) passing offset + a. */
static void test_splits(void) {
    const size_t n = 1000;
    const zx_isa isas[4] = {ZX_ISA_SCALAR, g_num_isas > 0 ? g_isas[0] : ZX_ISA_SCALAR,
                            g_num_isas > 1 ? g_isas[1] : ZX_ISA_SCALAR, ZX_ISA_SCALAR};
    for (size_t oi = 0; oi < NUM_OFFSETS; oi++) {
        for (int trial = 0; trial < 8; trial++) {
            uint64_t offset = k_offsets[oi] - (uint64_t)(trial * 37);
            zx_adam_hparams hp = hparams(trial * 5, 2);
            run whole = run_new(n, 0), split = run_new(n, 1);
            run_fill(&whole, n);
            run_copy(&split, &whole, n);
            CHECK(zx_adam_step_bf16_states(ZX_ISA_SCALAR, n, whole.p, whole.g, whole.m, whole.v,
                                           whole.lp, ZX_BF16, &hp, 42, offset) == ZX_OK, "whole");
            /* random cut points; each piece on a rotating ISA */
            size_t a = 0;
            int piece = 0;
            while (a < n) {
                size_t len = 1 + rnd_u32() % 97;
                if (len > n - a) len = n - a;
                zx_isa isa = isas[(piece++ + trial) % 4];
                CHECK(zx_adam_step_bf16_states(isa, len, split.p + a, split.g + a, split.m + a,
                                               split.v + a, split.lp + a, ZX_BF16, &hp, 42,
                                               offset + a) == ZX_OK, "piece");
                a += len;
            }
            size_t first = 0, bad = run_diff(&whole, &split, n, 1, &first);
            CHECK(bad == 0, "offset %#llx trial %d: %zu values of the split run differ from one "
                  "call, first at %zu", (unsigned long long)offset, trial, bad, first);
            run_free(&whole);
            run_free(&split);
        }
    }
}

/* ------------------------------------------------------------------ the definition */
/* beta1 = 0 makes the fp32 exp_avg the (scaled) gradient itself, and zero states
 * make exp_avg_sq = (1 - beta2) * g * g: the stored states can be predicted from
 * zx_sr_bits and zx_bf16_sr alone. */
static void test_definition(void) {
    const size_t n = 777;
    for (int iz = 0; iz <= g_num_isas; iz++) {
        zx_isa isa = iz == 0 ? ZX_ISA_SCALAR : g_isas[iz - 1];
        for (size_t oi = 0; oi < NUM_OFFSETS; oi++) {
            uint64_t offset = k_offsets[oi], seed = 0xdeadbeef00000000ull + oi;
            zx_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.0, .beta2 = 0.999, .eps = 1e-8,
                                  .step = 1, .decoupled = 1, .grad_scale = 1.0f};
            float *p = (float *)malloc(n * sizeof(float)), *g = (float *)malloc(n * sizeof(float));
            uint16_t *m = (uint16_t *)calloc(n, 2), *v = (uint16_t *)calloc(n, 2);
            for (size_t i = 0; i < n; i++) {
                p[i] = rnd_sym();
                g[i] = rnd_sym() * ldexpf(1.0f, (int)(rnd_u32() % 40) - 20);
            }
            CHECK(zx_adam_step_bf16_states(isa, n, p, g, m, v, NULL, ZX_F32, &hp, seed, offset) == ZX_OK,
                  "definition run");
            float omb2 = (float)(1.0 - 0.999);
            size_t bad_m = 0, bad_v = 0;
            for (size_t i = 0; i < n; i++) {
                uint32_t bits = zx_sr_bits(seed, offset + i);
                float v32 = fmaf(omb2 * g[i], g[i], 0.0f);
                bad_m += m[i] != zx_bf16_sr(f32_bits(g[i]), bits & 0xffffu);
                bad_v += v[i] != zx_bf16_sr(f32_bits(v32), bits >> 16);
            }
            CHECK(bad_m == 0 && bad_v == 0, "%s offset %#llx: %zu exp_avg and %zu exp_avg_sq values "
                  "are not zx_bf16_sr with zx_sr_bits(seed, offset + i)", zx_isa_name(isa),
                  (unsigned long long)offset, bad_m, bad_v);
            free(p); free(g); free(m); free(v);
        }
    }
    /* the bits depend on the seed and on the counter */
    size_t same_seed = 0, same_ctr = 0, same_hi = 0;
    for (uint64_t c = 0; c < 4096; c++) {
        same_seed += zx_sr_bits(1, c) == zx_sr_bits(2, c);
        same_ctr += zx_sr_bits(1, c) == zx_sr_bits(1, c + 1);
        same_hi += zx_sr_bits(1, c) == zx_sr_bits(1, c + (1ull << 32));
    }
    CHECK(same_seed < 4 && same_ctr < 4 && same_hi < 4, "hash collisions: seed %zu counter %zu "
          "block %zu of 4096", same_seed, same_ctr, same_hi);
}

/* Chi-square of the top 8 bits of each 16-bit half over 2^18 consecutive counters
 * (255 degrees of freedom: mean 255, sd 22.6; 400 is 6.4 sd). */
static void test_hash_uniform(void) {
    static long lo_hist[256], hi_hist[256];
    const uint64_t count = 1u << 18;
    const uint64_t starts[2] = {0, 0xffffffff00000000ull};
    for (int s = 0; s < 2; s++) {
        memset(lo_hist, 0, sizeof lo_hist);
        memset(hi_hist, 0, sizeof hi_hist);
        for (uint64_t c = 0; c < count; c++) {
            uint32_t b = zx_sr_bits(7, starts[s] + c);
            lo_hist[(b >> 8) & 0xff]++;
            hi_hist[b >> 24]++;
        }
        double expect = (double)count / 256.0, chi_lo = 0.0, chi_hi = 0.0;
        for (int k = 0; k < 256; k++) {
            chi_lo += (lo_hist[k] - expect) * (lo_hist[k] - expect) / expect;
            chi_hi += (hi_hist[k] - expect) * (hi_hist[k] - expect) / expect;
        }
        CHECK(chi_lo < 400.0 && chi_hi < 400.0, "hash not uniform from %#llx: chi2 %.1f / %.1f",
              (unsigned long long)starts[s], chi_lo, chi_hi);
    }
}

/* ------------------------------------------------------------------ fp32 maths */
/* param and its copy equal zx_adam_step's on the widened states; every stored state
 * is a bf16 neighbour of zx_adam_step's fp32 state. Step 1 from zero states, then
 * steps from whatever the previous one stored. */
static void test_matches_fp32_kernel(void) {
    const size_t n = 1031;
    for (int iz = 0; iz <= g_num_isas; iz++) {
        zx_isa isa = iz == 0 ? ZX_ISA_SCALAR : g_isas[iz - 1];
        for (int cfg = 0; cfg < 32; cfg++) {
            float *p = malloc(n * 4), *g = malloc(n * 4), *p32 = malloc(n * 4);
            float *m32 = malloc(n * 4), *v32 = malloc(n * 4);
            uint16_t *m = calloc(n, 2), *v = calloc(n, 2), *lp = malloc(n * 2), *lp32 = malloc(n * 2);
            for (size_t i = 0; i < n; i++) p[i] = rnd_sym();
            memcpy(p32, p, n * 4);
            size_t bad_p = 0, bad_lp = 0, bad_m = 0, bad_v = 0, rounded = 0;
            for (int64_t step = 1; step <= 4; step++) {
                zx_adam_hparams hp = hparams(cfg, step);
                for (size_t i = 0; i < n; i++) {
                    g[i] = 0.1f * rnd_sym();
                    m32[i] = zx_bf16_to_f32_ref(m[i]);
                    v32[i] = zx_bf16_to_f32_ref(v[i]);
                }
                CHECK(zx_adam_step(ZX_ISA_SCALAR, n, p32, g, m32, v32, NULL, lp32, ZX_BF16, &hp) == ZX_OK,
                      "fp32 kernel");
                CHECK(zx_adam_step_bf16_states(isa, n, p, g, m, v, lp, ZX_BF16, &hp,
                                               1000 + (uint64_t)step, 5) == ZX_OK, "bf16 kernel");
                for (size_t i = 0; i < n; i++) {
                    uint16_t lo, hi;
                    bad_p += f32_bits(p[i]) != f32_bits(p32[i]);
                    bad_lp += lp[i] != lp32[i];
                    bf16_neighbours(m32[i], &lo, &hi);
                    bad_m += m[i] != lo && m[i] != hi;
                    rounded += lo != hi;
                    bf16_neighbours(v32[i], &lo, &hi);
                    bad_v += v[i] != lo && v[i] != hi;
                }
                memcpy(p32, p, n * 4);
            }
            CHECK(bad_p == 0 && bad_lp == 0 && bad_m == 0 && bad_v == 0 && rounded > 0,
                  "%s cfg %d: %zu params, %zu copies differ from zx_adam_step; %zu exp_avg, %zu "
                  "exp_avg_sq not a bf16 neighbour of the fp32 state (%zu needed rounding)",
                  zx_isa_name(isa), cfg, bad_p, bad_lp, bad_m, bad_v, rounded);
            free(p); free(g); free(p32); free(m32); free(v32); free(m); free(v); free(lp); free(lp32);
        }
    }
}

/* ------------------------------------------------------------------ unbiased */
/* Every element starts at exp_avg = x0 (a bf16 number), exp_avg_sq = y0, and gets a
 * gradient that moves its fp32 states by a fraction of a bf16 ulp, which round to
 * nearest loses. The mean of the stored states must be the exact fp32 state within
 * 4 standard errors of a two-point (Bernoulli) rounding. */
static void test_unbiased_mean(void) {
    const size_t n = 1u << 17;
    const float x0s[2] = {1.0f, -0.75f};
    for (int iz = 0; iz <= g_num_isas; iz++) {
        zx_isa isa = iz == 0 ? ZX_ISA_SCALAR : g_isas[iz - 1];
        for (int k = 0; k < 2; k++) {
            float x0 = x0s[k];
            float ulp_x = fabsf(x0) * 0x1p-7f;           /* bf16 ulp at x0 (a power of 2 here) */
            if (k == 1) ulp_x = 0x1p-8f;                  /* 0.75 is in [0.5, 1): ulp 2^-8 */
            /* AdamW with beta1 = 0.5: m = x0 + 0.5 * (g - x0); g = x0 + 2 * ulp/8 * sign */
            float y0 = 1.0f;                              /* exp_avg_sq; beta2 = 0.5: v = 0.5 + 0.5 g^2 */
            zx_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.5, .beta2 = 0.5, .eps = 1e-8, .step = 1,
                                  .decoupled = 1, .grad_scale = 1.0f};
            float gval = x0 + copysignf(ulp_x * 0.25f, x0);
            float *p = malloc(n * 4), *g = malloc(n * 4);
            uint16_t *m = malloc(n * 2), *v = malloc(n * 2);
            for (size_t i = 0; i < n; i++) {
                p[i] = 0.0f;
                g[i] = gval;
                m[i] = zx_f32_to_bf16_ref(x0);
                v[i] = zx_f32_to_bf16_ref(y0);
            }
            CHECK(zx_adam_step_bf16_states(isa, n, p, g, m, v, NULL, ZX_F32, &hp, 99, 0) == ZX_OK,
                  "unbiased run");
            /* the exact fp32 states, from the fp32 kernel on one element */
            float p1 = 0.0f, m1 = x0, v1 = y0;
            CHECK(zx_adam_step(ZX_ISA_SCALAR, 1, &p1, &gval, &m1, &v1, NULL, NULL, ZX_F32, &hp) == ZX_OK,
                  "fp32 one element");
            const float exact[2] = {m1, v1};
            const uint16_t *st[2] = {m, v};
            for (int s = 0; s < 2; s++) {
                uint16_t lo, hi;
                bf16_neighbours(exact[s], &lo, &hi);
                double a = zx_bf16_to_f32_ref(lo), b = zx_bf16_to_f32_ref(hi);
                double frac = (exact[s] - a) / (b - a);   /* the probability of rounding away */
                double sum = 0.0;
                for (size_t i = 0; i < n; i++) sum += zx_bf16_to_f32_ref(st[s][i]);
                double mean = sum / (double)n;
                double se = fabs(b - a) * sqrt(frac * (1.0 - frac) / (double)n);
                CHECK(lo != hi && zx_f32_to_bf16_ref(exact[s]) == lo && frac > 0.05 && frac < 0.45,
                      "set-up: %s state %d must be a small fraction of an ulp that rounding to "
                      "nearest loses (frac %.3f)", zx_isa_name(isa), s, frac);
                CHECK(fabs(mean - exact[s]) <= 4.0 * se, "%s x0=%g state %d: mean %.9g, exact %.9g, "
                      "%.2f standard errors", zx_isa_name(isa), x0, s, mean, (double)exact[s],
                      fabs(mean - exact[s]) / se);
            }
            free(p); free(g); free(m); free(v);
        }
    }
}

/* x <- SR(x + d), 256 times, in 64 independent chains (seeds), with d = 1/8 and 3/16
 * of x's bf16 ulp (2^-7 on [1, 2), where every chain stays): round to nearest never
 * moves x, while the mean of SR's final values must be the exact x0 + 256 d within 5
 * standard errors (each step adds a two-point error of variance ulp^2 p (1 - p),
 * p = d / ulp; the drift is about 50 standard errors, so a lost update fails). */
static void test_unbiased_accumulation(void) {
    const int steps = 256, chains = 64;
    const double ulp = 0x1p-7;
    for (int trial = 0; trial < 4; trial++) {
        float x0 = trial % 2 ? -1.25f : 1.25f;
        float d = copysignf(trial < 2 ? 0x1p-10f : 0x3p-11f, x0);
        double sum = 0.0;
        uint16_t rtn = zx_f32_to_bf16_ref(x0);
        for (int c = 0; c < chains; c++) {
            uint16_t x = zx_f32_to_bf16_ref(x0);
            for (int k = 0; k < steps; k++) {
                float y = zx_bf16_to_f32_ref(x) + d;   /* exact: y has at most 11 significant bits */
                x = zx_bf16_sr(f32_bits(y), zx_sr_bits((uint64_t)(trial * chains + c), (uint64_t)k) & 0xffffu);
            }
            sum += zx_bf16_to_f32_ref(x);
        }
        for (int k = 0; k < steps; k++) rtn = zx_f32_to_bf16_ref(zx_bf16_to_f32_ref(rtn) + d);
        double p = fabs((double)d) / ulp;
        double se = ulp * sqrt((double)steps * p * (1.0 - p) / (double)chains);
        double exact = (double)x0 + (double)steps * (double)d, mean = sum / chains;
        CHECK(fabs(mean - exact) <= 5.0 * se, "accumulation trial %d: mean %.6g, exact %.6g (%.1f "
              "standard errors)", trial, mean, exact, fabs(mean - exact) / se);
        CHECK(zx_bf16_to_f32_ref(rtn) == x0, "set-up: round to nearest must lose d (trial %d)", trial);
    }
}

/* ------------------------------------------------------------------ specials */
static void test_specials(void) {
    const float vals[] = {NAN, -NAN, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, 0.0f, -0.0f,
                          1.0f, -2.5f, 0x1p-140f, -0x1p-133f, FLT_MIN, 3.3895313892515355e38f};
    for (size_t k = 0; k < sizeof vals / sizeof vals[0]; k++) {
        float x = vals[k];
        uint32_t u = f32_bits(x);
        int all_ok = 1;
        for (uint32_t r = 0; r < 0x10000u; r += (r < 16 || r > 0xfff0u) ? 1u : 0x101u) {
            uint16_t h = zx_bf16_sr(u, r);
            float y = zx_bf16_to_f32_ref(h);
            uint16_t lo, hi;
            bf16_neighbours(x, &lo, &hi);
            int ok;
            if (isnan(x)) ok = isnan(y) && h == zx_f32_to_bf16_ref(x);
            else if (isinf(x)) ok = h == (uint16_t)(u >> 16);
            else if (fabsf(x) > bits_f32(0x7f7f0000u)) ok = h == (uint16_t)(((u >> 16) & 0x8000u) | 0x7f7fu);
            else ok = !isinf(y) && (h == lo || h == hi) && signbit(y) == signbit(x);
            if (!(u & 0xffffu) && !isnan(x)) ok = ok && h == (uint16_t)(u >> 16);
            all_ok = all_ok && ok;
        }
        CHECK(all_ok, "special value %a (bits %#x) rounds wrong", (double)x, u);
    }
    /* the SIMD rounding on the same values, through the kernel: beta1 = 0 stores g */
    const size_t n = 37;
    zx_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.0, .beta2 = 0.999, .eps = 1e-8, .step = 1,
                          .decoupled = 1, .grad_scale = 1.0f};
    for (int ii = 0; ii < g_num_isas; ii++) {
        float p0[37], g[37], p1[37];
        uint16_t m0[37] = {0}, v0[37] = {0}, m1[37] = {0}, v1[37] = {0};
        for (size_t i = 0; i < n; i++) {
            g[i] = i < sizeof vals / sizeof vals[0] ? vals[i] : rnd_sym();
            if (isinf(g[i])) g[i] = copysignf(FLT_MAX, g[i]);   /* inf - 0 makes m NaN */
            p0[i] = p1[i] = rnd_sym();
        }
        zx_adam_step_bf16_states(ZX_ISA_SCALAR, n, p0, g, m0, v0, NULL, ZX_F32, &hp, 3, 0);
        zx_adam_step_bf16_states(g_isas[ii], n, p1, g, m1, v1, NULL, ZX_F32, &hp, 3, 0);
        size_t first = 0, bad = count_u16_diff(m0, m1, n, &first) + count_u16_diff(v0, v1, n, &first);
        CHECK(bad == 0, "%s specials: %zu states differ from scalar, first at %zu",
              zx_isa_name(g_isas[ii]), bad, first);
        size_t bad_def = 0;
        for (size_t i = 0; i < n; i++)
            bad_def += m1[i] != zx_bf16_sr(f32_bits(g[i]), zx_sr_bits(3, i) & 0xffffu);
        CHECK(bad_def == 0, "%s specials: %zu exp_avg values are not zx_bf16_sr of the gradient",
              zx_isa_name(g_isas[ii]), bad_def);
    }
}

/* ------------------------------------------------------------------ errors */
static void test_errors(void) {
    float p[4] = {0}, g[4] = {0};
    uint16_t m[4] = {0}, v[4] = {0}, lp[4];
    zx_adam_hparams ah = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                          .weight_decay = 0.0, .step = 1, .grad_scale = 1.0f};
#define SR_STEP(isa, n, p_, g_, m_, v_, lp_, dt, hp) \
    zx_adam_step_bf16_states(isa, n, p_, g_, m_, v_, lp_, dt, hp, 1, 0)
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &ah) == ZX_OK, "ok");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, lp, ZX_F16, &ah) == ZX_OK, "ok with fp16 copy");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, NULL) == ZX_ERR_INVALID_ARG, "NULL hp");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, NULL, g, m, v, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "NULL param");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, NULL, m, v, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "NULL grad");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, NULL, v, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "NULL exp_avg");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, NULL, NULL, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "NULL exp_avg_sq");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 0, NULL, NULL, NULL, NULL, NULL, ZX_F32, &ah) == ZX_OK, "n=0");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, lp, ZX_F32, &ah) == ZX_ERR_INVALID_ARG, "lp F32");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, lp, (zx_dtype)7, &ah) == ZX_ERR_INVALID_ARG, "lp dtype 7");
    CHECK(SR_STEP((zx_isa)7, 4, p, g, m, v, NULL, ZX_F32, &ah) == ZX_ERR_UNSUPPORTED, "isa 7");
    for (int isa = ZX_ISA_AVX2; isa <= ZX_ISA_AVX512; isa++) {
        if (!zx_cpu_supports((zx_isa)isa))
            CHECK(SR_STEP((zx_isa)isa, 4, p, g, m, v, NULL, ZX_F32, &ah) == ZX_ERR_UNSUPPORTED,
                  "unsupported %s", zx_isa_name((zx_isa)isa));
    }
    zx_adam_hparams bad = ah;
    bad.amsgrad = 1;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_UNSUPPORTED, "amsgrad");
    CHECK(SR_STEP(ZX_ISA_SCALAR, 0, NULL, NULL, NULL, NULL, NULL, ZX_F32, &bad) == ZX_ERR_UNSUPPORTED,
          "amsgrad, n=0");
    bad = ah; bad.step = 0;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "step 0");
    bad = ah; bad.beta1 = 1.0;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "beta1 1");
    bad = ah; bad.beta2 = NAN;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "beta2 nan");
    bad = ah; bad.lr = -1.0;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "lr < 0");
    bad = ah; bad.eps = -1.0;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "eps < 0");
    bad = ah; bad.weight_decay = -0.5;
    CHECK(SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad) == ZX_ERR_INVALID_ARG, "wd < 0");
    /* a refused call writes nothing */
    float p_before[4];
    memcpy(p_before, p, sizeof p);
    bad = ah; bad.amsgrad = 1;
    g[0] = 1.0f;
    SR_STEP(ZX_ISA_SCALAR, 4, p, g, m, v, NULL, ZX_F32, &bad);
    CHECK(memcmp(p, p_before, sizeof p) == 0, "a refused call changed param");
#undef SR_STEP
}

int main(void) {
    for (int isa = ZX_ISA_AVX2; isa <= ZX_ISA_AVX512; isa++)
        if (zx_cpu_supports((zx_isa)isa)) g_isas[g_num_isas++] = (zx_isa)isa;
    printf("test_kernels_sr: SIMD ISAs on this CPU:");
    for (int i = 0; i < g_num_isas; i++) printf(" %s", zx_isa_name(g_isas[i]));
    printf("%s\n", g_num_isas ? "" : " none (only the scalar reference is checked)");

    test_specials();
    test_definition();
    test_hash_uniform();
    test_isas_bit_identical();
    test_splits();
    test_matches_fp32_kernel();
    test_unbiased_mean();
    test_unbiased_accumulation();
    test_errors();

    printf("%ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
