/* zx_core.h — the C11 core of zero_ext: partition planner and CPU kernels.
 *
 * Knows nothing of torch. Every function returns a zx_status (never exits or
 * aborts); the C++ binding turns non-OK codes into Python exceptions.
 * Build standalone for the sanitizer tests: `make core-test`.
 *
 * Contents (one file per concern):
 *   zx_status.c   status names, dtype sizes
 *   zx_plan.c     partition planner                     defines: zx_plan_*
 *   zx_cpu.c      run-time ISA detection                  defines: zx_cpu_*
 *   zx_kernels*.c optimizer / norm / reduce / cast kernels defines: zx_adam_step, ...
 *   zx_scaler.c   dynamic loss-scaling state machine      defines: zx_scaler_*
 *   zx_quant*.c   blockwise int8/int4 quantization         defines: zx_quantize, ...
 */
#ifndef ZX_CORE_H
#define ZX_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status */
typedef enum zx_status {
    ZX_OK = 0,
    ZX_ERR_INVALID_ARG = 1,    /* a NULL pointer, a zero size, an out-of-range value */
    ZX_ERR_OUT_OF_MEMORY = 2,  /* malloc failed */
    ZX_ERR_UNSUPPORTED = 3,    /* an ISA or dtype this build/CPU cannot run */
    ZX_ERR_OVERFLOW = 4,       /* a size computation would overflow */
    ZX_ERR_BUFFER_TOO_SMALL = 5 /* the caller's output buffer is too small */
} zx_status;

/* A short, static, human-readable name for a status code ("invalid argument"). */
const char *zx_status_string(zx_status s);

/* ------------------------------------------------------------------ dtypes */
typedef enum zx_dtype { ZX_F32 = 0, ZX_BF16 = 1, ZX_F16 = 2 } zx_dtype;

/* Bytes per element (4, 2, 2); 0 for an unknown dtype. */
size_t zx_dtype_size(zx_dtype d);

/* ------------------------------------------------------------------ ISA */
/* Which instruction set a kernel call uses. Chosen at run time, kept by the
 * caller (per handle), never in a global. */
typedef enum zx_isa { ZX_ISA_SCALAR = 0, ZX_ISA_AVX2 = 1, ZX_ISA_AVX512 = 2 } zx_isa;

/* Non-zero when this CPU (and this build) can run `isa`. SCALAR is always 1.
 * AVX2 needs avx2+fma+f16c; AVX512 needs avx512f+avx512bw+avx512vl. The
 * environment variable ZX_ISA (scalar, avx2, avx512) caps the answer, as
 * ATEN_CPU_CAPABILITY does for torch (Note [ISA cap] in zx_cpu.c). */
int zx_cpu_supports(zx_isa isa);
/* The widest ISA zx_cpu_supports() accepts. */
zx_isa zx_cpu_best_isa(void);
/* "scalar", "avx2", "avx512" (static string). */
const char *zx_isa_name(zx_isa isa);
/* Non-zero when AVX-512 BF16 (vcvtneps2bf16) is available to the AVX512 path. */
int zx_cpu_has_avx512_bf16(void);

/* ------------------------------------------------------------------ planner
 * Trainable parameters are laid out in `order` (indices into
 * the parameter arrays; stage 1/2: reverse registration order; stage 3: unit
 * order). Parameters with equal (group, dtype) key share buckets; a bucket is
 * closed when adding the next parameter would exceed its byte cap (the first
 * bucket of the whole plan uses first_bucket_bytes, later ones bucket_bytes),
 * or when the caller forces a split (`unit` changes, stage 3). A parameter
 * larger than the cap gets a bucket of its own; parameters never split across
 * buckets. Inside a bucket parameters follow each other element-granular, each
 * starting at the next aligned element (Note [Aligned pieces]). Each bucket is
 * padded to a multiple of world_size*align elements and split into world_size
 * equal contiguous slices; rank r owns slice r of every bucket.
 * Buckets are numbered by the position in `order` of their first parameter.
 */
