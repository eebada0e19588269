/* test_plan.c — planner invariants over many random shapes, and its errors.
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "../zx_core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}
static int64_t rnd_range(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }
static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
/* Note [Aligned pieces]: packed tight (0), at most the element (2, 4) or wider (16, 64) */
static int64_t rnd_param_align(void) {
    static const int64_t choices[] = {0, 2, 4, 16, 16, 16, 64};
    return choices[rnd() % (sizeof choices / sizeof choices[0])];
}

/* Checks every invariant of the layout (README, "How it works") on one random problem. */
static void check_random_plan(int trial) {
    const size_t n = (size_t)rnd_range(1, 60);
    int64_t *numel = malloc(n * sizeof *numel), *order = malloc(n * sizeof *order);
    int32_t *dtype = malloc(n * sizeof *dtype), *group = malloc(n * sizeof *group), *unit = malloc(n * sizeof *unit);
    const int use_units = (int)(rnd() % 2);
    const int32_t groups = (int32_t)rnd_range(1, 3);
    for (size_t i = 0; i < n; i++) {
        numel[i] = rnd() % 4 == 0 ? rnd_range(1, 7) : rnd_range(1, 5000);
        dtype[i] = (int32_t)(rnd() % 3);
        group[i] = (int32_t)(rnd() % (uint64_t)groups);
        order[i] = (int64_t)i;
    }
    for (size_t i = n - 1; i > 0; i--) { size_t j = rnd() % (i + 1); int64_t t = order[i]; order[i] = order[j]; order[j] = t; }
    /* units: non-decreasing along `order` */
    int32_t u = 0;
    for (size_t i = 0; i < n; i++) { if (rnd() % 5 == 0) u++; unit[order[i]] = u; }
    zx_plan_params pp = {n, numel, dtype, group, use_units ? unit : NULL, order,
                         (int32_t)rnd_range(1, 9), rnd_range(64, 40000), rnd_range(64, 8000), rnd_range(1, 32), NULL, NULL,
                         rnd_param_align()};
    zx_plan *plan = NULL;
    zx_status st = zx_plan_create(&pp, &plan);
    CHECK(st == ZX_OK && plan, "trial %d: create -> %s", trial, zx_status_string(st));
    if (!plan) goto done;

    const int64_t nb = zx_plan_num_buckets(plan);
    const int32_t N = pp.world_size;
    CHECK(zx_plan_world_size(plan) == N, "world size");
    int64_t *seen = calloc(n, sizeof *seen);
    int64_t shard = 0, prev_first_pos = -1;
    int64_t *pos = malloc(n * sizeof *pos);                 /* position of a param in order */
    for (size_t i = 0; i < n; i++) pos[order[i]] = (int64_t)i;
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        CHECK(zx_plan_bucket(plan, b, &bi) == ZX_OK, "bucket %lld", (long long)b);
        /* Note [Aligned pieces]: piece starts at pa elements, slices at lcm(align, pa) */
        const int64_t pa = zx_plan_piece_align(pp.param_align_bytes, (zx_dtype)bi.dtype);
        const int64_t sa = zx_plan_slice_align(pp.align, pp.param_align_bytes);
        const int64_t esize = (int64_t)zx_dtype_size((zx_dtype)bi.dtype), q = N * sa;
        CHECK(pa >= 1 && sa % pa == 0 && sa % pp.align == 0 && (pp.param_align_bytes <= esize || pa * esize == pp.param_align_bytes),
              "trial %d: alignments %lld %lld", trial, (long long)pa, (long long)sa);
        const int64_t used = bi.numel + bi.gap_numel;
        CHECK(bi.padded_numel % q == 0 && bi.padded_numel >= used && bi.padded_numel - used < q,
              "trial %d bucket %lld padding %lld of %lld", trial, (long long)b, (long long)bi.padded_numel, (long long)bi.numel);
        CHECK(bi.slice_numel * N == bi.padded_numel && bi.slice_numel % sa == 0, "slices");
        CHECK(zx_plan_shard_offset(plan, b) == shard && shard % sa == 0, "shard offset of bucket %lld", (long long)b);
        shard += bi.slice_numel;
        /* parameters: same key, packed in layout order each at its next aligned element, cap respected */
        int64_t off = 0, bytes = 0, first_pos = -1, sum = 0;
        for (int64_t k = 0; k < bi.num_params; k++) {
            int64_t p = -1;
            CHECK(zx_plan_bucket_param(plan, b, k, &p) == ZX_OK && p >= 0 && p < (int64_t)n, "bucket param");
            if (p < 0 || p >= (int64_t)n) continue;
            seen[p]++;
            zx_param_loc loc;
            CHECK(zx_plan_param(plan, p, &loc) == ZX_OK, "param loc");
            off = round_up(off, pa);
            CHECK(loc.bucket == b && loc.offset == off && loc.numel == numel[p], "trial %d: param %lld at %lld, expected %lld",
                  trial, (long long)p, (long long)loc.offset, (long long)off);
            CHECK(pp.param_align_bytes == 0 || (loc.offset * esize) % pp.param_align_bytes == 0 ||
                  pp.param_align_bytes < esize, "trial %d: param %lld starts unaligned", trial, (long long)p);
            CHECK(group[p] == bi.group && dtype[p] == bi.dtype, "key of param %lld", (long long)p);
            if (use_units) CHECK(unit[p] == bi.unit, "unit of param %lld", (long long)p);
            if (k == 0) first_pos = pos[p];
            CHECK(pos[p] >= first_pos, "layout follows order");
            off += numel[p];
            sum += numel[p];
            bytes += numel[p] * (int64_t)zx_dtype_size((zx_dtype)dtype[p]);
        }
        CHECK(sum == bi.numel && off == bi.numel + bi.gap_numel, "trial %d: numel sum and gaps", trial);
        if (pp.param_align_bytes <= esize) CHECK(bi.gap_numel == 0, "no gaps when elements are aligned already");
        const int64_t cap = b == 0 ? pp.first_bucket_bytes : pp.bucket_bytes;
        CHECK(bi.num_params == 1 || bytes <= cap, "trial %d bucket %lld: %lld bytes over cap %lld", trial,
              (long long)b, (long long)bytes, (long long)cap);
        CHECK(first_pos > prev_first_pos, "buckets numbered by their first parameter");
        prev_first_pos = first_pos;
        /* fragments: each rank's pieces follow each other in its slice, each aligned (the slice
         * start is: a fragment that begins inside a parameter begins at it); all ranks cover each
         * param once */
        int64_t covered = 0;
        for (int32_t r = 0; r < N; r++) {
            int64_t count = 0;
            zx_status fs = zx_plan_fragments(plan, b, r, NULL, 0, &count);
            CHECK(fs == ZX_OK || fs == ZX_ERR_BUFFER_TOO_SMALL, "fragment count");
            zx_fragment *fr = malloc((size_t)(count + 1) * sizeof *fr);
            CHECK(zx_plan_fragments(plan, b, r, fr, count + 1, &count) == ZX_OK, "fragments");
            int64_t at = 0;
            for (int64_t k = 0; k < count; k++) {
                zx_param_loc loc;
                zx_plan_param(plan, fr[k].param, &loc);
                CHECK(fr[k].slice_offset >= at && fr[k].slice_offset - at < pa && fr[k].slice_offset % pa == 0,
                      "trial %d: fragments follow each other in the slice, each aligned", trial);
                at = fr[k].slice_offset;
                CHECK(loc.offset + fr[k].param_offset == (int64_t)r * bi.slice_numel + fr[k].slice_offset,
                      "fragment maps to the right element");
                CHECK(fr[k].param_offset + fr[k].numel <= loc.numel && fr[k].numel > 0, "fragment inside param");
                at += fr[k].numel;
                covered += fr[k].numel;
            }
            free(fr);
        }
        CHECK(covered == bi.numel, "fragments cover the bucket exactly: %lld vs %lld", (long long)covered, (long long)bi.numel);
    }
    CHECK(shard == zx_plan_shard_numel(plan), "shard numel");
    for (size_t i = 0; i < n; i++) CHECK(seen[i] == 1, "param %zu placed %lld times", i, (long long)seen[i]);
    /* describe: measure, then print into an exact buffer */
    size_t need = 0;
    zx_plan_describe(plan, NULL, 0, &need);
    char *txt = malloc(need + 1);
    CHECK(zx_plan_describe(plan, txt, need + 1, &need) == ZX_OK && strlen(txt) == need, "describe");
    free(txt);
    /* determinism */
    zx_plan *again = NULL;
    CHECK(zx_plan_create(&pp, &again) == ZX_OK && zx_plan_num_buckets(again) == nb, "same plan twice");
    zx_plan_free(again);
    free(seen); free(pos);
    zx_plan_free(plan);
