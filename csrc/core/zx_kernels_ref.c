/* zx_kernels_ref.c — scalar reference kernels: the oracle.
 *
 * Plain C, one element at a time, commented line by line with the torch.optim
 * statement each line mirrors (torch/optim/adam.py _single_tensor_adam, the
 * non-capturable branch; torch/optim/sgd.py _single_tensor_sgd). The ISA SCALAR
 * runs these; the SIMD kernels call them for their tails and must reproduce them
 * bit for bit (Note [Bit-exact SIMD] in zx_kernels_internal.h).
 *
 * How torch's CPU ops round (checked against torch 2.x on AVX-512/AVX2 builds):
 *   t.mul_(s)                 t * (float)s
 *   t.lerp_(e, w)             w < 0.5 ? fma(w, e - t, t) : fma(w - 1, e - t, e)
 *   t.add(o, alpha=a)         fma((float)a, o, t)
 *   t.addcmul_(x, y, value=s) fma((float)s * x, y, t)
 *   t.addcdiv_(x, y, value=s) t + ((float)s * x) / y
 *   t / s                     t / (float)s
 * (torch's fp32 sqrt itself is not always correctly rounded: ±1 ulp; ours is.)
 *
 * Build/test: make -C csrc/core test
 */
#include <math.h>
#include <string.h>

#include "zx_kernels_internal.h"

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* torch.maximum: NaN in either input gives NaN; otherwise the larger value. */
static float max_nan(float a, float b) {
    if (isnan(a) || isnan(b)) return a + b;  /* a quiet NaN, as vector code produces */
    return a > b ? a : b;
}

void zx_adam_ref(size_t n, float *param, const float *grad, float *exp_avg,
                 float *exp_avg_sq, float *max_exp_avg_sq, const zx_adam_consts *c) {
    for (size_t i = 0; i < n; i++) {
        /* grad = grads[i] if not maximize else -grads[i]   (scale folded in, sign too) */
        float g = grad[i] * c->grad_scale;
        float p = param[i];
        if (c->decoupled) {
            /* param.mul_(1 - lr * weight_decay) */
            p = p * c->decay_factor;
        } else if (c->l2) {
            /* grad = grad.add(param, alpha=weight_decay) */
            g = fmaf(c->weight_decay, p, g);
        }
        /* exp_avg.lerp_(grad, 1 - beta1) */
        float m = exp_avg[i];
        m = fmaf(c->lerp_coeff, g - m, c->lerp_from_grad ? g : m);
        /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) */
        float v = exp_avg_sq[i] * c->beta2;
        v = fmaf(c->one_minus_beta2 * g, g, v);
        float v_hat = v;
        if (c->amsgrad) {
            /* torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i]) */
            v_hat = max_nan(max_exp_avg_sq[i], v);
            max_exp_avg_sq[i] = v_hat;
        }
        /* denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps) */
        float denom = sqrtf(v_hat) / c->bc2_sqrt + c->eps;
        /* param.addcdiv_(exp_avg, denom, value=-step_size) */
        p = p + (c->neg_step_size * m) / denom;
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

/* Adam with bf16 states (Note [Counter-based stochastic rounding] in zx_sr.h): the
 * maths of zx_adam_ref without amsgrad, on states widened from bf16; the parameter
 * is updated from the fp32 states, which are then stored with stochastic rounding. */
void zx_adam_bf16s_ref(size_t n, float *param, const float *grad, uint16_t *exp_avg,
                       uint16_t *exp_avg_sq, const zx_adam_consts *c, zx_sr_key key,
                       uint64_t offset, uint16_t *lp, zx_dtype lp_dtype) {
    uint32_t block_hi = (uint32_t)(offset >> 32);
    uint32_t block_key = zx_sr_block_key(key, block_hi);
    for (size_t i = 0; i < n; i++) {
        uint64_t counter = offset + i;              /* wraps modulo 2^64 */
        if ((uint32_t)(counter >> 32) != block_hi) {
            block_hi = (uint32_t)(counter >> 32);
            block_key = zx_sr_block_key(key, block_hi);
        }
        uint32_t bits = zx_sr_bits_in_block(key, block_key, (uint32_t)counter);
        /* grad = grads[i] if not maximize else -grads[i]   (scale folded in, sign too) */
        float g = grad[i] * c->grad_scale;
        float p = param[i];
        if (c->decoupled) {
            p = p * c->decay_factor;                /* param.mul_(1 - lr * weight_decay) */
        } else if (c->l2) {
            g = fmaf(c->weight_decay, p, g);        /* grad = grad.add(param, alpha=wd) */
        }
        /* exp_avg.lerp_(grad, 1 - beta1) */
        float m = zx_bf16_to_f32_ref(exp_avg[i]);
        m = fmaf(c->lerp_coeff, g - m, c->lerp_from_grad ? g : m);
        /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) */
        float v = zx_bf16_to_f32_ref(exp_avg_sq[i]) * c->beta2;
        v = fmaf(c->one_minus_beta2 * g, g, v);
        /* denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps) */
        float denom = sqrtf(v) / c->bc2_sqrt + c->eps;
        /* param.addcdiv_(exp_avg, denom, value=-step_size) */
        p = p + (c->neg_step_size * m) / denom;
        param[i] = p;
        exp_avg[i] = zx_bf16_sr(f32_bits(m), bits & 0xffffu);
        exp_avg_sq[i] = zx_bf16_sr(f32_bits(v), bits >> 16);
        if (lp) lp[i] = lp_dtype == ZX_BF16 ? zx_f32_to_bf16_ref(p) : zx_f32_to_f16_ref(p);
    }
}