typedef struct zx_plan_params {
    size_t num_params;
    const int64_t *numel;        /* (num_params,) elements of each parameter, > 0 */
    const int32_t *dtype;        /* (num_params,) zx_dtype of each parameter */
    const int32_t *group;        /* (num_params,) param-group index, >= 0 */
    const int32_t *unit;         /* (num_params,) or NULL: a change of unit between two
                                    consecutive parameters in `order` closes every
                                    open bucket (stage 3: one bucket per unit) */
    const int64_t *order;        /* (num_params,) a permutation of 0..num_params-1 */
    int32_t world_size;          /* N >= 1 */
    int64_t bucket_bytes;        /* cap per bucket, > 0 */
    int64_t first_bucket_bytes;  /* cap of the first bucket, > 0 */
    int64_t align;               /* slice alignment in elements, >= 1 */
    const double *cost;          /* (num_params,) or NULL: > 0 marks a tensor-atomic
                                    parameter whose optimizer needs the whole tensor,
                                    with that update cost (zx_update_cost); 0 an
                                    element-granular one (Note [Tensor-atomic buckets]) */
    const double *state;         /* (num_params,) or NULL: optimizer state bytes per element
                                    of each parameter (0: no state). With cost, element-
                                    granular parameters fill the atomic buckets' padding so
                                    that state bytes balance (Note [Filling atomic buckets]) */
    int64_t param_align_bytes;   /* every piece starts at a multiple of this many bytes inside
                                    its bucket (Note [Aligned pieces]); a power of two up to
                                    ZX_MAX_PARAM_ALIGN_BYTES, or 0: packed tight */
} zx_plan_params;

/* Note [Aligned pieces]
 * A parameter packed right after the previous one starts wherever that one ended:
 * a bf16 [768] norm weight leaves the next matrix 2-byte aligned, and cuBLAS and
 * vectorized kernels then take other code paths (other rounding) than for the
 * same matrix alone. So every piece starts at a multiple of param_align_bytes:
 * pa = param_align_bytes / element size elements (zx_plan_piece_align; 1 when the
 * element is as large), and every slice is a multiple of lcm(align, pa of a 2-byte
 * element) (zx_plan_slice_align), so slice starts, shard offsets and every
 * fragment's start are aligned too, in each dtype a shard is kept in (fp32 master
 * and states, bf16 or fp32 gradients). Buffers are allocated one per bucket, so a
 * parameter view's address is aligned when its offset is. The elements skipped
 * before a piece are padding like the tail (zero, never read by an optimizer):
 * zx_bucket_info.gap_numel counts them. Tensor-atomic bins count each tensor at
 * its size rounded up to pa. 16 bytes costs under pa elements per parameter. */
#define ZX_MAX_PARAM_ALIGN_BYTES 4096
/* Elements a piece of `dtype` starts at a multiple of (Note [Aligned pieces]); 0 when
 * param_align_bytes or dtype is invalid. */
int64_t zx_plan_piece_align(int64_t param_align_bytes, zx_dtype dtype);
/* lcm(align, zx_plan_piece_align of a 2-byte element): what every slice is a multiple
 * of; 0 when an argument is invalid. */
int64_t zx_plan_slice_align(int64_t align, int64_t param_align_bytes);

/* Note [Tensor-atomic buckets]
 * Tensor-atomic parameters (cost[p] > 0): parameters with an atomic key fill a bucket
 * until it is past its cap *and* holds at least 2*world_size tensors (so each rank
 * can get whole tensors and the padding stays small). Inside the bucket, tensors
 * go to world_size bins, largest first to the bin with the fewest elements; the
 * bins then go to ranks, costliest bin to the rank with the least update cost so
 * far (over every atomic bucket planned before), so that update cost is balanced
 * across the whole model while each bucket keeps equal slices. The slice is the
 * largest bin rounded up to the slice alignment (Note [Aligned pieces]); rank r's
 * tensors sit whole at the start of slice r, each at an aligned element, the rest
 * of the slice is padding (zero, never read by an optimizer). */