done:
    free(numel); free(order); free(dtype); free(group); free(unit);
}

static void check_errors(void) {
    int64_t numel[2] = {3, 4}, order[2] = {1, 0}, bad_order[2] = {1, 1};
    int32_t dtype[2] = {0, 0}, group[2] = {0, 0};
    zx_plan_params pp = {2, numel, dtype, group, NULL, order, 2, 1024, 256, 4, NULL, NULL, 0};   /* packed tight */
    zx_plan *plan = (zx_plan *)0x1;
    CHECK(zx_plan_create(NULL, &plan) == ZX_ERR_INVALID_ARG && plan == NULL, "NULL params");
    CHECK(zx_plan_create(&pp, NULL) == ZX_ERR_INVALID_ARG, "NULL out");
    zx_plan_params q = pp; q.order = bad_order;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG, "order not a permutation");
    q = pp; q.world_size = 0;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG, "world size 0");
    q = pp; q.align = 0;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG, "align 0");
    int64_t zero[2] = {0, 4};
    q = pp; q.numel = zero;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG, "empty parameter");
    int32_t bad_dtype[2] = {0, 7};
    q = pp; q.dtype = bad_dtype;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG, "unknown dtype");
    int64_t huge[2] = {INT64_MAX / 2, 4};
    q = pp; q.numel = huge;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_OVERFLOW, "byte size overflow");
    CHECK(zx_plan_create(&pp, &plan) == ZX_OK, "valid plan");
    zx_bucket_info bi;
    CHECK(zx_plan_bucket(plan, 99, &bi) == ZX_ERR_INVALID_ARG, "bucket out of range");
    int64_t count;
    CHECK(zx_plan_fragments(plan, 0, 2, NULL, 0, &count) == ZX_ERR_INVALID_ARG, "rank out of range");
    /* 7 elements, 2 ranks, align 4: padded to 8, slices of 4; rank 0 holds param 1 (4 elems) */
    CHECK(zx_plan_bucket(plan, 0, &bi) == ZX_OK && bi.numel == 7 && bi.padded_numel == 8 && bi.slice_numel == 4,
          "small worked example");
    zx_fragment fr[2];
    CHECK(zx_plan_fragments(plan, 0, 0, fr, 2, &count) == ZX_OK && count == 1 && fr[0].param == 1 && fr[0].numel == 4,
          "rank 0 owns param 1");
    CHECK(zx_plan_fragments(plan, 0, 1, fr, 0, &count) == ZX_ERR_BUFFER_TOO_SMALL && count == 1, "too small");
    zx_plan_free(plan);
    zx_plan_free(NULL);
    /* Note [Aligned pieces]: a power of two up to ZX_MAX_PARAM_ALIGN_BYTES, or 0 */
    const int64_t bad_align[] = {-16, 3, 24, 2 * ZX_MAX_PARAM_ALIGN_BYTES};
    for (size_t k = 0; k < sizeof bad_align / sizeof bad_align[0]; k++) {
        q = pp; q.param_align_bytes = bad_align[k];
        plan = (zx_plan *)0x1;
        CHECK(zx_plan_create(&q, &plan) == ZX_ERR_INVALID_ARG && plan == NULL, "param_align_bytes %lld refused",
              (long long)bad_align[k]);
    }
    CHECK(zx_plan_piece_align(16, ZX_F32) == 4 && zx_plan_piece_align(16, ZX_BF16) == 8 &&
          zx_plan_piece_align(2, ZX_F32) == 1 && zx_plan_piece_align(0, ZX_F16) == 1 &&
          zx_plan_piece_align(12, ZX_F32) == 0 && zx_plan_piece_align(16, (zx_dtype)7) == 0, "piece alignments");
    CHECK(zx_plan_slice_align(16, 16) == 16 && zx_plan_slice_align(1, 16) == 8 && zx_plan_slice_align(12, 16) == 24 &&
          zx_plan_slice_align(6, 0) == 6 && zx_plan_slice_align(3, 4) == 6 && zx_plan_slice_align(0, 16) == 0,
          "slice alignments: lcm(align, pa of a 2-byte element)");
    q = pp; q.world_size = 1 << 20; q.align = INT64_MAX >> 22; q.param_align_bytes = 16;
    CHECK(zx_plan_create(&q, &plan) == ZX_ERR_OVERFLOW, "slice quantum overflow");
    /* bf16 [4] then [3], 16-byte starts: the second at element 8 (4 gap elements); slices are
     * multiples of lcm(4, 8) = 8, so the bucket pads 11 to 16 and each rank holds one parameter */
    int32_t bf16[2] = {ZX_BF16, ZX_BF16};
    q = pp; q.dtype = bf16; q.param_align_bytes = 16;
    CHECK(zx_plan_create(&q, &plan) == ZX_OK, "aligned plan");
    zx_param_loc loc;
    CHECK(zx_plan_param(plan, 0, &loc) == ZX_OK && loc.offset == 8 && zx_plan_bucket(plan, 0, &bi) == ZX_OK &&
          bi.numel == 7 && bi.gap_numel == 4 && bi.padded_numel == 16 && bi.slice_numel == 8, "aligned worked example");
    CHECK(zx_plan_fragments(plan, 0, 1, fr, 2, &count) == ZX_OK && count == 1 && fr[0].param == 0 &&
          fr[0].slice_offset == 0 && fr[0].numel == 3, "rank 1 holds param 0 from its slice start");
    size_t need = 0;
    zx_plan_describe(plan, NULL, 0, &need);
    char *txt = malloc(need + 1);
    CHECK(zx_plan_describe(plan, txt, need + 1, &need) == ZX_OK && strstr(txt, "of which 4 between pieces"),
          "describe reports the gaps");
    free(txt);
    zx_plan_free(plan);
}

