/* zx_quant_ref.c — scalar reference chunk kernels of the blockwise quantization: the oracle.
 *
 * Plain C, one element at a time, commented line by line. The ISA SCALAR runs
 * these; the SIMD kernels (zx_quant_simd.inc) call them for their tails and must
 * reproduce them bit for bit, as must csrc/cuda/zx_cuda_quant.cu. The block logic
 * around them (amax -> scale, padding, int4 nibbles) is in zx_quant.c and shared by
 * every ISA. Build/test: make -C csrc/core test
 */
#include <math.h>
#include <string.h>

#include "zx_quant_internal.h"

uint32_t zx_q_absmax_ref(size_t n, const float *x) {
    uint32_t amax = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);   /* the float's bits */
        u &= 0x7fffffffu;              /* |x|: clear the sign bit */
        if (u > amax) amax = u;        /* integer order = value order; NaN > inf > finite */
    }
    return amax;
}

void zx_q_encode_ref(size_t n, const float *x, float divisor, float qmax, float scale,
                     int8_t *q, float *residual) {
    for (size_t i = 0; i < n; i++) {
        /* the value in units of the block's step, one correctly rounded division */
        float t = x[i] / divisor;
        /* round half to even (the default rounding mode; nearbyint raises nothing) */
        t = nearbyintf(t);
        /* the scale choice (zx_quant_block_scale) keeps |t| <= qmax; clamp anyway so
         * that no input can produce a code outside [-qmax, qmax] */
        t = fminf(fmaxf(t, -qmax), qmax);
        int8_t code = (int8_t)(int32_t)t;  /* integral and in range: exact */
        q[i] = code;
        if (residual) {
            /* error feedback: what the receiver will not see, kept for the next step.
             * (float)code * scale is the dequantized value, rounded once, as decode. */
            residual[i] = x[i] - (float)code * scale;
        }
    }
}

void zx_q_decode_ref(size_t n, const int8_t *q, float scale, float *y, int32_t accumulate) {
    for (size_t i = 0; i < n; i++) {
        /* dequantized value: code (exact in fp32) times the block's scale, rounded once */
        float v = (float)q[i] * scale;
        /* the fused all-to-all sum: add onto the running fp32 sum of earlier slices */
        y[i] = accumulate ? y[i] + v : v;
    }
}
