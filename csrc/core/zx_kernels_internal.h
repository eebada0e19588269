/* zx_kernels_internal.h — what the kernel files of the core share, not part of the API.
 *
 *   zx_kernels.c         public zx_* entry points: validate, hoist scalars, dispatch on isa
 *   zx_kernels_ref.c     scalar reference kernels (the oracle)          defines: zx_*_ref
 *   zx_kernels_avx2.c    AVX2+FMA+F16C kernels                          defines: zx_*_avx2
 *   zx_kernels_avx512.c  AVX-512 (F/BW/VL, optional BF16) kernels       defines: zx_*_avx512
 *   zx_kernels_simd.inc  the one algorithm body both SIMD files instantiate
 *   zx_kernels_sr_simd.inc  the same for Adam with bf16 states (stochastic rounding)
 *   zx_sr.h              the counter-based hash and bf16 stochastic rounding of one
 *                        value, shared with the CUDA kernel
 *   zx_simd_avx2.h, zx_simd_avx512.h   each ISA's vector vocabulary, shared with the
 *                        quantization kernels (contract: zx_simd.h)
 *
 * Note [Bit-exact SIMD]
 * ~~~~~~~~~~~~~~~~~~~~~
 * Every per-element formula is written as the same sequence of correctly rounded
 * IEEE operations (add, sub, mul, div, sqrt, fma) in the reference and in the SIMD
 * bodies, so a SIMD kernel's fp32 output is bit-identical to the reference on the
 * same input. Where torch.optim's CPU kernels fuse a multiply-add (lerp, add with
 * alpha, addcmul) the reference calls fmaf() and SIMD uses a vector FMA; where torch
 * does not fuse, neither do we. This needs the compiler not to contract a*b+c on its
 * own: GCC does so in its GNU modes (-ffp-contract=fast), so the core is compiled
 * with -std=c11 (ISO mode, contraction off); the kernel files refuse GNU mode.
 * Only grad_sumsq differs between ISAs (its double sum is taken in another order).
 *
 * Note [Low-precision copy-out in blocks]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * The optimizer bodies only do fp32 maths. When a bf16/fp16 copy is requested, the
 * entry point walks the range in blocks of ZX_LP_BLOCK_NUMEL elements: step one
 * block, then convert that block's fresh parameters (still in L1/L2) to the low
 * precision. Memory sees one pass; the conversion (which on AVX-512 needs a
 * different target for vcvtneps2bf16) stays out of the optimizer maths.
 */
#ifndef ZX_KERNELS_INTERNAL_H
#define ZX_KERNELS_INTERNAL_H

#include "zx_core.h"
#include "zx_sr.h"     /* defines: zx_sr_key, zx_sr_*, zx_bf16_sr */

/* 1 when this compiler can build the x86 SIMD files (function target attributes). */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ZX_HAVE_X86_SIMD 1
#else
#define ZX_HAVE_X86_SIMD 0
#endif

/* See Note [Bit-exact SIMD]. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__STRICT_ANSI__)
#error "compile the zero_ext core with -std=c11: GCC's GNU modes fuse a*b+c into FMA (see Note [Bit-exact SIMD])"
#endif

/* Elements per block of the optimizer + low-precision copy-out walk: 8 KiB of fp32
 * parameters, small enough to still be in cache when they are converted. */
#define ZX_LP_BLOCK_NUMEL 2048

/* Scalars of one Adam/AdamW step, computed once per call (zx_kernels.c) and rounded
 * to fp32 exactly where torch.optim rounds its Python-double scalars. */
typedef struct zx_adam_consts {
    float grad_scale;       /* multiplies grad on load; negated when maximize */
    int32_t l2;             /* 1: grad = fma(weight_decay, param, grad) (Adam, wd != 0) */
    float weight_decay;     /* (float) weight_decay */
    int32_t decoupled;      /* 1: param *= decay_factor (AdamW, wd != 0) */
    float decay_factor;     /* (float) (1 - lr * weight_decay) */
    int32_t lerp_from_grad; /* torch lerp(m, g, w): 0 when w < 0.5 (base m), 1 otherwise (base g) */
    float lerp_coeff;       /* w when w < 0.5, else w - 1; w = (float) (1 - beta1) */
    float beta2;            /* (float) beta2 */
    float one_minus_beta2;  /* (float) (1 - beta2) */
    float bc2_sqrt;         /* (float) (1 - beta2^step)^0.5, bias correction in double */
    float eps;              /* (float) eps */
    float neg_step_size;    /* (float) -(lr / (1 - beta1^step)) */
    int32_t amsgrad;        /* 1: normalize by max_exp_avg_sq = max(max_exp_avg_sq, v) */
} zx_adam_consts;

/* Scalars of one SGD step, computed once per call. */
typedef struct zx_sgd_consts {
    float grad_scale;           /* multiplies grad on load; negated when maximize */
    int32_t l2;                 /* 1: d_p = fma(weight_decay, param, d_p) (wd != 0) */
    float weight_decay;         /* (float) weight_decay */
    int32_t use_momentum;       /* 1: momentum != 0, momentum_buf is used */
    int32_t first_step;         /* 1: buf = d_p (torch's clone on the first step) */
    float momentum;             /* (float) momentum */
    float one_minus_dampening;  /* (float) (1 - dampening) */
    int32_t nesterov;           /* 1: d_p = fma(momentum, buf, d_p); 0: d_p = buf */
    float neg_lr;               /* (float) -lr */
} zx_sgd_consts;

