/* zx_plan.c — the partition planner.
 *
 * A pure function from (sizes, dtypes, groups, units, order, N, caps, align) to
 * (buckets, parameter offsets, per-rank fragments). It allocates only its own
 * bookkeeping, never tensors, and is the single source of truth for every
 * offset used by the binding. Build and test standalone: make -C csrc/core test.
 *
 * Note [Bucket assembly]
 *   Walk `order`. Each (group, dtype) key has at most one open bucket. A
 *   parameter joins its key's open bucket unless that would push the bucket
 *   past its cap (first bucket of the plan: first_bucket_bytes, others:
 *   bucket_bytes); then the open bucket is closed and a new one opened. A
 *   change of `unit` between consecutive parameters closes all open buckets.
 *   Buckets are numbered by the position of their first parameter in `order`,
 *   so every rank that plans the same inputs gets the same numbering.
 */
#include "zx_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct zx_plan {
    int32_t world_size;
    int64_t num_params;
    int64_t num_buckets;
    zx_bucket_info *buckets;    /* (num_buckets,) */
    zx_piece *pieces;           /* (num_pieces,) in bucket layout order; bucket b owns
                                   [buckets[b].first_param, +num_params) */
    int64_t num_pieces;
    zx_param_loc *locs;         /* (num_params,) where each parameter lives */
    int32_t *owner;             /* (num_params,) owning rank of an atomic param, else -1 */
    double *cost;               /* (num_params,) update cost of an atomic param, else 0 */
    double *state;              /* (num_params,) optimizer state bytes per element, or 0 */
    int64_t *shard_offsets;     /* (num_buckets,) offset of bucket b's slice in a shard */
    int64_t shard_numel;        /* sum of slice_numel */
    double fill_level;          /* Note [Filling atomic buckets]: the state level, 0 if unfilled */
    int64_t param_align_bytes;  /* Note [Aligned pieces], as given */
};

/* Scratch state while assembling (Note [Bucket assembly]). */
typedef struct zx_open_bucket {
    int32_t group, dtype, atomic;
    int64_t bucket;             /* index into the growing bucket array, -1 if none */
} zx_open_bucket;

static int zx_add_overflows(int64_t a, int64_t b) { return b > 0 && a > INT64_MAX - b; }

static int zx_is_atomic(const zx_plan_params *p, int64_t q) { return p->cost && p->cost[q] > 0.0; }

/* x rounded up to a multiple of a (a >= 1; the callers have checked it fits). */
static int64_t zx_round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int64_t zx_gcd(int64_t a, int64_t b) {
    while (b) { const int64_t t = a % b; a = b; b = t; }
    return a;
}

int64_t zx_plan_piece_align(int64_t param_align_bytes, zx_dtype dtype) {
    const int64_t esize = (int64_t)zx_dtype_size(dtype);
    if (esize == 0 || param_align_bytes < 0 || param_align_bytes > ZX_MAX_PARAM_ALIGN_BYTES ||
        (param_align_bytes & (param_align_bytes - 1)) != 0)
        return 0;
    return param_align_bytes > esize ? param_align_bytes / esize : 1;   /* both powers of two */
}

int64_t zx_plan_slice_align(int64_t align, int64_t param_align_bytes) {
    const int64_t pa = zx_plan_piece_align(param_align_bytes, ZX_BF16);   /* the smallest element */
    if (pa == 0 || align < 1 || align / zx_gcd(align, pa) > INT64_MAX / pa) return 0;
    return align / zx_gcd(align, pa) * pa;
}

/* Note [Aligned pieces], for parameter q's dtype (validated). */
static int64_t zx_piece_align_of(const zx_plan_params *p, int64_t q) {
    return zx_plan_piece_align(p->param_align_bytes, (zx_dtype)p->dtype[q]);
}
static int64_t zx_slice_align_of(const zx_plan_params *p) { return zx_plan_slice_align(p->align, p->param_align_bytes); }

double zx_update_cost(zx_update_kind kind, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return 0.0;
    const double m = (double)rows, n = (double)cols;
    switch (kind) {
    case ZX_UPDATE_FACTORED: return m * n;
    case ZX_UPDATE_ORTHOGONALIZED: return m * n * (m < n ? m : n);
    default: return 0.0;
    }
}

