/* test_plan_fill.c — Note [Filling atomic buckets]: element-granular parameters
 * cut into the padding of tensor-atomic buckets so that optimizer state balances.
 * Random plans check the layout invariants; the GPT shapes print the balance
 * report (state bytes max/mean per rank, padding, Newton-Schulz cost balance).
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "../zx_core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static uint64_t seed = 12345;
static uint64_t next_u64(void) { /* splitmix64 */
    uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int64_t between(int64_t lo, int64_t hi) { return lo + (int64_t)(next_u64() % (uint64_t)(hi - lo + 1)); }
static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int by_param_offset(const void *a, const void *b) {
    const zx_piece *x = a, *y = b;
    return (x->param_offset > y->param_offset) - (x->param_offset < y->param_offset);
}

typedef struct problem {
    size_t n;
    int64_t *numel, *order;
    int32_t *dtype, *group, *unit;
    double *cost, *state;
} problem;

static void problem_free(problem *pr) {
    free(pr->numel); free(pr->order); free(pr->dtype); free(pr->group); free(pr->unit); free(pr->cost); free(pr->state);
}

/* The largest whole-tensor state of a rank: the level is at least this. */
static double max_whole(const zx_plan *plan, int32_t N) {
    double top = 0.0;
    for (int32_t r = 0; r < N; r++) {
        double s, w;
        zx_plan_rank_state(plan, r, &s, &w);
        top = w > top ? w : top;
    }
    return top;
}

/* Every invariant of a filled plan: pieces tile each parameter and each bucket,
 * whole tensors sit in their owner's slice, fillers are element-granular pieces of
 * compatible parameters inside one slice, state adds up, no rank is filled past the
 * level by more than one element, and a rank below it has no gap left (or nothing
 * left to fill with). Every piece starts aligned (Note [Aligned pieces]). */
