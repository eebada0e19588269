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
    int64_t *bucket_params;     /* (num_params,) params in bucket layout order; bucket b
                                   owns [buckets[b].first_param, +num_params) */
    zx_param_loc *locs;         /* (num_params,) where each parameter lives */
    int32_t *owner;             /* (num_params,) owning rank of an atomic param, else -1 */
    double *cost;               /* (num_params,) update cost of an atomic param, else 0 */
    int64_t *shard_offsets;     /* (num_buckets,) offset of bucket b's slice in a shard */
    int64_t shard_numel;        /* sum of slice_numel */
};

/* Scratch state while assembling (Note [Bucket assembly]). */
typedef struct zx_open_bucket {
    int32_t group, dtype, atomic;
    int64_t bucket;             /* index into the growing bucket array, -1 if none */
} zx_open_bucket;

static int zx_add_overflows(int64_t a, int64_t b) { return b > 0 && a > INT64_MAX - b; }

static int zx_is_atomic(const zx_plan_params *p, int64_t q) { return p->cost && p->cost[q] > 0.0; }

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
    if ((int64_t)p->world_size > INT64_MAX / p->align) return ZX_ERR_OVERFLOW;
    for (size_t i = 0; i < p->num_params; i++) {
        if (p->numel[i] <= 0 || p->group[i] < 0) return ZX_ERR_INVALID_ARG;
        if (zx_dtype_size((zx_dtype)p->dtype[i]) == 0) return ZX_ERR_INVALID_ARG;
        if (p->cost && !(p->cost[i] >= 0.0)) return ZX_ERR_INVALID_ARG;   /* also NaN */
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
        bin_numel[best] += p->numel[q];
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
        plan->bucket_params = malloc((size_t)n * sizeof *plan->bucket_params);
        plan->locs = malloc((size_t)n * sizeof *plan->locs);
        plan->owner = malloc((size_t)n * sizeof *plan->owner);
        plan->cost = calloc((size_t)n, sizeof *plan->cost);
    }
    if (!plan || !bucket_of || !open || !bucket_bytes || !plan->buckets || !plan->bucket_params ||
        !plan->locs || !plan->owner || !plan->cost) {
        free(bucket_of); free(open); free(bucket_bytes); zx_plan_free(plan);
        return ZX_ERR_OUT_OF_MEMORY;
    }
    plan->world_size = nr;
    plan->num_params = n;
    for (int64_t q = 0; q < n; q++) {
        plan->owner[q] = -1;
        if (zx_is_atomic(p, q)) plan->cost[q] = p->cost[q];
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
        plan->bucket_params[bi->first_param + bi->num_params++] = q;
    }
    free(bucket_of);

    /* Pass 3: offsets inside each bucket, padding, slices, shard offsets. */
    plan->shard_offsets = malloc((size_t)num_buckets * sizeof *plan->shard_offsets);
    int64_t *idx = malloc((size_t)n * sizeof *idx), *bin_numel = malloc((size_t)nr * sizeof *bin_numel);
    double *bin_cost = malloc((size_t)nr * sizeof *bin_cost), *rank_cost = calloc((size_t)nr, sizeof *rank_cost);
    int32_t *bin_rank = malloc((size_t)nr * sizeof *bin_rank), *rank_of = malloc((size_t)nr * sizeof *rank_of);
    int32_t *rank_for_bin = malloc((size_t)nr * sizeof *rank_for_bin);
    int64_t *fill = malloc((size_t)nr * sizeof *fill);
    if (!plan->shard_offsets || !idx || !bin_numel || !bin_cost || !rank_cost || !bin_rank || !rank_of ||
        !rank_for_bin || !fill)
        st = ZX_ERR_OUT_OF_MEMORY;
    const int64_t quantum = (int64_t)nr * p->align;
    int64_t shard = 0;
    for (int64_t b = 0; b < num_buckets && st == ZX_OK; b++) {
        zx_bucket_info *bi = &plan->buckets[b];
        int64_t *bp = plan->bucket_params + bi->first_param;
        if (bi->atomic) {
            const int64_t biggest = zx_bin_atomic(p, bp, bi->num_params, plan->owner, rank_cost, idx, bin_numel,
                                                  bin_cost, bin_rank, rank_of, rank_for_bin);
            if (biggest > INT64_MAX / nr - p->align) { st = ZX_ERR_OVERFLOW; break; }
            bi->slice_numel = (biggest + p->align - 1) / p->align * p->align;
            bi->padded_numel = bi->slice_numel * nr;
            /* layout order: by rank, then by `order` (stable insertion sort by owner) */
            for (int64_t j = 1; j < bi->num_params; j++) {
                const int64_t v = bp[j];
                int64_t t = j;
                while (t > 0 && plan->owner[bp[t - 1]] > plan->owner[v]) { bp[t] = bp[t - 1]; t--; }
                bp[t] = v;
            }
            for (int32_t r = 0; r < nr; r++) fill[r] = 0;
            for (int64_t j = 0; j < bi->num_params; j++) {
                const int64_t q = bp[j];
                const int32_t r = plan->owner[q];
                plan->locs[q].bucket = b;
                plan->locs[q].offset = (int64_t)r * bi->slice_numel + fill[r];
                plan->locs[q].numel = p->numel[q];
                fill[r] += p->numel[q];
            }
        } else {
            if (bi->numel > INT64_MAX - quantum) { st = ZX_ERR_OVERFLOW; break; }
            bi->padded_numel = (bi->numel + quantum - 1) / quantum * quantum;
            bi->slice_numel = bi->padded_numel / nr;
            int64_t off = 0;
            for (int64_t j = 0; j < bi->num_params; j++) {
                const int64_t q = bp[j];
                plan->locs[q].bucket = b;
                plan->locs[q].offset = off;
                plan->locs[q].numel = p->numel[q];
                off += p->numel[q];
            }
        }
        plan->shard_offsets[b] = shard;
        if (zx_add_overflows(shard, bi->slice_numel)) { st = ZX_ERR_OVERFLOW; break; }
        shard += bi->slice_numel;
    }
    free(idx); free(bin_numel); free(bin_cost); free(rank_cost); free(bin_rank); free(rank_of); free(rank_for_bin); free(fill);
    if (st != ZX_OK) { zx_plan_free(plan); return st; }
    plan->shard_numel = shard;
    *out = plan;
    return ZX_OK;
}