/* Note [Tensor-atomic buckets]: random mixes of atomic and element-granular
 * parameters. Every atomic parameter lies whole in its owner's slice (one
 * fragment, on the owner only), slices stay equal, the largest bin is within one
 * tensor of the mean (padding bound), and the load per rank adds up. */
static void check_atomic_plan(int trial) {
    const size_t n = (size_t)rnd_range(1, 80);
    int64_t *numel = malloc(n * sizeof *numel), *order = malloc(n * sizeof *order);
    int32_t *dtype = malloc(n * sizeof *dtype), *group = malloc(n * sizeof *group);
    double *cost = malloc(n * sizeof *cost);
    for (size_t i = 0; i < n; i++) {
        const int64_t rows = rnd_range(1, 64), cols = rnd_range(1, 64);
        numel[i] = rows * cols;
        dtype[i] = rnd() % 2 ? ZX_BF16 : ZX_F32;   /* one dtype per run, below */
        group[i] = (int32_t)(rnd() % 2);        /* group 0 atomic (Muon), group 1 elementwise */
        cost[i] = group[i] == 0 ? zx_update_cost(ZX_UPDATE_ORTHOGONALIZED, rows, cols) : 0.0;
        order[i] = (int64_t)(n - 1 - i);
    }
    for (size_t i = 0; i < n; i++) dtype[i] = dtype[0];
    const int32_t N = (int32_t)rnd_range(1, 9);
    zx_plan_params pp = {n, numel, dtype, group, NULL, order, N, rnd_range(64, 40000), rnd_range(64, 8000),
                         rnd_range(1, 16), cost, NULL, rnd_param_align()};
    const int64_t pa = zx_plan_piece_align(pp.param_align_bytes, (zx_dtype)dtype[0]);
    const int64_t sa = zx_plan_slice_align(pp.align, pp.param_align_bytes);
    zx_plan *plan = NULL;
    CHECK(zx_plan_create(&pp, &plan) == ZX_OK && plan, "trial %d: atomic create", trial);
    if (!plan) goto done;
    double total_cost = 0.0;
    int64_t total_numel = 0;
    for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
        zx_bucket_info bi;
        zx_plan_bucket(plan, b, &bi);
        CHECK(bi.slice_numel * N == bi.padded_numel && bi.slice_numel % sa == 0, "atomic slices");
        CHECK(bi.atomic == (bi.group == 0), "bucket %lld atomic flag", (long long)b);
        if (!bi.atomic) continue;
        int64_t biggest = 0, count_frag = 0, rounded = 0;   /* sizes rounded up to pa (Note [Aligned pieces]) */
        for (int64_t k = 0; k < bi.num_params; k++) {
            int64_t q;
            zx_plan_bucket_param(plan, b, k, &q);
            zx_param_loc loc;
            zx_plan_param(plan, q, &loc);
            const int32_t r = zx_plan_owner(plan, q);
            CHECK(r >= 0 && r < N, "owner of %lld", (long long)q);
            CHECK(loc.offset >= (int64_t)r * bi.slice_numel &&
                  loc.offset + loc.numel <= (int64_t)(r + 1) * bi.slice_numel, "param %lld whole in slice %d", (long long)q, r);
            CHECK(loc.offset % pa == 0, "trial %d: atomic param %lld starts aligned", trial, (long long)q);
            biggest = round_up(numel[q], pa) > biggest ? round_up(numel[q], pa) : biggest;
            rounded += round_up(numel[q], pa);
            total_cost += cost[q];
            total_numel += numel[q];
        }
        for (int32_t r = 0; r < N; r++) {
            int64_t count = 0;
            zx_plan_fragments(plan, b, r, NULL, 0, &count);
            zx_fragment *fr = malloc((size_t)(count + 1) * sizeof *fr);
            zx_plan_fragments(plan, b, r, fr, count + 1, &count);
            for (int64_t k = 0; k < count; k++)
                CHECK(fr[k].param_offset == 0 && fr[k].numel == numel[fr[k].param] &&
                      zx_plan_owner(plan, fr[k].param) == r, "fragment of an atomic param is whole, on its owner");
            count_frag += count;
            free(fr);
        }
        CHECK(count_frag == bi.num_params, "each atomic param is one fragment");
        const int64_t mean = (rounded + N - 1) / N;
        CHECK(bi.slice_numel <= mean + biggest + sa, "trial %d: slice %lld over mean %lld + largest %lld", trial,
              (long long)bi.slice_numel, (long long)mean, (long long)biggest);
    }
    double c = 0.0;
    int64_t m = 0;
    for (int32_t r = 0; r < N; r++) {
        double rc;
        int64_t rn;
        CHECK(zx_plan_rank_load(plan, r, &rc, &rn) == ZX_OK, "rank load");
        c += rc;
        m += rn;
    }
    CHECK(m == total_numel && c - total_cost <= 1e-9 * total_cost && total_cost - c <= 1e-9 * total_cost, "loads add up");
    for (size_t i = 0; i < n; i++)
        if (group[i] != 0) CHECK(zx_plan_owner(plan, (int64_t)i) == -1, "elementwise params have no owner");
    zx_plan_free(plan);