void zx_sgd_ref(size_t n, float *param, const float *grad, float *momentum_buf,
                const zx_sgd_consts *c) {
    for (size_t i = 0; i < n; i++) {
        /* grad = grads[i] if not maximize else -grads[i]   (scale folded in, sign too) */
        float d_p = grad[i] * c->grad_scale;
        float p = param[i];
        if (c->l2) {
            /* grad = grad.add(param, alpha=weight_decay) */
            d_p = fmaf(c->weight_decay, p, d_p);
        }
        if (c->use_momentum) {
            float buf;
            if (c->first_step) {
                /* buf = grad.detach().clone() */
                buf = d_p;
            } else {
                /* buf.mul_(momentum).add_(grad, alpha=1 - dampening) */
                buf = momentum_buf[i] * c->momentum;
                buf = fmaf(c->one_minus_dampening, d_p, buf);
            }
            momentum_buf[i] = buf;
            /* nesterov: grad = grad.add(buf, alpha=momentum); else grad = buf */
            d_p = c->nesterov ? fmaf(c->momentum, buf, d_p) : buf;
        }
        /* param.add_(grad, alpha=-lr) */
        param[i] = fmaf(c->neg_lr, d_p, p);
    }
}

void zx_grad_sumsq_ref(size_t n, const float *grad, float scale, double *sumsq,
                       int64_t *nonfinite) {
    double sum = 0.0;
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float g = grad[i];
        if (!isfinite(g)) {   /* inf or nan: counted, left out of the sum */
            bad++;
            continue;
        }
        double x = (double)g * (double)scale;  /* exact: 24 x 24 bits fit in 53 */
        sum += x * x;
    }
    *sumsq += sum;
    *nonfinite += bad;
}

void zx_sum_slices_ref(size_t n, size_t stride, int32_t nslices, const float *src,
                       float *dst, int32_t accumulate, float scale) {
    for (size_t i = 0; i < n; i++) {
        float s = src[i];                         /* slice 0 */
        for (int32_t j = 1; j < nslices; j++)     /* slices 1.. in increasing order */
            s = s + src[(size_t)j * stride + i];
        float t = scale * s;
        dst[i] = accumulate ? dst[i] + t : t;
    }
}