static zx_status zx_validate(const zx_plan_params *p) {
    if (!p || !p->numel || !p->dtype || !p->group || !p->order) return ZX_ERR_INVALID_ARG;
    if (p->num_params == 0 || p->num_params > (size_t)INT64_MAX / 8) return ZX_ERR_INVALID_ARG;
    if (p->world_size < 1 || p->bucket_bytes <= 0 || p->first_bucket_bytes <= 0 || p->align < 1)
        return ZX_ERR_INVALID_ARG;
    if (zx_plan_piece_align(p->param_align_bytes, ZX_F32) == 0) return ZX_ERR_INVALID_ARG;
    /* the largest slice quantum: world_size * align * (param_align_bytes / 2) (Note [Aligned pieces]) */
    const int64_t max_pa = p->param_align_bytes > 2 ? p->param_align_bytes / 2 : 1;
    if ((int64_t)p->world_size > INT64_MAX / p->align / max_pa) return ZX_ERR_OVERFLOW;
    for (size_t i = 0; i < p->num_params; i++) {
        if (p->numel[i] <= 0 || p->group[i] < 0) return ZX_ERR_INVALID_ARG;
        if (zx_dtype_size((zx_dtype)p->dtype[i]) == 0) return ZX_ERR_INVALID_ARG;
        if (p->cost && !(p->cost[i] >= 0.0)) return ZX_ERR_INVALID_ARG;   /* also NaN */
        if (p->state && !(p->state[i] >= 0.0 && p->state[i] < 1e300)) return ZX_ERR_INVALID_ARG;
    }
    /* order must be a permutation */
    char *seen = calloc(p->num_params, 1);
    if (!seen) return ZX_ERR_OUT_OF_MEMORY;
    zx_status st = ZX_OK;
    for (size_t i = 0; i < p->num_params && st == ZX_OK; i++) {
        int64_t q = p->order[i];
        if (q < 0 || (size_t)q >= p->num_params || seen[q]) st = ZX_ERR_INVALID_ARG;
        else seen[q] = 1;
    }
    free(seen);
    return st;
}

/* Note [Tensor-atomic buckets] (zx_core.h): bin the k parameters params[0..k) of
 * one atomic bucket; writes each one's rank to owner[] and returns the largest
 * bin's element count. rank_cost (world_size,) accumulates across buckets.
 * Scratch: idx (k,); bin_numel, bin_cost, bin_rank, rank_of, rank_for_bin (world_size,). */
static int64_t zx_bin_atomic(const zx_plan_params *p, const int64_t *params, int64_t k, int32_t *owner,
                             double *rank_cost, int64_t *idx, int64_t *bin_numel, double *bin_cost,
                             int32_t *bin_rank, int32_t *rank_of, int32_t *rank_for_bin) {
    const int32_t nr = p->world_size;
    for (int64_t j = 0; j < k; j++) idx[j] = j;
    /* insertion sort, largest first, stable by layout position (k is small) */
    for (int64_t j = 1; j < k; j++) {
        const int64_t v = idx[j];
        int64_t t = j;
        while (t > 0 && p->numel[params[idx[t - 1]]] < p->numel[params[v]]) { idx[t] = idx[t - 1]; t--; }
        idx[t] = v;
    }
    for (int32_t r = 0; r < nr; r++) { bin_numel[r] = 0; bin_cost[r] = 0.0; }
    for (int64_t j = 0; j < k; j++) {            /* largest first into the emptiest bin */
        const int64_t q = params[idx[j]];
        int32_t best = 0;
        for (int32_t r = 1; r < nr; r++)
            if (bin_numel[r] < bin_numel[best] ||
                (bin_numel[r] == bin_numel[best] && bin_cost[r] < bin_cost[best])) best = r;
        bin_numel[best] += zx_round_up(p->numel[q], zx_piece_align_of(p, q));   /* Note [Aligned pieces] */
        bin_cost[best] += p->cost[q];
        owner[q] = best;                          /* a bin for now; a rank below */
    }
    /* costliest bin to the rank with the least cost so far */
    for (int32_t r = 0; r < nr; r++) bin_rank[r] = r;
    for (int32_t a = 1; a < nr; a++) {            /* bins by cost, descending */
        const int32_t v = bin_rank[a];
        int32_t t = a;
        while (t > 0 && bin_cost[bin_rank[t - 1]] < bin_cost[v]) { bin_rank[t] = bin_rank[t - 1]; t--; }
        bin_rank[t] = v;
    }
    for (int32_t r = 0; r < nr; r++) rank_of[r] = r;
    for (int32_t a = 1; a < nr; a++) {            /* ranks by cost so far, ascending */
        const int32_t v = rank_of[a];
        int32_t t = a;
        while (t > 0 && rank_cost[rank_of[t - 1]] > rank_cost[v]) { rank_of[t] = rank_of[t - 1]; t--; }
        rank_of[t] = v;
    }
    /* pair the a-th costliest bin with the a-th cheapest rank */
    for (int32_t a = 0; a < nr; a++) rank_for_bin[bin_rank[a]] = rank_of[a];
    int64_t biggest = 0;
    for (int32_t r = 0; r < nr; r++) biggest = bin_numel[r] > biggest ? bin_numel[r] : biggest;
    for (int32_t b = 0; b < nr; b++) rank_cost[rank_for_bin[b]] += bin_cost[b];
    for (int64_t j = 0; j < k; j++) owner[params[j]] = rank_for_bin[owner[params[j]]];
    return biggest;
}