/* Note [Filling atomic buckets]
 * Whole tensors alone cannot balance when ranks are
 * about as many as matrices, but the usual recipe has an elementwise optimizer
 * (AdamW) over the rest (embeddings, norms, biases), whose tensors can be cut
 * anywhere. With `state` given, after every atomic bucket is binned, rank r's
 * whole-tensor state W_r = sum of numel*state over its tensors, and the level
 * L = max_r W_r. Each rank's padding ("gap": slice minus its bin) is then filled
 * with pieces of element-granular parameters (state > 0, same dtype as the bucket
 * and, when `unit` is given, the same unit) until its state reaches L or its gaps
 * are full; whatever is left of those parameters stays in its element-granular
 * bucket, which every rank shares equally. L >= max W_r minimizes the largest
 * rank's state: raising L by d raises the maximum by d and lowers the equal share
 * by d*k/N (k = ranks still taking filler), so L rises past max W_r only while
 * every rank can still take filler (one dtype, no units: up to the lowest W_r plus
 * its gaps, and no further than the fillers reach), which fills more padding. Atomic
 * buckets are filled last-to-first from parameters last-to-first in `order`, so
 * the parameters whose gradients arrive last in backward fill the buckets reduced
 * last. A filled bucket is still one reduce-scatter + one all-gather of equal
 * slices; its pieces of a filler are element-granular (each lies in one slice).
 * A parameter cut this way has several pieces (zx_param_loc.pieces > 1, read
 * with zx_plan_param_pieces); an element-granular bucket left without pieces is
 * dropped. With state NULL, no atomic parameter or world_size 1 nothing moves. */

/* What an optimizer's update of one tensor costs, for balancing tensor-atomic
 * parameters: 0 for an elementwise optimizer, rows*cols for a factored one
 * (Adafactor), rows*cols*min(rows, cols) for an orthogonalized one (Muon's
 * Newton-Schulz iterations). rows = the first dimension, cols = numel / rows. */
typedef enum zx_update_kind {
    ZX_UPDATE_ELEMENTWISE = 0,
    ZX_UPDATE_FACTORED = 1,
    ZX_UPDATE_ORTHOGONALIZED = 2
} zx_update_kind;
double zx_update_cost(zx_update_kind kind, int64_t rows, int64_t cols);

typedef struct zx_bucket_info {
    int32_t group;               /* param group of every parameter inside (of every whole
                                    tensor in a filled atomic bucket; its fillers keep theirs) */
    int32_t dtype;               /* zx_dtype of every parameter inside */
    int32_t unit;                /* unit of its parameters (0 when params->unit is NULL) */
    int64_t first_param;         /* index into the bucket's piece list (see below) */
    int64_t num_params;          /* pieces in this bucket: one per parameter, except that a
                                    filled atomic bucket also holds pieces of element-granular
                                    parameters (Note [Filling atomic buckets]) */
    int64_t numel;               /* sum of piece numels (unpadded) */
    int64_t padded_numel;        /* world_size * slice_numel: element-granular, numel + gap_numel
                                    rounded up to world_size * zx_plan_slice_align */
    int64_t slice_numel;         /* padded_numel / world_size */
    int32_t atomic;              /* 1: tensor-atomic, rank r's slice holds whole tensors */
    int64_t gap_numel;           /* padding between pieces of one slice, left so that each
                                    piece starts aligned (Note [Aligned pieces]) */
} zx_bucket_info;

typedef struct zx_param_loc {
    int64_t bucket;              /* bucket index */
    int64_t offset;              /* element offset inside the bucket */
    int64_t numel;               /* elements (of the first piece when pieces > 1) */
    int64_t pieces;              /* 1: the whole parameter lies at (bucket, offset); > 1: it
                                    was cut to fill atomic buckets and this is its first piece
                                    (zx_plan_param_pieces lists them all) */
} zx_param_loc;

/* One contiguous piece of a parameter inside one bucket. */
typedef struct zx_piece {
    int64_t param;               /* parameter index */
    int64_t bucket;              /* bucket index */
    int64_t offset;              /* first element of the piece inside the bucket */
    int64_t param_offset;        /* first element of the piece inside the parameter */
    int64_t numel;               /* elements in the piece */
} zx_piece;

/* One piece of a parameter inside one rank's slice. */
typedef struct zx_fragment {
    int64_t param;               /* parameter index */
    int64_t bucket;              /* bucket index */
    int64_t param_offset;        /* first element of the piece inside the parameter */
    int64_t slice_offset;        /* first element of the piece inside the rank's slice */
    int64_t numel;               /* elements in the piece */
} zx_fragment;

typedef struct zx_plan zx_plan;  /* opaque */

/* Plan a layout. On success *out owns a plan to be released with zx_plan_free. */
zx_status zx_plan_create(const zx_plan_params *params, zx_plan **out);
/* Release a plan; NULL is a no-op. */
void zx_plan_free(zx_plan *plan);

