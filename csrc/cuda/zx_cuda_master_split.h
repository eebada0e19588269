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

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_MASTER_SPLIT_H */