/* Pass 3a (Note [Tensor-atomic buckets]): bin every atomic bucket, set its slice,
 * order its members by owner (then by `order`); used[a*N + r] = elements of rank
 * r's whole tensors in the a-th atomic bucket. */
static zx_status zx_bin_buckets(const zx_plan_params *p, zx_plan *plan, int64_t *members, int64_t *used) {
    const int32_t nr = plan->world_size;
    const int64_t n = plan->num_params;
    int64_t *idx = malloc((size_t)n * sizeof *idx), *bin_numel = malloc((size_t)nr * sizeof *bin_numel);
    double *bin_cost = malloc((size_t)nr * sizeof *bin_cost), *rank_cost = calloc((size_t)nr, sizeof *rank_cost);
    int32_t *bin_rank = malloc((size_t)nr * sizeof *bin_rank), *rank_of = malloc((size_t)nr * sizeof *rank_of);
    int32_t *rank_for_bin = malloc((size_t)nr * sizeof *rank_for_bin);
    zx_status st = idx && bin_numel && bin_cost && rank_cost && bin_rank && rank_of && rank_for_bin
                       ? ZX_OK : ZX_ERR_OUT_OF_MEMORY;
    int64_t a = 0;
    for (int64_t b = 0; b < plan->num_buckets && st == ZX_OK; b++) {
        zx_bucket_info *bi = &plan->buckets[b];
        if (!bi->atomic) continue;
        int64_t *bp = members + bi->first_param;
        const int64_t biggest = zx_bin_atomic(p, bp, bi->num_params, plan->owner, rank_cost, idx, bin_numel,
                                              bin_cost, bin_rank, rank_of, rank_for_bin);
        const int64_t a_slice = zx_slice_align_of(p);
        if (biggest > INT64_MAX / nr - a_slice) { st = ZX_ERR_OVERFLOW; break; }
        bi->slice_numel = zx_round_up(biggest, a_slice);
        bi->padded_numel = bi->slice_numel * nr;
        /* layout order: by rank, then by `order` (stable insertion sort by owner) */
        for (int64_t j = 1; j < bi->num_params; j++) {
            const int64_t v = bp[j];
            int64_t t = j;
            while (t > 0 && plan->owner[bp[t - 1]] > plan->owner[v]) { bp[t] = bp[t - 1]; t--; }
            bp[t] = v;
        }
        int64_t *u = used + a++ * nr;
        for (int32_t r = 0; r < nr; r++) u[r] = 0;
        for (int64_t j = 0; j < bi->num_params; j++)
            u[plan->owner[bp[j]]] += zx_round_up(p->numel[bp[j]], zx_piece_align_of(p, bp[j]));
    }
    free(idx); free(bin_numel); free(bin_cost); free(rank_cost); free(bin_rank); free(rank_of); free(rank_for_bin);
    return st;
}

/* Can element-granular parameter q (taken[q] of it already moved) fill atomic bucket bi? */
static int zx_can_fill(const zx_plan_params *p, const zx_bucket_info *bi, int64_t q, const int64_t *taken) {
    return !zx_is_atomic(p, q) && p->state[q] > 0.0 && taken[q] < p->numel[q] && p->dtype[q] == bi->dtype &&
           (!p->unit || p->unit[q] == bi->unit);
}

/* Note [Filling atomic buckets], the level above max_r W_r: while every rank can
 * still take filler, raising the level costs nothing (the maximum rises as much as
 * the equal share falls), and it fills more padding. So with one dtype and no
 * units (any filler fits any gap) the level rises to the lowest of W_r + its gaps
 * times the smallest filler state per element, but not past what the fillers hold. */