int64_t zx_plan_num_buckets(const zx_plan *plan);
int32_t zx_plan_world_size(const zx_plan *plan);
/* Copies bucket b's description into *out. */
zx_status zx_plan_bucket(const zx_plan *plan, int64_t b, zx_bucket_info *out);
/* The parameter of the k-th piece (0 <= k < info.num_params) of bucket b, in layout order. */
zx_status zx_plan_bucket_param(const zx_plan *plan, int64_t b, int64_t k, int64_t *param);
/* The k-th piece of bucket b, in layout (offset) order. */
zx_status zx_plan_bucket_piece(const zx_plan *plan, int64_t b, int64_t k, zx_piece *out);
/* Where parameter p lives (its first piece when it was cut). */
zx_status zx_plan_param(const zx_plan *plan, int64_t p, zx_param_loc *out);
/* Every piece of parameter p, in bucket order; same cap/count contract as
 * zx_plan_fragments. Together they cover [0, numel) exactly once. */
zx_status zx_plan_param_pieces(const zx_plan *plan, int64_t p, zx_piece *out, int64_t cap, int64_t *count);
/* Sum over buckets of slice_numel: the length of one rank's flat shard. */
int64_t zx_plan_shard_numel(const zx_plan *plan);
/* Element offset of bucket b's slice inside a rank's flat shard. */
int64_t zx_plan_shard_offset(const zx_plan *plan, int64_t b);
/* The pieces of parameters that lie in rank r's slice of bucket b, in order.
 * Writes at most `cap` fragments to out (out may be NULL when cap is 0) and the
 * total count to *count; returns ZX_ERR_BUFFER_TOO_SMALL when cap < *count. */
zx_status zx_plan_fragments(const zx_plan *plan, int64_t b, int32_t rank,
                            zx_fragment *out, int64_t cap, int64_t *count);
/* The rank owning tensor-atomic parameter p whole, or -1 when p is element-granular
 * (or p is out of range). */
int32_t zx_plan_owner(const zx_plan *plan, int64_t p);
/* Rank r's share of the tensor-atomic parameters: their update cost and elements. */
zx_status zx_plan_rank_load(const zx_plan *plan, int32_t rank, double *cost, int64_t *numel);
/* Rank r's optimizer state bytes (zx_plan_params.state over every element in its
 * slices, padding excluded; 0 when state was NULL) and the part of it that is
 * whole tensors' state. */
zx_status zx_plan_rank_state(const zx_plan *plan, int32_t rank, double *bytes, double *whole_bytes);
/* The state level the fillers aimed at (Note [Filling atomic buckets]); 0 when
 * nothing was filled. */
double zx_plan_fill_level(const zx_plan *plan);
/* Writes a human-readable table of the plan (NUL-terminated, truncated to
 * `cap` bytes) and the length it needed (excluding NUL) to *needed. */
zx_status zx_plan_describe(const zx_plan *plan, char *buf, size_t cap, size_t *needed);

/* ------------------------------------------------------------------ kernels
 * All kernels work on flat fp32 arrays of n elements (any n >= 0, any
 * alignment) and follow torch.optim's single-tensor arithmetic. Threads come
 * from the caller: split [0, n) into ranges and call a kernel per range.
 *
 * grad_scale: every gradient element is multiplied by it when loaded (the
 *   1/world_size average, a loss-scale unscale and a clipping coefficient
 *   folded into one factor); 1.0f leaves gradients as they are.
 * param_lp / lp_dtype: when param_lp is not NULL, the updated parameter is
 *   also written to param_lp[i] as lp_dtype (ZX_BF16/ZX_F16, round to nearest
 *   even) in the same pass; lp_dtype must not be ZX_F32 then.
 */
typedef struct zx_adam_hparams {
    double lr;
    double beta1, beta2;
    double eps;
    double weight_decay;
    int64_t step;                /* step count after this step's increment (>= 1) */
    int32_t decoupled;           /* 1: AdamW (param *= 1 - lr*wd); 0: Adam (grad += wd*param) */
    int32_t amsgrad;             /* 1: keep max_exp_avg_sq and normalize by it */
    int32_t maximize;            /* 1: ascend (grad = -grad) */
    float grad_scale;
} zx_adam_hparams;

/* One Adam/AdamW step over n elements. max_exp_avg_sq is required iff amsgrad. */
zx_status zx_adam_step(zx_isa isa, size_t n, float *param, const float *grad,
                       float *exp_avg, float *exp_avg_sq, float *max_exp_avg_sq,
                       void *param_lp, zx_dtype lp_dtype,
                       const zx_adam_hparams *hp);

