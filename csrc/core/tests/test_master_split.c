/* test_master_split.c — Note [Split master]: an fp32 master kept as its bf16
 * rounding + a 16-bit remainder + a tie bit comes back bit for bit.
 *
 * For every one of the 65,536 low halves under 640 high halves (every sign and
 * exponent class: zeros, subnormals, normals near 1, the largest finite numbers,
 * infinities, NaNs, and their bf16 neighbours), hi = zx_f32_to_bf16_ref(m) (the
 * rounding the fused steps write), split, join: the bits must be m's (NaN: a NaN).
 * Ties (low half 0x8000) occur under both odd and even high halves. Also: lengths
 * that are not whole bytes, the bytes of a chunk inside a longer array, an edited
 * zero with a negative remainder, and bad arguments; the fused Adam step over the split
 * master against join, step, split (every ISA the CPU has); the rest for the scalar loop
 * and the CPU's best ISA.
 *
 * Run: make -C csrc/core test
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zx_core.h"
#include "zx_kernels_internal.h"

#include "check.h"

static uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

enum { LOW = 65536 };

static zx_isa g_isa = ZX_ISA_SCALAR;   /* each test runs for the scalar loop and the CPU's best */

/* Round trip of every low half under high half h; returns the mismatches. */
static long round_trip_high(uint16_t h, float *m, uint16_t *hi, int16_t *rem, uint8_t *ties, float *back,
                            long *nties) {
    for (uint32_t lo = 0; lo < LOW; lo++) {
        m[lo] = bits_f32(((uint32_t)h << 16) | lo);
        hi[lo] = zx_f32_to_bf16_ref(m[lo]);
    }
    CHECK(zx_master_split(g_isa, LOW, m, hi, rem, ties) == ZX_OK, "split of high half 0x%04x", h);
    CHECK(zx_master_join(g_isa, LOW, hi, rem, ties, back) == ZX_OK, "join of high half 0x%04x", h);
    long bad = 0;
    for (uint32_t lo = 0; lo < LOW; lo++) {
        const int ok = isnan(m[lo]) ? isnan(back[lo]) : f32_bits(back[lo]) == f32_bits(m[lo]);
        if (!ok && bad++ < 3)
            fprintf(stderr, "  0x%08x came back as 0x%08x\n", f32_bits(m[lo]), f32_bits(back[lo]));
        *nties += (ties[lo >> 3] >> (lo & 7)) & 1;
    }
    return bad;
}

static void test_round_trip(void) {
    float *m = malloc(LOW * sizeof(float)), *back = malloc(LOW * sizeof(float));
    uint16_t *hi = malloc(LOW * sizeof(uint16_t));
    int16_t *rem = malloc(LOW * sizeof(int16_t));
    uint8_t *ties = malloc(LOW / 8);
    /* every sign and exponent class, and both parities of the bf16 mantissa */
    const uint16_t bases[] = {0x0000, 0x0001, 0x0002, 0x007f, 0x0080, 0x0081, 0x3f7f, 0x3f80, 0x3f81,
                              0x4049, 0x7f7e, 0x7f7f, 0x7f80, 0x7f81, 0x7fc0, 0x7fff};
    long bad = 0, nties = 0, highs = 0;
    for (int s = 0; s < 2; s++)
        for (size_t k = 0; k < sizeof bases / sizeof bases[0]; k++)
            for (int j = 0; j < 20; j++) {
                const uint16_t h = (uint16_t)((s ? 0x8000 : 0) | ((bases[k] + j * 0x0101) & 0x7fff));
                bad += round_trip_high(h, m, hi, rem, ties, back, &nties);
                highs++;
            }
    CHECK(bad == 0, "%ld of %ld masters did not come back bit for bit", bad, highs * LOW);
    /* a finite high half has exactly one upward tie (low half 0x8000 under an even
       rounded value); the check that ties happen at all guards the tie path */
    CHECK(nties > highs / 4, "only %ld tie bits set over %ld high halves", nties, highs);
    free(m), free(back), free(hi), free(rem), free(ties);
}

/* Whole bytes: a chunk [8k, 8k + n) of a longer split joins alone to the same bits, and a
   partial last byte leaves its unused bits 0. */