done:
    free(numel); free(order); free(dtype); free(group); free(cost);
}

/* Equal matrices at N ranks: every rank gets the same number, no padding. */
static void check_atomic_balance(void) {
    enum { n = 24 };
    int64_t numel[n], order[n];
    int32_t dtype[n], group[n];
    double cost[n];
    for (int i = 0; i < n; i++) {
        numel[i] = 64 * 64; dtype[i] = 0; group[i] = 0; order[i] = i;
        cost[i] = zx_update_cost(ZX_UPDATE_ORTHOGONALIZED, 64, 64);
    }
    zx_plan_params pp = {n, numel, dtype, group, NULL, order, 4, 1 << 30, 1 << 30, 16, cost, NULL, 16};
    zx_plan *plan = NULL;
    CHECK(zx_plan_create(&pp, &plan) == ZX_OK, "balance create");
    zx_bucket_info bi;
    zx_plan_bucket(plan, 0, &bi);
    CHECK(bi.padded_numel == bi.numel, "no padding for equal matrices");
    for (int32_t r = 0; r < 4; r++) {
        double c;
        int64_t m;
        zx_plan_rank_load(plan, r, &c, &m);
        CHECK(m == 6 * 64 * 64, "rank %d holds 6 matrices", r);
    }
    CHECK(zx_update_cost(ZX_UPDATE_FACTORED, 3, 5) == 15.0 && zx_update_cost(ZX_UPDATE_ORTHOGONALIZED, 3, 5) == 45.0 &&
          zx_update_cost(ZX_UPDATE_ELEMENTWISE, 3, 5) == 0.0, "update costs");
    zx_plan_free(plan);
}

int main(void) {
    check_errors();
    for (int t = 0; t < 2000; t++) check_random_plan(t);
    for (int t = 0; t < 1000; t++) check_atomic_plan(t);
    check_atomic_balance();
    printf("test_plan: %ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