static double zx_raise_level(const zx_plan_params *p, const zx_plan *plan, const int64_t *used, const double *whole,
                             double top) {
    const int32_t nr = plan->world_size;
    if (p->unit) return top;
    int32_t dtype = -1;
    for (int64_t b = 0; b < plan->num_buckets; b++) {
        const zx_bucket_info *bi = &plan->buckets[b];
        if (!bi->atomic) continue;
        if (dtype >= 0 && bi->dtype != dtype) return top;
        dtype = bi->dtype;
    }
    double s_min = 0.0, supply = 0.0;
    for (int64_t q = 0; q < plan->num_params; q++) {
        if (zx_is_atomic(p, q) || p->state[q] <= 0.0) continue;
        if (p->dtype[q] != dtype) return top;
        s_min = s_min == 0.0 || p->state[q] < s_min ? p->state[q] : s_min;
        supply += (double)p->numel[q] * p->state[q];
    }
    if (supply <= 0.0) return top;
    double cap = -1.0;
    for (int32_t r = 0; r < nr; r++) {
        int64_t gap = 0, a = 0;
        for (int64_t b = 0; b < plan->num_buckets; b++)
            if (plan->buckets[b].atomic) gap += plan->buckets[b].slice_numel - used[a++ * nr + r];
        const double c = whole[r] + (double)gap * s_min;
        cap = cap < 0.0 || c < cap ? c : cap;
    }
    double lo = top, hi = top + supply;            /* the level the fillers can bring every rank to */
    for (int it = 0; it < 100; it++) {
        const double mid = 0.5 * (lo + hi);
        double need = 0.0;
        for (int32_t r = 0; r < nr; r++) need += mid > whole[r] ? mid - whole[r] : 0.0;
        if (need <= supply) lo = mid; else hi = mid;
    }
    const double level = cap < lo ? cap : lo;
    return level > top ? level : top;
}

/* Pass 3b (Note [Filling atomic buckets]): pieces of element-granular parameters
 * into the atomic buckets' gaps, up to the level max_r W_r. taken[q] = the prefix
 * of q moved. The pieces of bucket b are fill[fill_first[b] + 0..fill_count[b]),
 * offsets ascending; each atomic bucket's numel grows by what it took. */
static zx_status zx_fill_buckets(const zx_plan_params *p, zx_plan *plan, const int64_t *used, int64_t num_atomic,
                                 int64_t *taken, zx_piece **fill, int64_t *num_fill, int64_t *fill_first,
                                 int64_t *fill_count) {
    const int32_t nr = plan->world_size;
    const int64_t n = plan->num_params;
    double *level = calloc((size_t)nr, sizeof *level);
    if (!level) return ZX_ERR_OUT_OF_MEMORY;
    for (int64_t q = 0; q < n; q++)
        if (plan->owner[q] >= 0) level[plan->owner[q]] += (double)p->numel[q] * p->state[q];
    double top = 0.0;
    for (int32_t r = 0; r < nr; r++) top = level[r] > top ? level[r] : top;
    top = zx_raise_level(p, plan, used, level, top);
    plan->fill_level = top;
    zx_status st = ZX_OK;
    int64_t cap = 0, a = num_atomic;
    for (int64_t b = plan->num_buckets - 1; b >= 0 && st == ZX_OK; b--) {   /* last-reduced first */
        zx_bucket_info *bi = &plan->buckets[b];
        fill_first[b] = *num_fill;
        if (!bi->atomic) continue;
        const int64_t *u = used + --a * nr;
        const int64_t pa = zx_plan_piece_align(p->param_align_bytes, (zx_dtype)bi->dtype);
        int64_t i = n - 1;                         /* position in `order` of the next candidate */
        for (int32_t r = 0; r < nr && st == ZX_OK; r++) {
            int64_t at = (int64_t)r * bi->slice_numel + u[r];
            const int64_t end = (int64_t)(r + 1) * bi->slice_numel;
            while (level[r] < top && (at = zx_round_up(at, pa)) < end) {   /* Note [Aligned pieces] */
                while (i >= 0 && !zx_can_fill(p, bi, p->order[i], taken)) i--;
                if (i < 0) break;
                const int64_t q = p->order[i], avail = p->numel[q] - taken[q];
                const double want = (top - level[r]) / p->state[q];
                int64_t k = avail;
                if (want < (double)avail) {
                    k = (int64_t)want;
                    if ((double)k < want) k++;
                }
                if (k > end - at) k = end - at;
                if (*num_fill == cap) {
                    cap = cap ? 2 * cap : 64;
                    zx_piece *grown = realloc(*fill, (size_t)cap * sizeof *grown);
                    if (!grown) { st = ZX_ERR_OUT_OF_MEMORY; break; }
                    *fill = grown;
                }
                (*fill)[(*num_fill)++] = (zx_piece){q, b, at, taken[q], k};
                fill_count[b]++;
                taken[q] += k;
                at += k;
                level[r] += (double)k * p->state[q];
                bi->numel += k;
            }
        }
    }
    free(level);
    return st;
}

/* Pass 3c: the pieces of every bucket in offset order (atomic: rank by rank, its
 * whole tensors then its fillers; element-granular: what the fillers left, packed
 * tight), padding, slices, shard offsets, each parameter's first piece. An
 * element-granular bucket left empty is dropped. */