static void test_chunks(void) {
    enum { N = 1003 };
    float m[N], back[N];
    uint16_t hi[N];
    int16_t rem[N];
    uint8_t ties[(N + 7) / 8], part[(N + 7) / 8];
    for (int i = 0; i < N; i++) {
        /* every third element a tie: low half 0x8000 */
        const uint32_t u = 0x3f800000u + (uint32_t)i * 0x10000u + (i % 3 == 0 ? 0x8000u : (uint32_t)i * 37u);
        m[i] = bits_f32(u);
        hi[i] = zx_f32_to_bf16_ref(m[i]);
    }
    CHECK(zx_master_split(g_isa, N, m, hi, rem, ties) == ZX_OK, "split");
    CHECK((ties[N / 8] >> (N % 8)) == 0, "unused bits of the last byte: 0x%02x", ties[N / 8]);
    for (int start = 0; start < N; start += 8 * 17) {
        const int n = N - start < 8 * 40 + 5 ? N - start : 8 * 40 + 5;
        memset(part, 0xff, sizeof part);
        CHECK(zx_master_split(g_isa, (size_t)n, m + start, hi + start, rem + start, part) == ZX_OK, "chunk split");
        CHECK(zx_master_join(g_isa, (size_t)n, hi + start, rem + start, part, back) == ZX_OK, "chunk join");
        int same = 1;
        for (int i = 0; i < n; i++) same = same && f32_bits(back[i]) == f32_bits(m[start + i]);
        CHECK(same, "chunk at %d did not come back", start);
        CHECK(memcmp(part, ties + start / 8, (size_t)n / 8) == 0, "chunk at %d: tie bytes differ", start);
    }
}

static void test_edited(void) {
    /* p.data edited to zero under a negative remainder: a zero, not a NaN */
    const uint16_t zeros[2] = {0x0000, 0x8000};
    const int16_t neg[2] = {-5, -0x7fff};
    uint8_t t = 0;
    float out[2];
    CHECK(zx_master_join(g_isa, 2, zeros, neg, &t, out) == ZX_OK, "join");
    CHECK(out[0] == 0.0f && out[1] == 0.0f, "edited zeros came back as %g, %g", out[0], out[1]);
    /* an edited nonzero keeps the edit with the old remainder, near the new value */
    const uint16_t h = 0x4000;   /* 2.0 */
    const int16_t r = 0x1234;
    CHECK(zx_master_join(g_isa, 1, &h, &r, &t, out) == ZX_OK, "join");
    CHECK(fabsf(out[0] - 2.0f) < 0.01f, "edited 2.0 came back as %g", out[0]);
}

static void test_errors(void) {
    float f = 1.0f;
    uint16_t h = 0x3f80;
    int16_t r = 0;
    uint8_t t = 0;
    CHECK(zx_master_join(g_isa, 0, NULL, NULL, NULL, NULL) == ZX_OK, "n = 0 touches nothing");
    CHECK(zx_master_split(g_isa, 0, NULL, NULL, NULL, NULL) == ZX_OK, "n = 0 touches nothing");
    CHECK(zx_master_join(g_isa, 1, &h, &r, NULL, &f) == ZX_ERR_INVALID_ARG, "null ties");
    CHECK(zx_master_split(g_isa, 1, &f, NULL, &r, &t) == ZX_ERR_INVALID_ARG, "null hi");
}

/* The edited-zero rule inside whole bytes (the vector loop): 8 elements. */
static void test_edited_vector(void) {
    const uint16_t h[8] = {0x0000, 0x8000, 0x4000, 0x0000, 0xc000, 0x8000, 0x3f80, 0x0000};
    const int16_t r[8] = {-5, -0x7fff, -3, 7, -0x100, 9, -0x8000, -0x8000};
    const uint8_t t = 0x80;   /* the last element is a tie: +0x8000 */
    float out[8];
    CHECK(zx_master_join(g_isa, 8, h, r, &t, out) == ZX_OK, "join");
    const uint32_t want[8] = {0x00000000u, 0x80000000u, 0x3ffffffdu, 0x00000007u, 0xbfffff00u, 0x80000009u,
                              0x3f7f8000u, 0x00008000u};
    for (int i = 0; i < 8; i++)
        CHECK(f32_bits(out[i]) == want[i], "element %d: 0x%08x, want 0x%08x", i, f32_bits(out[i]), want[i]);
}

/* Note [Fused split-master step]: zx_adam_step_split equals join, zx_adam_step writing
   hi, split, bit for bit (hi, rem, ties, both states and the AMSGrad max), for runs that
   start and end inside tie bytes and inside vectors, AdamW and Adam + L2 + amsgrad, with
   masters that include ties, zeros, subnormals and infinities. */
