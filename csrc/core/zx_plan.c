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
    int64_t *shard_offsets;     /* (num_buckets,) offset of bucket b's slice in a shard */
    int64_t shard_numel;        /* sum of slice_numel */
};

/* Scratch state while assembling (Note [Bucket assembly]). */
typedef struct zx_open_bucket {
    int32_t group, dtype;
    int64_t bucket;             /* index into the growing bucket array, -1 if none */
} zx_open_bucket;

static int zx_add_overflows(int64_t a, int64_t b) { return b > 0 && a > INT64_MAX - b; }

static zx_status zx_validate(const zx_plan_params *p) {
    if (!p || !p->numel || !p->dtype || !p->group || !p->order) return ZX_ERR_INVALID_ARG;
    if (p->num_params == 0 || p->num_params > (size_t)INT64_MAX / 8) return ZX_ERR_INVALID_ARG;
    if (p->world_size < 1 || p->bucket_bytes <= 0 || p->first_bucket_bytes <= 0 || p->align < 1)
        return ZX_ERR_INVALID_ARG;
    if ((int64_t)p->world_size > INT64_MAX / p->align) return ZX_ERR_OVERFLOW;
    for (size_t i = 0; i < p->num_params; i++) {
        if (p->numel[i] <= 0 || p->group[i] < 0) return ZX_ERR_INVALID_ARG;
        if (zx_dtype_size((zx_dtype)p->dtype[i]) == 0) return ZX_ERR_INVALID_ARG;
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

zx_status zx_plan_create(const zx_plan_params *p, zx_plan **out) {
    if (!out) return ZX_ERR_INVALID_ARG;
    *out = NULL;
    zx_status st = zx_validate(p);
    if (st != ZX_OK) return st;
    const int64_t n = (int64_t)p->num_params;

    zx_plan *plan = calloc(1, sizeof *plan);
    int64_t *bucket_of = malloc((size_t)n * sizeof *bucket_of);       /* param -> bucket */
    zx_open_bucket *open = malloc((size_t)n * sizeof *open);           /* at most n keys */
    if (plan) {
        plan->buckets = calloc((size_t)n, sizeof *plan->buckets);     /* at most n buckets */
        plan->bucket_params = malloc((size_t)n * sizeof *plan->bucket_params);
        plan->locs = malloc((size_t)n * sizeof *plan->locs);
    }
    if (!plan || !bucket_of || !open || !plan->buckets || !plan->bucket_params || !plan->locs) {
        free(bucket_of); free(open); zx_plan_free(plan);
        return ZX_ERR_OUT_OF_MEMORY;
    }
    plan->world_size = p->world_size;
    plan->num_params = n;

    /* Pass 1: assign parameters to buckets (Note [Bucket assembly]). */
    int64_t num_open = 0, num_buckets = 0;
    int64_t *bucket_bytes = calloc((size_t)n, sizeof *bucket_bytes);
    if (!bucket_bytes) { free(bucket_of); free(open); zx_plan_free(plan); return ZX_ERR_OUT_OF_MEMORY; }
    int32_t prev_unit = p->unit ? p->unit[p->order[0]] : 0;
    for (int64_t i = 0; i < n && st == ZX_OK; i++) {
        const int64_t q = p->order[i];
        const int32_t unit = p->unit ? p->unit[q] : 0;
        if (unit != prev_unit) num_open = 0;   /* a new unit closes every open bucket */
        prev_unit = unit;
        const int64_t esize = (int64_t)zx_dtype_size((zx_dtype)p->dtype[q]);
        if (p->numel[q] > INT64_MAX / esize) { st = ZX_ERR_OVERFLOW; break; }
        const int64_t bytes = p->numel[q] * esize;
        int64_t k = 0;
        while (k < num_open && (open[k].group != p->group[q] || open[k].dtype != p->dtype[q])) k++;
        if (k < num_open) {
            const int64_t b = open[k].bucket;
            const int64_t cap = b == 0 ? p->first_bucket_bytes : p->bucket_bytes;
            if (zx_add_overflows(bucket_bytes[b], bytes)) { st = ZX_ERR_OVERFLOW; break; }
            if (bucket_bytes[b] + bytes > cap) k = -1 - k;   /* full: replace this slot */
        } else {
            k = -1 - num_open++;                             /* new key: new slot */
        }
        if (k < 0) {                                         /* open a new bucket */
            k = -1 - k;
            open[k].group = p->group[q];
            open[k].dtype = p->dtype[q];
            open[k].bucket = num_buckets;
            zx_bucket_info *bi = &plan->buckets[num_buckets++];
            bi->group = p->group[q];
            bi->dtype = p->dtype[q];
            bi->unit = unit;
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

    /* Pass 2: prefix sums for bucket_params, padding, slices, shard offsets. */
    plan->shard_offsets = malloc((size_t)num_buckets * sizeof *plan->shard_offsets);
    if (!plan->shard_offsets) { free(bucket_of); zx_plan_free(plan); return ZX_ERR_OUT_OF_MEMORY; }
    const int64_t quantum = (int64_t)p->world_size * p->align;
    int64_t first = 0, shard = 0;
    for (int64_t b = 0; b < num_buckets; b++) {
        zx_bucket_info *bi = &plan->buckets[b];
        bi->first_param = first;
        first += bi->num_params;
        bi->num_params = 0;                                  /* refilled in pass 3 */
        if (bi->numel > INT64_MAX - quantum) { free(bucket_of); zx_plan_free(plan); return ZX_ERR_OVERFLOW; }
        bi->padded_numel = (bi->numel + quantum - 1) / quantum * quantum;
        bi->slice_numel = bi->padded_numel / p->world_size;
        plan->shard_offsets[b] = shard;
        if (zx_add_overflows(shard, bi->slice_numel)) { free(bucket_of); zx_plan_free(plan); return ZX_ERR_OVERFLOW; }
        shard += bi->slice_numel;
    }
    plan->shard_numel = shard;

    /* Pass 3: lay parameters out inside their buckets, in `order`. */
    int64_t *fill = calloc((size_t)num_buckets, sizeof *fill);  /* elements placed so far */
    if (!fill) { free(bucket_of); zx_plan_free(plan); return ZX_ERR_OUT_OF_MEMORY; }
    for (int64_t i = 0; i < n; i++) {
        const int64_t q = p->order[i], b = bucket_of[q];
        zx_bucket_info *bi = &plan->buckets[b];
        plan->bucket_params[bi->first_param + bi->num_params++] = q;
        plan->locs[q].bucket = b;
        plan->locs[q].offset = fill[b];
        plan->locs[q].numel = p->numel[q];
        fill[b] += p->numel[q];
    }
    free(fill);
    free(bucket_of);
    *out = plan;
    return ZX_OK;
}

void zx_plan_free(zx_plan *plan) {
    if (!plan) return;
    free(plan->buckets);
    free(plan->bucket_params);
    free(plan->locs);
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