/* Note [Fused split-master step]: one Adam/AdamW step (zx_adam_step's maths) of masters
 * kept as bf16 top halves hi, 16-bit remainders rem and tie bits ties (Note [Split
 * master], zx_master_split.c), in one pass with no fp32 master in memory. The call
 * covers `total` elements of hi/rem (bit 0 of ties[0] is element 0); elements
 * [lead, lead + n) step, with grad, exp_avg, exp_avg_sq and max_exp_avg_sq (required iff
 * amsgrad) indexed from the first of them; the others keep their bits; total must be
 * at most lead + n + 7 (the stepped run ends in the last tie byte). hi receives the
 * masters' bf16 rounding. Bit for bit zx_master_join, zx_adam_step with hi as the bf16
 * copy, zx_master_split. */
zx_status zx_adam_step_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                             uint8_t *ties, const float *grad, float *exp_avg, float *exp_avg_sq,
                             float *max_exp_avg_sq, const zx_adam_hparams *hp);

/* One Adam/AdamW step over n elements with both states kept in bfloat16 (2 bytes
 * each instead of 4): exp_avg[i] and exp_avg_sq[i] are bf16 bit patterns, widened
 * exactly to fp32 on load, updated with the fp32 maths of zx_adam_step, and stored
 * back with stochastic rounding; the parameter update uses the fp32 states of this
 * step (before they are rounded), so param and param_lp are exactly what
 * zx_adam_step gives from the same (widened) states.
 *
 * Rounding (Note [Counter-based stochastic rounding], zx_sr.h): the random bits of
 * element i are a hash of (seed, offset + i) alone. Pass offset = the global index
 * of this range's first element (and a seed that changes every step, e.g. mixed
 * from the step count): results are then the same whatever the isa, the threads
 * or the split of [0, n) into calls; zx_cuda_adam_step_bf16_states runs the same operations
 * and hash (tests/test_cuda_bf16_states.py checks the two bit for bit on a GPU).
 * Counters wrap modulo 2^64. NaN stays NaN, +-Inf stays +-Inf, a finite value
 * never rounds to Inf (above the largest finite bf16 it saturates to it).
 *
 * Returns ZX_ERR_UNSUPPORTED when hp->amsgrad (no bf16 max state: use zx_adam_step),
 * ZX_ERR_INVALID_ARG for the checks of zx_adam_step (NULL arrays when n > 0, bad
 * hyperparameters, an lp_dtype other than ZX_BF16/ZX_F16 with param_lp). */
zx_status zx_adam_step_bf16_states(zx_isa isa, size_t n, float *param, const float *grad,
                                   uint16_t *exp_avg, uint16_t *exp_avg_sq,
                                   void *param_lp, zx_dtype lp_dtype,
                                   const zx_adam_hparams *hp, uint64_t seed, uint64_t offset);

typedef struct zx_sgd_hparams {
    double lr;
    double momentum;             /* 0 disables the momentum buffer */
    double dampening;
    double weight_decay;
    int32_t nesterov;
    int32_t maximize;
    int32_t first_step;          /* 1: the momentum buffer is initialized to d_p (torch's clone) */
    float grad_scale;
} zx_sgd_hparams;

/* One SGD step over n elements. momentum_buf is required iff momentum != 0. */
zx_status zx_sgd_step(zx_isa isa, size_t n, float *param, const float *grad,
                      float *momentum_buf, void *param_lp, zx_dtype lp_dtype,
                      const zx_sgd_hparams *hp);

/* zx_adam_step_split's call shape (Note [Fused split-master step]) for SGD (zx_sgd_step's maths; momentum_buf indexed like grad) and
 * for Adam with bf16 states (zx_adam_step_bf16_states': element lead + j of the call draws
 * its random bits from counter offset + j). These go block by block through an L1 buffer
 * (join, the kernel, round into hi, split) in one call. Bit for bit zx_master_join, the
 * kernel with hi as the bf16 copy, zx_master_split. */
zx_status zx_sgd_step_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                            uint8_t *ties, const float *grad, float *momentum_buf, const zx_sgd_hparams *hp);
zx_status zx_adam_step_bf16_states_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi,
                                         int16_t *rem, uint8_t *ties, const float *grad, uint16_t *exp_avg,
                                         uint16_t *exp_avg_sq, const zx_adam_hparams *hp, uint64_t seed,
                                         uint64_t offset);