static void test_fused_adam(void) {
    enum { T = 1003 };
    static float m[T], e1[T], e2[T], vm[T], g[T], w1[T], w2[T], wm[T], master[T];
    static uint16_t hi[T], hi2[T];
    static int16_t rem[T], rem2[T];
    static uint8_t ties[(T + 7) / 8], ties2[(T + 7) / 8];
    const size_t runs[][3] = {{T, 0, T}, {T, 5, T - 10}, {T, 3, T - 3}, {40, 7, 33}, {8, 1, 6}, {17, 9, 8},
                              {1, 0, 1}, {64, 0, 57}};
    zx_adam_hparams hp = {1e-3, 0.9, 0.999, 1e-8, 0.1, 3, 1, 0, 0, 1.0f};
    long bad = 0;
    for (int variant = 0; variant < 2; variant++) {
        if (variant == 1) hp.decoupled = 0, hp.amsgrad = 1, hp.weight_decay = 0.01, hp.grad_scale = 0.5f;
        for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
            const size_t total = runs[r][0], lead = runs[r][1], n = runs[r][2];
            for (size_t i = 0; i < T; i++) {
                const uint32_t u = 0x3c000000u + (uint32_t)(i * 2654435761u % 0x3000000u);
                m[i] = bits_f32(i % 5 == 0 ? (u & ~0xffffu) | 0x8000u : u) * (i % 2 ? -1.0f : 1.0f);
                g[i] = (float)((int)(i * 40503u % 2001u) - 1000) * 1e-4f;
                e1[i] = w1[i] = g[i] * 0.1f;
                e2[i] = w2[i] = g[i] * g[i] + 1e-6f;
                vm[i] = wm[i] = e2[i] * 1.5f;
            }
            m[0] = 0.0f, m[1] = -0.0f, m[2] = 1e-40f, m[3] = INFINITY;
            for (size_t i = 0; i < T; i++) hi[i] = zx_f32_to_bf16_ref(m[i]);
            CHECK(zx_master_split(ZX_ISA_SCALAR, T, m, hi, rem, ties) == ZX_OK, "split");
            memcpy(hi2, hi, sizeof hi), memcpy(rem2, rem, sizeof rem), memcpy(ties2, ties, sizeof ties);
            /* the unfused path, on the first total elements */
            CHECK(zx_master_join(ZX_ISA_SCALAR, total, hi2, rem2, ties2, master) == ZX_OK, "join");
            CHECK(zx_adam_step(ZX_ISA_SCALAR, n, master + lead, g, w1, w2, hp.amsgrad ? wm : NULL, hi2 + lead, ZX_BF16,
                               &hp) == ZX_OK, "adam");
            CHECK(zx_master_split(ZX_ISA_SCALAR, total, master, hi2, rem2, ties2) == ZX_OK, "split back");
            CHECK(zx_adam_step_split(g_isa, total, lead, n, hi, rem, ties, g, e1, e2, hp.amsgrad ? vm : NULL, &hp) ==
                  ZX_OK, "fused step (%zu, %zu, %zu)", total, lead, n);
            int same = memcmp(hi, hi2, total * 2) == 0 && memcmp(rem, rem2, total * 2) == 0 &&
                       memcmp(ties, ties2, (total + 7) / 8) == 0 && memcmp(e1, w1, sizeof e1) == 0 &&
                       memcmp(e2, w2, sizeof e2) == 0 && memcmp(vm, wm, sizeof vm) == 0;
            bad += !same;
            CHECK(same, "fused step (%zu, %zu, %zu), variant %d differs from join, adam, split", total, lead, n,
                  variant);
        }
    }
    CHECK(bad == 0, "%ld fused runs differ", bad);
    /* bad arguments: the stepped run must end in the last tie byte */
    CHECK(zx_adam_step_split(g_isa, 16, 0, 8, hi, rem, ties, g, e1, e2, NULL, &hp) == ZX_ERR_INVALID_ARG,
          "a run ending 8 elements early");
    CHECK(zx_adam_step_split(g_isa, 16, 9, 8, hi, rem, ties, g, e1, e2, NULL, &hp) == ZX_ERR_INVALID_ARG,
          "a run past the end");
    CHECK(zx_adam_step_split(g_isa, 0, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, &hp) == ZX_OK,
          "n = 0 touches nothing");
}

/* SGD and Adam with bf16 states over the split master (blocked through L1) equal join, the
   kernel writing hi, split, bit for bit; runs longer than a block and inside tie bytes. */