static void check_filled(const problem *pr, const zx_plan_params *pp, const zx_plan *plan, int trial) {
    const int32_t N = pp->world_size;
    int one_dtype = 1;
    for (size_t q = 0; q < pr->n; q++) one_dtype &= pr->dtype[q] == pr->dtype[0];
    const int64_t sa = zx_plan_slice_align(pp->align, pp->param_align_bytes);
    const int64_t nb = zx_plan_num_buckets(plan), quantum = (int64_t)N * sa;
    double max_state = 0.0;
    for (size_t q = 0; q < pr->n; q++) max_state = pr->state[q] > max_state ? pr->state[q] : max_state;
    /* parameters: pieces cover [0, numel) once, the loc is the first piece */
    for (size_t q = 0; q < pr->n; q++) {
        int64_t count = 0;
        zx_plan_param_pieces(plan, (int64_t)q, NULL, 0, &count);
        zx_piece *pc = malloc((size_t)(count + 1) * sizeof *pc);
        CHECK(zx_plan_param_pieces(plan, (int64_t)q, pc, count + 1, &count) == ZX_OK && count >= 1, "pieces of %zu", q);
        qsort(pc, (size_t)count, sizeof *pc, by_param_offset);
        int64_t at = 0;
        for (int64_t k = 0; k < count; k++) {
            CHECK(pc[k].param_offset == at && pc[k].numel > 0, "trial %d: param %zu pieces tile it", trial, q);
            at += pc[k].numel;
        }
        CHECK(at == pr->numel[q], "trial %d: param %zu covered %lld of %lld", trial, q, (long long)at,
              (long long)pr->numel[q]);
        zx_param_loc loc;
        zx_plan_param(plan, (int64_t)q, &loc);
        CHECK(loc.pieces == count && loc.bucket == pc[0].bucket && loc.offset == pc[0].offset &&
              loc.numel == pc[0].numel, "trial %d: loc of %zu is its first piece", trial, q);
        if (pr->cost[q] > 0 || pr->state[q] == 0) CHECK(count == 1, "only fillers are cut");
        free(pc);
    }
    /* buckets */
    int64_t shard = 0;
    double fill_level[64] = {0};
    int full[64];
    for (int32_t r = 0; r < N; r++) full[r] = 1;
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_plan_bucket(plan, b, &bi);
        CHECK(bi.num_params > 0 && bi.slice_numel * N == bi.padded_numel && bi.slice_numel % sa == 0, "slices");
        CHECK(zx_plan_shard_offset(plan, b) == shard, "shard offset");
        shard += bi.slice_numel;
        const int64_t pa = zx_plan_piece_align(pp->param_align_bytes, (zx_dtype)bi.dtype);
        int64_t end = 0, sum = 0, gaps = 0;
        for (int64_t k = 0; k < bi.num_params; k++) {
            zx_piece pc;
            CHECK(zx_plan_bucket_piece(plan, b, k, &pc) == ZX_OK && pc.bucket == b, "piece");
            CHECK(pc.offset >= end && pc.offset + pc.numel <= bi.padded_numel, "trial %d: pieces in offset order",
                  trial);
            CHECK(pc.offset % pa == 0, "trial %d: piece starts aligned", trial);
            if (!bi.atomic) CHECK(pc.offset == round_up(end, pa), "element-granular pieces follow each other");
            if (!bi.atomic || (end > 0 && pc.offset / bi.slice_numel == (end - 1) / bi.slice_numel)) gaps += pc.offset - end;
            const int64_t q = pc.param;
            CHECK(pr->dtype[q] == bi.dtype, "dtype of every piece");
            if (pp->unit) CHECK(pr->unit[q] == bi.unit, "unit of every piece");
            const int32_t owner = zx_plan_owner(plan, q);
            if (bi.atomic) {
                const int32_t r = (int32_t)(pc.offset / bi.slice_numel);
                CHECK(pc.offset + pc.numel <= (int64_t)(r + 1) * bi.slice_numel, "a piece lies in one slice");
                if (owner >= 0) CHECK(owner == r && pc.numel == pr->numel[q], "whole tensor in its owner's slice");
                else {
                    CHECK(pr->state[q] > 0 && pr->cost[q] == 0, "fillers are element-granular with state");
                    fill_level[r] += (double)pc.numel * pr->state[q];
                }
            } else {
                CHECK(owner < 0, "no atomic parameter in an element-granular bucket");
            }
            end = pc.offset + pc.numel;
            sum += pc.numel;
        }
        CHECK(sum == bi.numel, "bucket numel = its pieces");
        CHECK(gaps == bi.gap_numel, "trial %d: bucket %lld gaps %lld, planner says %lld", trial, (long long)b,
              (long long)gaps, (long long)bi.gap_numel);
        if (!bi.atomic) CHECK(bi.padded_numel - bi.numel - bi.gap_numel < quantum, "element-granular padding");
        else {
            /* a rank's gap = the slice past its last piece; track whether any is left */
            for (int32_t r = 0; r < N; r++) {
                int64_t last = (int64_t)r * bi.slice_numel;
                int64_t count = 0;
                zx_plan_fragments(plan, b, r, NULL, 0, &count);
                zx_fragment *fr = malloc((size_t)(count + 1) * sizeof *fr);
                zx_plan_fragments(plan, b, r, fr, count + 1, &count);
                for (int64_t k = 0; k < count; k++)
                    last = (int64_t)r * bi.slice_numel + fr[k].slice_offset + fr[k].numel;
                if (round_up(last, pa) < (int64_t)(r + 1) * bi.slice_numel) full[r] = 0;   /* a gap under pa is none */
                free(fr);
            }
        }
        /* fragments cover the bucket once and map to the pieces */
        int64_t covered = 0;
        for (int32_t r = 0; r < N; r++) {
            int64_t count = 0;
            zx_plan_fragments(plan, b, r, NULL, 0, &count);
            zx_fragment *fr = malloc((size_t)(count + 1) * sizeof *fr);
            CHECK(zx_plan_fragments(plan, b, r, fr, count + 1, &count) == ZX_OK, "fragments");
            for (int64_t k = 0; k < count; k++) {
                covered += fr[k].numel;
                CHECK(fr[k].param_offset + fr[k].numel <= pr->numel[fr[k].param], "fragment inside its param");
            }
            free(fr);
        }
        CHECK(covered == bi.numel, "trial %d: fragments cover bucket %lld", trial, (long long)b);
    }
    CHECK(shard == zx_plan_shard_numel(plan), "shard numel");
    /* state adds up; the level is respected */
    double total = 0.0, whole_total = 0.0, want_total = 0.0, want_whole = 0.0;
    int leftover = 0;
    for (size_t q = 0; q < pr->n; q++) {
        want_total += (double)pr->numel[q] * pr->state[q];
        if (pr->cost[q] > 0) want_whole += (double)pr->numel[q] * pr->state[q];
        zx_param_loc loc;
        zx_plan_param(plan, (int64_t)q, &loc);
        zx_bucket_info bi;
        zx_plan_bucket(plan, loc.bucket, &bi);
        if (pr->cost[q] == 0 && pr->state[q] > 0) {   /* any of it still in an element-granular bucket? */
            int64_t count = 0;
            zx_plan_param_pieces(plan, (int64_t)q, NULL, 0, &count);
            zx_piece *pc = malloc((size_t)(count + 1) * sizeof *pc);
            zx_plan_param_pieces(plan, (int64_t)q, pc, count + 1, &count);
            for (int64_t k = 0; k < count; k++) {
                zx_bucket_info pb;
                zx_plan_bucket(plan, pc[k].bucket, &pb);
                if (!pb.atomic) leftover = 1;
            }
            free(pc);
        }
    }
    const double top = zx_plan_fill_level(plan);
    int filled = 0;
    for (int32_t r = 0; r < N; r++) filled |= fill_level[r] > 0;
    if (filled) CHECK(top >= max_whole(plan, N), "trial %d: level %g under the largest whole state", trial, top);
    for (int32_t r = 0; r < N; r++) {
        double s, w;
        CHECK(zx_plan_rank_state(plan, r, &s, &w) == ZX_OK, "rank state");
        total += s;
        whole_total += w;
        if (fill_level[r] > 0)
            CHECK(w + fill_level[r] <= top + max_state * (1 + 1e-9), "trial %d: rank %d filled past the level", trial, r);
        /* one dtype, no units: a rank below the level has no gap, or nothing is left to fill with */
        if (!pp->unit && one_dtype && w + fill_level[r] < top * (1 - 1e-9))
            CHECK(full[r] || !leftover, "trial %d: rank %d below the level with a gap and fillers left", trial, r);
    }
    CHECK(total <= want_total * (1 + 1e-9) && total >= want_total * (1 - 1e-9), "state adds up");
    CHECK(whole_total <= want_whole * (1 + 1e-9) && whole_total >= want_whole * (1 - 1e-9), "whole state adds up");
}

