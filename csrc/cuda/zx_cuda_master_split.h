/* zx_cuda_master_split.h — the split master's join and split on the GPU
 * (Note [Split master], csrc/core/zx_master_split.c; implemented in
 * zx_cuda_master_split.cu): the same integer formulas as zx_master_join /
 * zx_master_split, so the bits are the same on every device. */
#ifndef ZX_CUDA_MASTER_SPLIT_H
#define ZX_CUDA_MASTER_SPLIT_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

zx_status zx_cuda_master_join(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out,
                              void *stream);
zx_status zx_cuda_master_split(size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties,
                               void *stream);

/* Note [Fused split-master step]: one Adam/AdamW step (zx_cuda_adam_step's maths and
 * arguments) of the master kept as hi, rem, ties, in one pass: join, step, round
 * into hi, split, with no fp32 master in memory. The call covers `total` elements of
 * hi/rem (total <= lead + n + 7, ties[0] bit 0 is element 0, as zx_cuda_master_join);
 * elements [lead, lead + n) step, with grad, exp_avg, exp_avg_sq (and max_exp_avg_sq,
 * iff hp->amsgrad) indexed from the first of them; the others keep their bits.
 * Bit for bit what join, zx_cuda_adam_step with a bf16 copy into hi, and split give. */
zx_status zx_cuda_adam_step_split(size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                                  const float *grad, float *exp_avg, float *exp_avg_sq, float *max_exp_avg_sq,
                                  const zx_adam_hparams *hp, const int64_t *device_step, const double *ctl,
                                  void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_MASTER_SPLIT_H */