static zx_status zx_assemble(const zx_plan_params *p, zx_plan *plan, const int64_t *members, const int64_t *taken,
                             const zx_piece *fill, int64_t num_fill, const int64_t *fill_first,
                             const int64_t *fill_count) {
    const int32_t nr = plan->world_size;
    const int64_t n = plan->num_params;
    int64_t total = num_fill;
    for (int64_t q = 0; q < n; q++) total += taken[q] < p->numel[q];
    plan->pieces = malloc((size_t)(total ? total : 1) * sizeof *plan->pieces);
    if (!plan->pieces) return ZX_ERR_OUT_OF_MEMORY;
    int64_t nb = 0, at = 0, shard = 0;
    for (int64_t b = 0; b < plan->num_buckets; b++) {
        zx_bucket_info bi = plan->buckets[b];      /* a copy: buckets compact in place, nb <= b */
        const int64_t *bp = members + bi.first_param, first = at;
        const int64_t pa = zx_plan_piece_align(p->param_align_bytes, (zx_dtype)bi.dtype);   /* Note [Aligned pieces] */
        if (bi.atomic) {
            int64_t j = 0, f = fill_first[b];
            const int64_t fe = f + fill_count[b];
            for (int32_t r = 0; r < nr; r++) {
                int64_t off = (int64_t)r * bi.slice_numel;
                for (; j < bi.num_params && plan->owner[bp[j]] == r; j++) {
                    plan->pieces[at++] = (zx_piece){bp[j], nb, off, 0, p->numel[bp[j]]};
                    off += zx_round_up(p->numel[bp[j]], pa);
                }
                for (; f < fe && fill[f].offset < (int64_t)(r + 1) * bi.slice_numel; f++) {
                    plan->pieces[at] = fill[f];
                    plan->pieces[at++].bucket = nb;
                }
            }
        } else {
            const int64_t quantum = (int64_t)nr * zx_slice_align_of(p);
            int64_t off = 0, sum = 0;
            for (int64_t j = 0; j < bi.num_params; j++) {
                const int64_t q = bp[j], k = p->numel[q] - taken[q];
                if (k == 0) continue;
                if (off > INT64_MAX - pa) return ZX_ERR_OVERFLOW;
                off = zx_round_up(off, pa);
                plan->pieces[at++] = (zx_piece){q, nb, off, taken[q], k};
                if (zx_add_overflows(off, k)) return ZX_ERR_OVERFLOW;
                off += k;
                sum += k;
            }
            if (off == 0) continue;                /* every piece went to fill atomic buckets */
            if (off > INT64_MAX - quantum) return ZX_ERR_OVERFLOW;
            bi.numel = sum;
            bi.padded_numel = zx_round_up(off, quantum);
            bi.slice_numel = bi.padded_numel / nr;
        }
        /* Note [Aligned pieces]: the padding before each piece that follows another in its slice */
        bi.gap_numel = 0;
        for (int64_t k = first + 1; k < at; k++) {
            const int64_t prev_end = plan->pieces[k - 1].offset + plan->pieces[k - 1].numel;
            const int64_t slice_lo = plan->pieces[k].offset / bi.slice_numel * bi.slice_numel;
            if (prev_end > slice_lo || !bi.atomic) bi.gap_numel += plan->pieces[k].offset - prev_end;
        }
        bi.first_param = first;
        bi.num_params = at - first;
        plan->buckets[nb] = bi;
        plan->shard_offsets[nb] = shard;
        if (zx_add_overflows(shard, bi.slice_numel)) return ZX_ERR_OVERFLOW;
        shard += bi.slice_numel;
        nb++;
    }
    plan->num_buckets = nb;
    plan->num_pieces = at;
    plan->shard_numel = shard;
    for (int64_t q = 0; q < n; q++) plan->locs[q].pieces = 0;
    for (int64_t k = 0; k < at; k++) {
        const zx_piece *pc = &plan->pieces[k];
        zx_param_loc *loc = &plan->locs[pc->param];
        if (pc->param_offset == 0) {
            loc->bucket = pc->bucket;
            loc->offset = pc->offset;
            loc->numel = pc->numel;
        }
        loc->pieces++;
    }
    return ZX_OK;
}