static void test_blocked_steps(void) {
    enum { T = 5003 };
    static float m[T], g[T], b1[T], b2[T], master[T];
    static uint16_t hi[T], hi2[T], s1[T], s2[T], t1[T], t2[T];
    static int16_t rem[T], rem2[T];
    static uint8_t ties[(T + 7) / 8], ties2[(T + 7) / 8];
    const size_t runs[][3] = {{T, 0, T}, {T, 3, T - 8}, {4096, 7, 4089}, {17, 9, 8}, {8, 1, 6}};
    const zx_sgd_hparams sgd = {1e-2, 0.9, 0.0, 1e-4, 1, 0, 0, 1.0f};
    const zx_adam_hparams adam = {1e-3, 0.9, 0.999, 1e-8, 0.1, 4, 1, 0, 0, 1.0f};
    long bad = 0;
    for (int kind = 0; kind < 2; kind++)
        for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
            const size_t total = runs[r][0], lead = runs[r][1], n = runs[r][2];
            for (size_t i = 0; i < T; i++) {
                const uint32_t u = 0x3c000000u + (uint32_t)(i * 2654435761u % 0x3000000u);
                m[i] = bits_f32(i % 7 == 0 ? (u & ~0xffffu) | 0x8000u : u);
                g[i] = (float)((int)(i * 40503u % 2001u) - 1000) * 1e-4f;
                b1[i] = b2[i] = g[i] * 0.5f;
                s1[i] = s2[i] = zx_f32_to_bf16_ref(g[i] * 0.1f);
                t1[i] = t2[i] = zx_f32_to_bf16_ref(g[i] * g[i] + 1e-6f);
                hi[i] = zx_f32_to_bf16_ref(m[i]);
            }
            CHECK(zx_master_split(ZX_ISA_SCALAR, T, m, hi, rem, ties) == ZX_OK, "split");
            memcpy(hi2, hi, sizeof hi), memcpy(rem2, rem, sizeof rem), memcpy(ties2, ties, sizeof ties);
            CHECK(zx_master_join(ZX_ISA_SCALAR, total, hi2, rem2, ties2, master) == ZX_OK, "join");
            if (kind == 0) {
                CHECK(zx_sgd_step(ZX_ISA_SCALAR, n, master + lead, g, b2, hi2 + lead, ZX_BF16, &sgd) == ZX_OK, "sgd");
                CHECK(zx_sgd_step_split(g_isa, total, lead, n, hi, rem, ties, g, b1, &sgd) == ZX_OK, "sgd split");
            } else {
                CHECK(zx_adam_step_bf16_states(ZX_ISA_SCALAR, n, master + lead, g, s2, t2, hi2 + lead, ZX_BF16, &adam,
                                               77, 1000) == ZX_OK, "adam bf16 states");
                CHECK(zx_adam_step_bf16_states_split(g_isa, total, lead, n, hi, rem, ties, g, s1, t1, &adam, 77,
                                                     1000) == ZX_OK, "adam bf16 states split");
            }
            CHECK(zx_master_split(ZX_ISA_SCALAR, total, master, hi2, rem2, ties2) == ZX_OK, "split back");
            const int same = memcmp(hi, hi2, total * 2) == 0 && memcmp(rem, rem2, total * 2) == 0 &&
                             memcmp(ties, ties2, (total + 7) / 8) == 0 && memcmp(b1, b2, sizeof b1) == 0 &&
                             memcmp(s1, s2, sizeof s1) == 0 && memcmp(t1, t2, sizeof t1) == 0;
            bad += !same;
            CHECK(same, "%s over the split master (%zu, %zu, %zu) differs from join, step, split",
                  kind ? "Adam with bf16 states" : "SGD", total, lead, n);
        }
    CHECK(bad == 0, "%ld blocked runs differ", bad);
    CHECK(zx_sgd_step_split(g_isa, 16, 0, 8, hi, rem, ties, g, b1, &sgd) == ZX_ERR_INVALID_ARG, "a short run");
}

int main(void) {
    const zx_isa isas[2] = {ZX_ISA_SCALAR, zx_cpu_best_isa()};
    for (int k = 0; k < (isas[1] == ZX_ISA_SCALAR ? 1 : 2); k++) {
        g_isa = isas[k];
        printf("test_master_split: %s\n", zx_isa_name(g_isa));
        test_round_trip();
        test_chunks();
        test_edited();
        test_edited_vector();
        test_errors();
    }
    const zx_isa every[3] = {ZX_ISA_SCALAR, ZX_ISA_AVX2, ZX_ISA_AVX512};
    for (int k = 0; k < 3; k++) {
        if (!zx_cpu_supports(every[k])) continue;
        g_isa = every[k];
        printf("test_master_split: the fused Adam step, %s\n", zx_isa_name(g_isa));
        test_fused_adam();
        test_blocked_steps();
    }
    printf("test_master_split: %ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