/* Fused gradient scan: *sumsq += sum((grad[i]*scale)^2) accumulated in double
 * over the finite elements, *nonfinite += count of inf/nan elements. */
zx_status zx_grad_sumsq(zx_isa isa, size_t n, const float *grad, float scale,
                        double *sumsq, int64_t *nonfinite);

/* Reduce `nslices` consecutive slices of slice_n elements each (src is
 * nslices*slice_n long, slice j at src + j*slice_n) into dst:
 *   dst[i] = (accumulate ? dst[i] : 0) + scale * sum_j src[j*slice_n + i]
 * summing j in increasing order. dst may alias src's slice 0 only when
 * accumulate is 0. (The local half of a reduce-scatter built from all-to-all.) */
zx_status zx_sum_slices(zx_isa isa, size_t slice_n, int32_t nslices, const float *src,
                        float *dst, int32_t accumulate, float scale);

/* zx_sum_slices of 16-bit slices (src_dtype ZX_BF16 or ZX_F16), each element widened
 * exactly to fp32 first: bit for bit zx_sum_slices of the widened src. dst (fp32) may
 * not overlap src. (A 16-bit gradient's all-to-all summed in fp32.) */
zx_status zx_sum_slices16(zx_isa isa, size_t slice_n, int32_t nslices, const uint16_t *src,
                          zx_dtype src_dtype, float *dst, int32_t accumulate, float scale);

/* x[i] *= s */
zx_status zx_scale(zx_isa isa, size_t n, float *x, float s);

/* dst[i] = (dst_dtype) src[i], round to nearest even; dst_dtype BF16 or F16
 * (F32 is a plain copy). */
zx_status zx_cast_from_f32(zx_isa isa, size_t n, const float *src, void *dst, zx_dtype dst_dtype);

/* dst[i] = (float) src[i] for a BF16/F16/F32 source. */
zx_status zx_cast_to_f32(zx_isa isa, size_t n, const void *src, zx_dtype src_dtype, float *dst);

/* Split master (Note [Split master], zx_master_split.c): an fp32 master m kept as
 * hi = its bf16 rounding to nearest even (the parameter itself), rem = the low
 * 16 bits of bits(m) - (hi << 16), and one tie bit per element (bit i & 7 of
 * ties[i >> 3]; a partial last byte's other bits are written 0).
 * join:  out[i] = the master, bit for bit.
 * split: rem and ties from m and the hi that rounding m gave (read, not written).
 * isa: ZX_ISA_SCALAR, AVX2 (a tie byte is 8 lanes) or AVX-512 (two tie bytes are one
 * 16-lane mask); ZX_ERR_UNSUPPORTED where the CPU lacks it. */
zx_status zx_master_join(zx_isa isa, size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                         float *out);
zx_status zx_master_split(zx_isa isa, size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties);

/* ------------------------------------------------------------------ blockwise quantization
 * (zx_quant.c; Note [Blockwise quantization] there.) Symmetric integer codes with
 * one fp32 scale per block of `block_numel` consecutive elements, for the
 * communication-reducing modes (quantized gathers and gradient reduction).
 *
 *   bits         8 (int8 codes in [-127, 127], one byte each) or 4 (int4 codes in
 *                [-7, 7], two per byte: element 2k in the low nibble, 2k+1 in the
 *                high nibble); block_numel >= 1, and even when bits == 4
 *   n            elements (any n >= 0); the last block may be partial: its codes
 *                are padded with zeros up to the whole block, so a payload is
 *                always zx_quant_blocks(n) whole blocks
 *   scales       one fp32 per block: amax / qmax (qmax = 127 or 7), where amax is the
 *                block's largest |x|, raised by one ulp when scale * qmax < amax
 *                (so no code is ever clamped, subnormal blocks included); 0 for an
 *                all-zero block; NaN for a block with
 *                an inf or NaN, whose codes are then all 0, so that every dequantized
 *                element of it is NaN (an overflowing gradient stays visible to
 *                the fp16 inf/nan scan)
 *   dequantized  (float) code * scale, one rounding; |x - dequantized| is at most
 *                half a step (scale / 2) up to the fp32 rounding of x / scale
 *
 * Every ISA gives bit-identical codes, scales and outputs (only correctly rounded
 * IEEE operations, no fused multiply-add); so does csrc/cuda/zx_cuda_quant.cu.
 */