void zx_sum_slices16_ref(size_t n, size_t stride, int32_t nslices, const uint16_t *src,
                         zx_dtype dtype, float *dst, int32_t accumulate, float scale) {
    for (size_t i = 0; i < n; i++) {
        /* the operations of zx_sum_slices_ref on the widened values */
        float s = dtype == ZX_BF16 ? zx_bf16_to_f32_ref(src[i]) : zx_f16_to_f32_ref(src[i]);
        for (int32_t j = 1; j < nslices; j++) {
            const uint16_t h = src[(size_t)j * stride + i];
            s = s + (dtype == ZX_BF16 ? zx_bf16_to_f32_ref(h) : zx_f16_to_f32_ref(h));
        }
        float t = scale * s;
        dst[i] = accumulate ? dst[i] + t : t;
    }
}

void zx_scale_ref(size_t n, float *x, float s) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] * s;
}

static float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* fp32 -> bf16, round to nearest even. NaN keeps its sign and top payload bits and
 * is made quiet (what vcvtneps2bf16 does). Subnormals round like any other value. */
uint16_t zx_f32_to_bf16_ref(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    uint32_t lsb = (u >> 16) & 1u;   /* ties go to the even neighbour */
    u += 0x7fffu + lsb;              /* may carry into the exponent: rounds up to inf */
    return (uint16_t)(u >> 16);
}

/* fp32 -> IEEE binary16, round to nearest even, subnormals, overflow to inf. NaN keeps
 * its sign and top 10 payload bits and is made quiet (what vcvtps2ph does). */
uint16_t zx_f32_to_f16_ref(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                      /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
    if (a >= 0x477ff000u)                     /* >= 65520 (half max + half ulp): inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {                   /* >= 2^-14: a normal half */
        uint32_t r = a - 0x38000000u;         /* rebias the exponent 127 -> 15 */
        r += 0x0fffu + ((r >> 13) & 1u);      /* round the 13 dropped bits to even */
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u)                     /* <= 2^-25 (a tie at 2^-25 goes to 0) */
        return sign;
    /* subnormal half: the value in units of 2^-24, rounded to nearest even */
    uint32_t mant = (a & 0x007fffffu) | 0x00800000u;
    uint32_t shift = 126u - (a >> 23);        /* 14..24 for exponents 102..112 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;  /* may become 0x400: min normal */
    return (uint16_t)(sign | q);
}

/* bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits. */
float zx_bf16_to_f32_ref(uint16_t h) {
    return bits_f32((uint32_t)h << 16);
}

/* binary16 -> fp32 is exact. NaN is made quiet (what vcvtph2ps does). */
float zx_f16_to_f32_ref(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x03ffu;
    if (e == 0x1fu)                           /* inf / NaN */
        return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
    if (e == 0) {
        if (mant == 0) return bits_f32(sign); /* +-0 */
        /* subnormal: mant * 2^-24, exact in fp32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (mant << 13));
}

void zx_cast_from_f32_ref(size_t n, const float *src, void *dst, zx_dtype dtype) {
    uint16_t *out = (uint16_t *)dst;
    if (dtype == ZX_BF16) {
        for (size_t i = 0; i < n; i++) out[i] = zx_f32_to_bf16_ref(src[i]);
    } else {
        for (size_t i = 0; i < n; i++) out[i] = zx_f32_to_f16_ref(src[i]);
    }
}

void zx_cast_to_f32_ref(size_t n, const void *src, zx_dtype dtype, float *dst) {
    const uint16_t *in = (const uint16_t *)src;
    if (dtype == ZX_BF16) {
        for (size_t i = 0; i < n; i++) dst[i] = zx_bf16_to_f32_ref(in[i]);
    } else {
        for (size_t i = 0; i < n; i++) dst[i] = zx_f16_to_f32_ref(in[i]);
    }
}