zx_status zx_plan_create(const zx_plan_params *p, zx_plan **out) {
    if (!out) return ZX_ERR_INVALID_ARG;
    *out = NULL;
    zx_status st = zx_validate(p);
    if (st != ZX_OK) return st;
    const int64_t n = (int64_t)p->num_params;
    const int32_t nr = p->world_size;

    zx_plan *plan = calloc(1, sizeof *plan);
    int64_t *bucket_of = malloc((size_t)n * sizeof *bucket_of);       /* param -> bucket */
    zx_open_bucket *open = malloc((size_t)n * sizeof *open);           /* at most n keys */
    int64_t *bucket_bytes = calloc((size_t)n, sizeof *bucket_bytes);
    if (plan) {
        plan->buckets = calloc((size_t)n, sizeof *plan->buckets);     /* at most n buckets */
        plan->state = calloc((size_t)n, sizeof *plan->state);
        plan->locs = malloc((size_t)n * sizeof *plan->locs);
        plan->owner = malloc((size_t)n * sizeof *plan->owner);
        plan->cost = calloc((size_t)n, sizeof *plan->cost);
    }
    if (!plan || !bucket_of || !open || !bucket_bytes || !plan->buckets || !plan->state ||
        !plan->locs || !plan->owner || !plan->cost) {
        free(bucket_of); free(open); free(bucket_bytes); zx_plan_free(plan);
        return ZX_ERR_OUT_OF_MEMORY;
    }
    plan->world_size = nr;
    plan->num_params = n;
    plan->param_align_bytes = p->param_align_bytes;
    for (int64_t q = 0; q < n; q++) {
        plan->owner[q] = -1;
        if (zx_is_atomic(p, q)) plan->cost[q] = p->cost[q];
        if (p->state) plan->state[q] = p->state[q];
    }

    /* Pass 1: assign parameters to buckets (Note [Bucket assembly]). */
    int64_t num_open = 0, num_buckets = 0;
    int32_t prev_unit = p->unit ? p->unit[p->order[0]] : 0;
    for (int64_t i = 0; i < n && st == ZX_OK; i++) {
        const int64_t q = p->order[i];
        const int32_t unit = p->unit ? p->unit[q] : 0;
        const int32_t atomic = zx_is_atomic(p, q);
        if (unit != prev_unit) num_open = 0;   /* a new unit closes every open bucket */
        prev_unit = unit;
        const int64_t esize = (int64_t)zx_dtype_size((zx_dtype)p->dtype[q]);
        if (p->numel[q] > INT64_MAX / esize) { st = ZX_ERR_OVERFLOW; break; }
        const int64_t bytes = p->numel[q] * esize;
        int64_t k = 0;
        while (k < num_open && (open[k].group != p->group[q] || open[k].dtype != p->dtype[q] ||
                                open[k].atomic != atomic)) k++;
        if (k < num_open) {
            const int64_t b = open[k].bucket;
            const int64_t cap = b == 0 ? p->first_bucket_bytes : p->bucket_bytes;
            if (zx_add_overflows(bucket_bytes[b], bytes)) { st = ZX_ERR_OVERFLOW; break; }
            /* Note [Tensor-atomic buckets]: an atomic bucket takes at least 2N tensors */
            const int full = bucket_bytes[b] + bytes > cap && (!atomic || plan->buckets[b].num_params >= 2 * (int64_t)nr);
            if (full) k = -1 - k;                             /* full: replace this slot */
        } else {
            k = -1 - num_open++;                             /* new key: new slot */
        }
        if (k < 0) {                                         /* open a new bucket */
            k = -1 - k;
            open[k].group = p->group[q];
            open[k].dtype = p->dtype[q];
            open[k].atomic = atomic;
            open[k].bucket = num_buckets;
            zx_bucket_info *bi = &plan->buckets[num_buckets++];
            bi->group = p->group[q];
            bi->dtype = p->dtype[q];
            bi->unit = unit;
            bi->atomic = atomic;
        }
        const int64_t b = open[k].bucket;
        bucket_of[q] = b;
        bucket_bytes[b] += bytes;
        plan->buckets[b].num_params++;
        if (zx_add_overflows(plan->buckets[b].numel, p->numel[q])) { st = ZX_ERR_OVERFLOW; break; }
        plan->buckets[b].numel += p->numel[q];
    }
    free(bucket_bytes);
    free(open);
    if (st != ZX_OK) { free(bucket_of); zx_plan_free(plan); return st; }
    plan->num_buckets = num_buckets;

    /* Pass 2: each bucket's parameters, in `order`. */
    int64_t *members = malloc((size_t)n * sizeof *members);
    if (!members) { free(bucket_of); zx_plan_free(plan); return ZX_ERR_OUT_OF_MEMORY; }
    int64_t first = 0;
    for (int64_t b = 0; b < num_buckets; b++) {
        zx_bucket_info *bi = &plan->buckets[b];
        bi->first_param = first;
        first += bi->num_params;
        bi->num_params = 0;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t q = p->order[i], b = bucket_of[q];
        zx_bucket_info *bi = &plan->buckets[b];
        members[bi->first_param + bi->num_params++] = q;
    }
    free(bucket_of);

    /* Pass 3: bin the atomic buckets, fill their gaps, lay every bucket out. */
    int64_t num_atomic = 0;
    for (int64_t b = 0; b < num_buckets; b++) num_atomic += plan->buckets[b].atomic;
    int64_t *used = malloc((size_t)(num_atomic ? num_atomic : 1) * (size_t)nr * sizeof *used);
    int64_t *taken = calloc((size_t)n, sizeof *taken);
    int64_t *fill_first = calloc((size_t)num_buckets, sizeof *fill_first);
    int64_t *fill_count = calloc((size_t)num_buckets, sizeof *fill_count);
    plan->shard_offsets = malloc((size_t)num_buckets * sizeof *plan->shard_offsets);
    zx_piece *fill = NULL;
    int64_t num_fill = 0;
    st = used && taken && fill_first && fill_count && plan->shard_offsets ? ZX_OK : ZX_ERR_OUT_OF_MEMORY;
    if (st == ZX_OK) st = zx_bin_buckets(p, plan, members, used);
    if (st == ZX_OK && p->state && num_atomic > 0 && nr > 1)
        st = zx_fill_buckets(p, plan, used, num_atomic, taken, &fill, &num_fill, fill_first, fill_count);
    if (st == ZX_OK) st = zx_assemble(p, plan, members, taken, fill, num_fill, fill_first, fill_count);
    free(members); free(used); free(taken); free(fill_first); free(fill_count); free(fill);
    if (st != ZX_OK) { zx_plan_free(plan); return st; }
    *out = plan;
    return ZX_OK;
}

