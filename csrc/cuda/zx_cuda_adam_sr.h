/* zx_cuda_adam_sr.h — Adam/AdamW with bf16 states and stochastic rounding on the GPU
 * (implemented in zx_cuda_adam_sr.cu). */
#ifndef ZX_CUDA_ADAM_SR_H
#define ZX_CUDA_ADAM_SR_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One Adam/AdamW step over n elements of device arrays with both states in bf16, the
 * maths and the rounding of zx_adam_step_bf16_states (zx_core.h), bit for bit: the
 * same fp32 operations, the same counter-based hash of (seed, offset + i) and the
 * same stochastic rounding (Note [Counter-based stochastic rounding], ../core/zx_sr.h).
 *   param                 (n,) fp32, read and written
 *   grad                  (n,) fp32, read (times hp->grad_scale)
 *   exp_avg, exp_avg_sq   (n,) bf16 bit patterns (__nv_bfloat16 / torch.bfloat16),
 *                         read and written
 *   param_lp              (n,) lp_dtype (ZX_BF16/ZX_F16) or NULL: receives the updated
 *                         param, round to nearest even
 *   seed, offset          element i draws its random bits from counter offset + i
 *   device_step           NULL: the step count is hp->step and the hash uses `seed`.
 *                         Non-NULL: a device int64 holding the step count after this
 *                         step's increment (as zx_cuda_adam_step); the kernel computes
 *                         the bias corrections from it and hashes with seed + step
 *                         (mod 2^64), so a step captured in a CUDA graph draws new bits
 *                         at every replay. zx_adam_step_bf16_states called with
 *                         seed + step gives the same bits.
 *   ctl                   NULL, or the step control in device memory (Note [Step
 *                         control]): nothing changes when ctl[ZX_CTL_SKIP] != 0, and
 *                         gradients are multiplied by ctl[ZX_CTL_MULT] in place of
 *                         hp->grad_scale
 *   stream                cudaStream_t as void*
 * Any alignment works (four elements at a time where every array allows it). Arrays
 * must not overlap. Returns ZX_ERR_UNSUPPORTED for hp->amsgrad, ZX_ERR_INVALID_ARG for
 * NULL arrays (n > 0), a bad lp_dtype or hp->step < 1 (host step); a CUDA launch
 * error as a status. */
zx_status zx_cuda_adam_step_bf16_states(size_t n, float *param, const float *grad,
                                        uint16_t *exp_avg, uint16_t *exp_avg_sq, void *param_lp,
                                        zx_dtype lp_dtype, const zx_adam_hparams *hp,
                                        uint64_t seed, uint64_t offset,
                                        const int64_t *device_step, const double *ctl,
                                        void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_ADAM_SR_H */