/* ---- scalar reference (zx_kernels_ref.c) ---- */
void zx_adam_ref(size_t n, float *param, const float *grad, float *exp_avg,
                 float *exp_avg_sq, float *max_exp_avg_sq, const zx_adam_consts *c);
/* Adam with bf16 states (c->amsgrad is 0): element i draws its random bits from
 * counter offset + i; lp: NULL or the copy-out (lp_dtype ZX_BF16/ZX_F16). */
void zx_adam_bf16s_ref(size_t n, float *param, const float *grad, uint16_t *exp_avg,
                       uint16_t *exp_avg_sq, const zx_adam_consts *c, zx_sr_key key,
                       uint64_t offset, uint16_t *lp, zx_dtype lp_dtype);
void zx_sgd_ref(size_t n, float *param, const float *grad, float *momentum_buf,
                const zx_sgd_consts *c);
void zx_grad_sumsq_ref(size_t n, const float *grad, float scale, double *sumsq,
                       int64_t *nonfinite);
/* dst[i] = (accumulate ? dst[i] : 0) + scale * sum_j src[j*stride + i], i < n */
void zx_sum_slices_ref(size_t n, size_t stride, int32_t nslices, const float *src,
                       float *dst, int32_t accumulate, float scale);
/* the same of 16-bit src (dtype ZX_BF16 or ZX_F16), widened exactly */
void zx_sum_slices16_ref(size_t n, size_t stride, int32_t nslices, const uint16_t *src,
                         zx_dtype dtype, float *dst, int32_t accumulate, float scale);
void zx_scale_ref(size_t n, float *x, float s);
/* dtype is ZX_BF16 or ZX_F16 (the entry point handles ZX_F32). */
void zx_cast_from_f32_ref(size_t n, const float *src, void *dst, zx_dtype dtype);
void zx_cast_to_f32_ref(size_t n, const void *src, zx_dtype dtype, float *dst);
/* One-value conversions, the definition every SIMD conversion must reproduce. */
uint16_t zx_f32_to_bf16_ref(float x);
uint16_t zx_f32_to_f16_ref(float x);
float zx_bf16_to_f32_ref(uint16_t h);
float zx_f16_to_f32_ref(uint16_t h);

/* ---- SIMD kernels: same signatures, suffix _avx2 / _avx512 ---- */
#if ZX_HAVE_X86_SIMD
#define ZX_DECLARE_SIMD_KERNELS(sfx)                                                   \
    void zx_adam_##sfx(size_t n, float *param, const float *grad, float *exp_avg,      \
                       float *exp_avg_sq, float *max_exp_avg_sq,                       \
                       const zx_adam_consts *c);                                       \
    void zx_adam_lp_##sfx(size_t n, float *param, const float *grad, float *exp_avg,   \
                          float *exp_avg_sq, float *max_exp_avg_sq,                    \
                          const zx_adam_consts *c, uint16_t *lp, zx_dtype lp_dtype);   \
    size_t zx_master_join_##sfx(size_t n, const uint16_t *hi, const int16_t *rem,      \
                                const uint8_t *ties, float *out);                      \
    size_t zx_master_split_##sfx(size_t n, const float *m, const uint16_t *hi,         \
                                 int16_t *rem, uint8_t *ties);                         \
    size_t zx_adam_split_##sfx(size_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,   \
                               const float *grad, float *exp_avg, float *exp_avg_sq,   \
                               float *max_exp_avg_sq, const zx_adam_consts *c);        \
    void zx_adam_bf16s_##sfx(size_t n, float *param, const float *grad,                \
                             uint16_t *exp_avg, uint16_t *exp_avg_sq,                  \
                             const zx_adam_consts *c, zx_sr_key key, uint64_t offset,  \
                             uint16_t *lp, zx_dtype lp_dtype);                         \
    void zx_sgd_##sfx(size_t n, float *param, const float *grad, float *momentum_buf,  \
                      const zx_sgd_consts *c);                                         \
    void zx_grad_sumsq_##sfx(size_t n, const float *grad, float scale, double *sumsq,  \
                             int64_t *nonfinite);                                      \
    void zx_sum_slices_##sfx(size_t n, size_t stride, int32_t nslices,                 \
                             const float *src, float *dst, int32_t accumulate,         \
                             float scale);                                             \
    void zx_sum_slices16_##sfx(size_t n, size_t stride, int32_t nslices,               \
                               const uint16_t *src, zx_dtype dtype, float *dst,        \
                               int32_t accumulate, float scale);                       \
    void zx_scale_##sfx(size_t n, float *x, float s);                                  \
    void zx_cast_from_f32_##sfx(size_t n, const float *src, void *dst, zx_dtype dtype, int stream); \
    void zx_cast_to_f32_##sfx(size_t n, const void *src, zx_dtype dtype, float *dst);
ZX_DECLARE_SIMD_KERNELS(avx2)
ZX_DECLARE_SIMD_KERNELS(avx512)
#undef ZX_DECLARE_SIMD_KERNELS
#endif

#endif /* ZX_KERNELS_INTERNAL_H */