void zx_plan_free(zx_plan *plan) {
    if (!plan) return;
    free(plan->buckets);
    free(plan->pieces);
    free(plan->state);
    free(plan->locs);
    free(plan->owner);
    free(plan->cost);
    free(plan->shard_offsets);
    free(plan);
}

int64_t zx_plan_num_buckets(const zx_plan *plan) { return plan ? plan->num_buckets : 0; }
int32_t zx_plan_world_size(const zx_plan *plan) { return plan ? plan->world_size : 0; }
int64_t zx_plan_shard_numel(const zx_plan *plan) { return plan ? plan->shard_numel : 0; }

int64_t zx_plan_shard_offset(const zx_plan *plan, int64_t b) {
    if (!plan || b < 0 || b >= plan->num_buckets) return -1;
    return plan->shard_offsets[b];
}

zx_status zx_plan_bucket(const zx_plan *plan, int64_t b, zx_bucket_info *out) {
    if (!plan || !out || b < 0 || b >= plan->num_buckets) return ZX_ERR_INVALID_ARG;
    *out = plan->buckets[b];
    return ZX_OK;
}

zx_status zx_plan_bucket_param(const zx_plan *plan, int64_t b, int64_t k, int64_t *param) {
    if (!plan || !param || b < 0 || b >= plan->num_buckets) return ZX_ERR_INVALID_ARG;
    const zx_bucket_info *bi = &plan->buckets[b];
    if (k < 0 || k >= bi->num_params) return ZX_ERR_INVALID_ARG;
    *param = plan->pieces[bi->first_param + k].param;
    return ZX_OK;
}

zx_status zx_plan_bucket_piece(const zx_plan *plan, int64_t b, int64_t k, zx_piece *out) {
    if (!plan || !out || b < 0 || b >= plan->num_buckets) return ZX_ERR_INVALID_ARG;
    const zx_bucket_info *bi = &plan->buckets[b];
    if (k < 0 || k >= bi->num_params) return ZX_ERR_INVALID_ARG;
    *out = plan->pieces[bi->first_param + k];
    return ZX_OK;
}

zx_status zx_plan_param_pieces(const zx_plan *plan, int64_t p, zx_piece *out, int64_t cap, int64_t *count) {
    if (!plan || !count || p < 0 || p >= plan->num_params || cap < 0 || (cap > 0 && !out))
        return ZX_ERR_INVALID_ARG;
    int64_t found = 0;
    for (int64_t k = 0; k < plan->num_pieces; k++) {
        if (plan->pieces[k].param != p) continue;
        if (found < cap) out[found] = plan->pieces[k];
        found++;
    }
    *count = found;
    return found > cap ? ZX_ERR_BUFFER_TOO_SMALL : ZX_OK;
}

zx_status zx_plan_param(const zx_plan *plan, int64_t p, zx_param_loc *out) {
    if (!plan || !out || p < 0 || p >= plan->num_params) return ZX_ERR_INVALID_ARG;
    *out = plan->locs[p];
    return ZX_OK;
}

zx_status zx_plan_fragments(const zx_plan *plan, int64_t b, int32_t rank,
                            zx_fragment *out, int64_t cap, int64_t *count) {
    if (!plan || !count || b < 0 || b >= plan->num_buckets || rank < 0 ||
        rank >= plan->world_size || cap < 0 || (cap > 0 && !out))
        return ZX_ERR_INVALID_ARG;
    const zx_bucket_info *bi = &plan->buckets[b];
    const int64_t lo = (int64_t)rank * bi->slice_numel, hi = lo + bi->slice_numel;
    int64_t found = 0;
    for (int64_t k = 0; k < bi->num_params; k++) {
        const zx_piece *pc = &plan->pieces[bi->first_param + k];
        const int64_t a = pc->offset > lo ? pc->offset : lo;
        const int64_t e = pc->offset + pc->numel < hi ? pc->offset + pc->numel : hi;
        if (a >= e) continue;
        if (found < cap) {
            out[found].param = pc->param;
            out[found].bucket = b;
            out[found].param_offset = pc->param_offset + (a - pc->offset);
            out[found].slice_offset = a - lo;
            out[found].numel = e - a;
        }
        found++;
    }
    *count = found;
    return found > cap ? ZX_ERR_BUFFER_TOO_SMALL : ZX_OK;
}