static void random_filled_plan(int trial) {
    problem pr = {0};
    pr.n = (size_t)between(1, 90);
    const size_t n = pr.n;
    pr.numel = malloc(n * sizeof *pr.numel); pr.order = malloc(n * sizeof *pr.order);
    pr.dtype = malloc(n * sizeof *pr.dtype); pr.group = malloc(n * sizeof *pr.group);
    pr.unit = malloc(n * sizeof *pr.unit); pr.cost = malloc(n * sizeof *pr.cost);
    pr.state = malloc(n * sizeof *pr.state);
    const int mixed_dtypes = next_u64() % 3 == 0, use_units = next_u64() % 3 == 0;
    for (size_t i = 0; i < n; i++) {
        const int atomic = next_u64() % 2;
        const int64_t rows = between(1, 64), cols = between(1, 64);
        pr.numel[i] = atomic ? rows * cols : (next_u64() % 3 == 0 ? between(1, 8) : between(1, 9000));
        pr.dtype[i] = mixed_dtypes ? (int32_t)(next_u64() % 2) : 0;
        pr.group[i] = atomic ? 0 : 1 + (int32_t)(next_u64() % 2);
        pr.cost[i] = atomic ? zx_update_cost(ZX_UPDATE_ORTHOGONALIZED, rows, cols) : 0.0;
        pr.state[i] = atomic ? 4.0 : (next_u64() % 5 == 0 ? 0.0 : 8.0);   /* Muon momentum; AdamW or SGD */
        pr.order[i] = (int64_t)(n - 1 - i);
        pr.unit[i] = (int32_t)((n - 1 - i) / 7);   /* non-decreasing along order */
    }
    zx_plan_params pp = {n, pr.numel, pr.dtype, pr.group, use_units ? pr.unit : NULL, pr.order, (int32_t)between(1, 12),
                         between(256, 60000), between(256, 20000), between(1, 16), pr.cost, pr.state,
                         next_u64() % 4 ? 16 : 0};
    zx_plan *plan = NULL;
    CHECK(zx_plan_create(&pp, &plan) == ZX_OK && plan, "trial %d: filled create", trial);
    if (plan) check_filled(&pr, &pp, plan, trial);
    zx_plan_free(plan);
    problem_free(&pr);
}

/* Without atomic parameters, giving state changes nothing (and neither does it
 * at world size 1). */