/* Blocks of a payload of n elements: ceil(n / block_numel) (0 when block_numel is 0). */
size_t zx_quant_blocks(size_t n, size_t block_numel);

/* Bytes of codes of a payload of n elements: zx_quant_blocks(n) * block_numel * bits / 8.
 * ZX_ERR_INVALID_ARG for a bad bits/block_numel pair, ZX_ERR_OVERFLOW if it overflows. */
zx_status zx_quant_bytes(int32_t bits, size_t block_numel, size_t n, size_t *bytes);

/* Quantize n elements of src (src_dtype F32, BF16 or F16) into codes q
 * (zx_quant_bytes bytes) and scales (zx_quant_blocks floats).
 * residual: NULL, or n fp32 values of error feedback: the block quantizes
 * x = src[i] + residual[i] (fp32 add) and then stores residual[i] = x - dequantized;
 * a block with an inf/NaN leaves its residual unchanged. */
zx_status zx_quantize(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                      const void *src, zx_dtype src_dtype, float *residual,
                      void *q, float *scales);

/* dst[i] = (dst_dtype) ((float) code_i * scale_of_its_block), i < n; dst_dtype F32,
 * BF16 or F16 (round to nearest even). */
zx_status zx_dequantize(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                        const void *q, const float *scales, void *dst, zx_dtype dst_dtype);

/* The receiving side of a quantized reduce-scatter by all-to-all: nslices payloads
 * of n elements each, slice j's codes at q + j * slice_blocks * block_bytes and its
 * scales at scales + j * slice_blocks (slice_blocks >= zx_quant_blocks(n); a caller
 * splitting the work hands a range of whole blocks and keeps slice_blocks):
 *   dst[i] = (accumulate ? dst[i] : 0) + scale * sum_j dequantized_j[i]
 * summed in fp32 with j in increasing order (exactly zx_sum_slices of the
 * dequantized slices). */
zx_status zx_dequantize_sum(zx_isa isa, int32_t bits, size_t block_numel, size_t n,
                            int32_t nslices, size_t slice_blocks, const void *q,
                            const float *scales, float *dst, int32_t accumulate, float scale);

/* ------------------------------------------------------------------ loss scaler
 * Dynamic loss scaling for fp16. After every backward the caller
 * reports whether any gradient element on any rank was inf/nan (one all-reduce
 * it already does for the norm); the machine says whether to skip the step and
 * moves the scale:
 *   overflow:    the step is skipped. If `hysteresis_left` > 1 it is decremented
 *                and the scale kept (a lone spike does not halve the scale);
 *                otherwise scale = max(scale * backoff_factor, min_scale) and
 *                hysteresis_left is refilled. good_steps restarts at 0.
 *   no overflow: good_steps += 1 and hysteresis_left is refilled; once good_steps
 *                reaches growth_interval, scale = min(scale * growth_factor,
 *                max_scale) and good_steps restarts at 0.
 * A static scaler (dynamic = 0) never changes its scale but still skips
 * overflowing steps (an inf would otherwise poison the fp32 master weights).
 */
typedef struct zx_loss_scaler {
    double scale;                /* the current loss scale, > 0 */
    double growth_factor;        /* > 1 */
    double backoff_factor;       /* in (0, 1) */
    double min_scale;            /* > 0: the scale never drops below it */
    double max_scale;            /* >= scale: the scale never grows past it */
    int64_t growth_interval;     /* >= 1 overflow-free steps before growing */
    int64_t hysteresis;          /* >= 1 consecutive overflows before backing off */
    int32_t dynamic;             /* 0: static scale */
    /* state */
    int64_t good_steps;          /* overflow-free steps since the last change */
    int64_t hysteresis_left;     /* overflows still tolerated before a backoff */
    int64_t skipped;             /* steps skipped so far */
} zx_loss_scaler;

/* Checks the configuration fields and resets the state. */
zx_status zx_scaler_init(zx_loss_scaler *s);
/* One step's verdict: *skip = 1 when the step must be skipped. */
zx_status zx_scaler_update(zx_loss_scaler *s, int32_t found_nonfinite, int32_t *skip);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CORE_H */