int32_t zx_plan_owner(const zx_plan *plan, int64_t p) {
    if (!plan || p < 0 || p >= plan->num_params) return -1;
    return plan->owner[p];
}

zx_status zx_plan_rank_load(const zx_plan *plan, int32_t rank, double *cost, int64_t *numel) {
    if (!plan || !cost || !numel || rank < 0 || rank >= plan->world_size) return ZX_ERR_INVALID_ARG;
    *cost = 0.0;
    *numel = 0;
    for (int64_t q = 0; q < plan->num_params; q++) {
        if (plan->owner[q] != rank) continue;
        *cost += plan->cost[q];
        *numel += plan->locs[q].numel;
    }
    return ZX_OK;
}

double zx_plan_fill_level(const zx_plan *plan) { return plan ? plan->fill_level : 0.0; }

zx_status zx_plan_rank_state(const zx_plan *plan, int32_t rank, double *bytes, double *whole_bytes) {
    if (!plan || !bytes || !whole_bytes || rank < 0 || rank >= plan->world_size) return ZX_ERR_INVALID_ARG;
    *bytes = 0.0;
    *whole_bytes = 0.0;
    for (int64_t b = 0; b < plan->num_buckets; b++) {
        const zx_bucket_info *bi = &plan->buckets[b];
        const int64_t lo = (int64_t)rank * bi->slice_numel, hi = lo + bi->slice_numel;
        for (int64_t k = 0; k < bi->num_params; k++) {
            const zx_piece *pc = &plan->pieces[bi->first_param + k];
            const int64_t a = pc->offset > lo ? pc->offset : lo;
            const int64_t e = pc->offset + pc->numel < hi ? pc->offset + pc->numel : hi;
            if (a >= e) continue;
            const double s = (double)(e - a) * plan->state[pc->param];
            *bytes += s;
            if (plan->owner[pc->param] >= 0) *whole_bytes += s;
        }
    }
    return ZX_OK;
}

/* Appends printf-style text at *len, never past cap; *len counts what was needed. */
static void zx_append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void zx_append(char *buf, size_t cap, size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const size_t room = *len < cap ? cap - *len : 0;
    const int w = vsnprintf(room ? buf + *len : NULL, room, fmt, ap);
    va_end(ap);
    if (w > 0) *len += (size_t)w;
}

zx_status zx_plan_describe(const zx_plan *plan, char *buf, size_t cap, size_t *needed) {
    if (!plan || !needed || (cap > 0 && !buf)) return ZX_ERR_INVALID_ARG;
    static const char *dtype_names[] = {"f32", "bf16", "f16"};
    size_t len = 0;
    if (cap) buf[0] = '\0';
    zx_append(buf, cap, &len, "zx_plan: %lld params, %lld buckets, world_size %d, shard %lld elements\n",
              (long long)plan->num_params, (long long)plan->num_buckets, plan->world_size,
              (long long)plan->shard_numel);
    zx_append(buf, cap, &len, "%6s %5s %4s %5s %7s %12s %8s %12s %12s\n", "bucket", "group", "unit",
              "dtype", "params", "numel", "gaps", "padded", "slice");
    int64_t gaps = 0, padding = 0;
    for (int64_t b = 0; b < plan->num_buckets; b++) {
        const zx_bucket_info *bi = &plan->buckets[b];
        zx_append(buf, cap, &len, "%6lld %5d %4d %5s %7lld %12lld %8lld %12lld %12lld\n", (long long)b,
                  bi->group, bi->unit, dtype_names[bi->dtype], (long long)bi->num_params,
                  (long long)bi->numel, (long long)bi->gap_numel, (long long)bi->padded_numel,
                  (long long)bi->slice_numel);
        gaps += bi->gap_numel;
        padding += bi->padded_numel - bi->numel;
    }
    /* Note [Aligned pieces]: what the alignment of piece starts costs, within all the padding */
    zx_append(buf, cap, &len, "padding %lld elements, of which %lld between pieces (starts aligned to %lld bytes)\n",
              (long long)padding, (long long)gaps, (long long)plan->param_align_bytes);
    *needed = len;
    return len < cap ? ZX_OK : ZX_ERR_BUFFER_TOO_SMALL;
}