void zx_plan_free(zx_plan *plan) {
    if (!plan) return;
    free(plan->buckets);
    free(plan->bucket_params);
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
    *param = plan->bucket_params[bi->first_param + k];
    return ZX_OK;
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
        const int64_t q = plan->bucket_params[bi->first_param + k];
        const zx_param_loc *loc = &plan->locs[q];
        const int64_t a = loc->offset > lo ? loc->offset : lo;
        const int64_t e = loc->offset + loc->numel < hi ? loc->offset + loc->numel : hi;
        if (a >= e) continue;
        if (found < cap) {
            out[found].param = q;
            out[found].bucket = b;
            out[found].param_offset = a - loc->offset;
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
    zx_append(buf, cap, &len, "%6s %5s %4s %5s %7s %12s %12s %12s\n", "bucket", "group", "unit",
              "dtype", "params", "numel", "padded", "slice");
    for (int64_t b = 0; b < plan->num_buckets; b++) {
        const zx_bucket_info *bi = &plan->buckets[b];
        zx_append(buf, cap, &len, "%6lld %5d %4d %5s %7lld %12lld %12lld %12lld\n", (long long)b,
                  bi->group, bi->unit, dtype_names[bi->dtype], (long long)bi->num_params,
                  (long long)bi->numel, (long long)bi->padded_numel, (long long)bi->slice_numel);
    }
    *needed = len;
    return len < cap ? ZX_OK : ZX_ERR_BUFFER_TOO_SMALL;
}