static void state_alone_changes_nothing(void) {
    enum { n = 40 };
    int64_t numel[n], order[n];
    int32_t dtype[n], group[n];
    double state[n], cost[n];
    for (int i = 0; i < n; i++) {
        numel[i] = between(1, 5000); dtype[i] = 0; group[i] = i % 2; order[i] = n - 1 - i;
        state[i] = 8.0; cost[i] = i % 3 == 0 ? 100.0 : 0.0;
    }
    for (int variant = 0; variant < 2; variant++) {
        zx_plan_params a = {n, numel, dtype, group, NULL, order, variant ? 1 : 5, 20000, 4000, 4,
                            variant ? cost : NULL, NULL, 16};
        zx_plan_params b = a;
        b.state = state;
        zx_plan *pa = NULL, *pb = NULL;
        CHECK(zx_plan_create(&a, &pa) == ZX_OK && zx_plan_create(&b, &pb) == ZX_OK, "plans");
        CHECK(zx_plan_num_buckets(pa) == zx_plan_num_buckets(pb) && zx_plan_shard_numel(pa) == zx_plan_shard_numel(pb),
              "variant %d: same buckets", variant);
        for (int i = 0; i < n; i++) {
            zx_param_loc la, lb;
            zx_plan_param(pa, i, &la);
            zx_plan_param(pb, i, &lb);
            CHECK(la.bucket == lb.bucket && la.offset == lb.offset && la.numel == lb.numel && lb.pieces == 1,
                  "variant %d: param %d in place", variant, i);
        }
        zx_plan_free(pa);
        zx_plan_free(pb);
    }
    double bad[n];
    memcpy(bad, state, sizeof bad);
    bad[3] = -1.0;
    zx_plan_params c = {n, numel, dtype, group, NULL, order, 2, 20000, 4000, 4, cost, bad, 16};
    zx_plan *pc = NULL;
    CHECK(zx_plan_create(&c, &pc) == ZX_ERR_INVALID_ARG && pc == NULL, "negative state refused");
}

/* The GPT of examples/gpt.py: parameters in registration order (wte, wpe, per
 * layer ln_1 w/b, qkv w/b, proj w/b, ln_2 w/b, fc w/b, proj w/b; ln_f w/b; the
 * head is tied to wte). Muon (4 bytes/element of momentum) over the hidden
 * matrices, AdamW (8 bytes/element) over the rest. */
static problem gpt_problem(int64_t vocab, int64_t block, int64_t layers, int64_t e) {
    problem pr = {0};
    pr.n = (size_t)(2 + 12 * layers + 2);
    const size_t n = pr.n;
    pr.numel = malloc(n * sizeof *pr.numel); pr.order = malloc(n * sizeof *pr.order);
    pr.dtype = calloc(n, sizeof *pr.dtype); pr.group = malloc(n * sizeof *pr.group);
    pr.unit = NULL; pr.cost = malloc(n * sizeof *pr.cost); pr.state = malloc(n * sizeof *pr.state);
    size_t k = 0;
#define ADD(R, C) do { pr.numel[k] = (R) * (C); \
        pr.cost[k] = (C) > 1 && k >= 2 ? zx_update_cost(ZX_UPDATE_ORTHOGONALIZED, R, C) : 0.0; k++; } while (0)
    ADD(vocab, e); ADD(block, e);
    for (int64_t l = 0; l < layers; l++) {
        ADD(e, 1); ADD(e, 1); ADD(3 * e, e); ADD(3 * e, 1); ADD(e, e); ADD(e, 1);
        ADD(e, 1); ADD(e, 1); ADD(4 * e, e); ADD(4 * e, 1); ADD(e, 4 * e); ADD(e, 1);
    }
    ADD(e, 1); ADD(e, 1);
#undef ADD
    for (size_t i = 0; i < n; i++) {
        pr.group[i] = pr.cost[i] > 0 ? 0 : 1;
        pr.state[i] = pr.cost[i] > 0 ? 4.0 : 8.0;
        pr.order[i] = (int64_t)(n - 1 - i);   /* stage 1/2: reverse registration */
    }
    return pr;
}

typedef struct figures { double state_balance, cost_balance, padding; } figures;

/* Plans like the engine at stage 1/2 (bucket_bytes "auto", align 16) and measures. */
static figures plan_figures(problem *pr, int32_t N, int fill) {
    int64_t bytes = 0, psi = 0;
    for (size_t i = 0; i < pr->n; i++) { bytes += 4 * pr->numel[i]; psi += pr->numel[i]; }
    int64_t cap = bytes / 8;
    cap = cap < (1 << 20) ? (1 << 20) : cap > (16 << 20) ? (16 << 20) : cap;
    zx_plan_params pp = {pr->n, pr->numel, pr->dtype, pr->group, NULL, pr->order, N, cap, 1 << 20, 16, pr->cost,
                         pr->state, 16};
    figures f = {0, 0, 0};
    zx_plan *plan = NULL;
    /* without filling: plan the same, then count state from the planner's own view */
    double *state = pr->state;
    if (!fill) pp.state = NULL;
    CHECK(zx_plan_create(&pp, &plan) == ZX_OK, "gpt plan");
    if (!plan) return f;
    double smax = 0, ssum = 0, cmax = 0, csum = 0;
    for (int32_t r = 0; r < N; r++) {
        double s = 0, w, c;
        int64_t m;
        if (fill) zx_plan_rank_state(plan, r, &s, &w);
        else {   /* state by hand: whole tensors on the owner, the rest of each slice by its pieces */
            for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
                int64_t count = 0;
                zx_plan_fragments(plan, b, r, NULL, 0, &count);
                zx_fragment *fr = malloc((size_t)(count + 1) * sizeof *fr);
                zx_plan_fragments(plan, b, r, fr, count + 1, &count);
                for (int64_t k = 0; k < count; k++) s += (double)fr[k].numel * state[fr[k].param];
                free(fr);
            }
        }
        zx_plan_rank_load(plan, r, &c, &m);
        smax = s > smax ? s : smax; ssum += s;
        cmax = c > cmax ? c : cmax; csum += c;
    }
    int64_t pad = 0;
    for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
        zx_bucket_info bi;
        zx_plan_bucket(plan, b, &bi);
        pad += bi.padded_numel - bi.numel;
    }
    f.state_balance = smax / (ssum / N);
    f.cost_balance = cmax / (csum / N);
    f.padding = (double)pad / (double)psi;
    if (fill) check_filled(pr, &pp, plan, -1);
    zx_plan_free(plan);
    return f;
}

/* The balance report: state bytes max/mean per rank with
 * whole tensors alone and with filling, padding as a fraction of the elements,
 * Newton-Schulz cost max/mean (filling leaves it alone). */
static void gpt_report(void) {
    static const struct { const char *name; int64_t vocab, block, layers, e; double bound; } models[] = {
        {"gpt (example, 4 layers)", 65, 64, 4, 128, 0},
        {"gpt24 (vocab 65, n_embd 64)", 65, 32, 24, 64, 0},
        {"gpt24m (vocab 6272, n_embd 128)", 6272, 128, 24, 128, 1.1},
        {"gpt2-medium (50257, 1024, 24 layers)", 50257, 1024, 24, 1024, 1.1},
    };
    printf("%-38s %4s %14s %14s %10s %10s %10s\n", "model", "N", "state whole", "state filled", "pad whole",
           "pad filled", "NS cost");
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++) {
        for (int32_t N = 8; N <= 64; N *= 8) {
            problem pr = gpt_problem(models[m].vocab, models[m].block, models[m].layers, models[m].e);
            const figures w = plan_figures(&pr, N, 0), f = plan_figures(&pr, N, 1);
            printf("%-38s %4d %14.3f %14.3f %9.1f%% %9.1f%% %10.3f\n", models[m].name, N, w.state_balance,
                   f.state_balance, 100 * w.padding, 100 * f.padding, f.cost_balance);
            CHECK(f.state_balance <= w.state_balance + 1e-9, "%s N=%d: filling never worsens state balance",
                  models[m].name, N);
            CHECK(f.padding <= w.padding + 1e-12, "%s N=%d: filling never adds padding", models[m].name, N);
            CHECK(f.cost_balance <= w.cost_balance + 1e-12 && f.cost_balance >= w.cost_balance - 1e-12,
                  "filling leaves the Newton-Schulz balance alone");
            if (models[m].bound > 0)
                CHECK(f.state_balance <= models[m].bound, "%s N=%d: state balance %.3f over %.2f", models[m].name, N,
                      f.state_balance, models[m].bound);
            problem_free(&pr);
        }
    }
}

int main(void) {
    state_alone_changes_nothing();
    for (int t = 0; t < 1500; t++) random_filled_plan(t);
    gpt_report();
    printf("test_plan_fill: %ld passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
