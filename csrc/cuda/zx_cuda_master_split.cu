/* zx_cuda_master_split.cu — Note [Split master] (csrc/core/zx_master_split.c) on
 * the GPU: one thread per tie byte (8 consecutive elements), so no two threads
 * write the same byte; a warp covers 256 consecutive elements.
 *
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_master_split.cu
 */
#include "zx_cuda_master_split.h"
#include "zx_cuda_common.cuh"  // defines: ZX_CUDA_THREADS, zx_cuda_grid, ZX_CUDA_CHECK_LAUNCH

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
    zx_master_join_kernel(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) {
    const size_t bytes = (n + 7) / 8, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < bytes; b += stride) {
        const unsigned t = ties[b];
        const size_t end = b * 8 + 8 < n ? b * 8 + 8 : n;
        for (size_t i = b * 8; i < end; i++) {
            int32_t d = (t >> (i & 7)) & 1u ? 0x8000 : (int32_t)rem[i];
            if ((hi[i] & 0x7fffu) == 0 && d < 0) d = 0;   // an edited zero: no wrap into NaN
            out[i] = __uint_as_float(((uint32_t)hi[i] << 16) + (uint32_t)d);
        }
    }
}

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
    zx_master_split_kernel(size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) {
    const size_t bytes = (n + 7) / 8, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < bytes; b += stride) {
        unsigned t = 0;
        const size_t end = b * 8 + 8 < n ? b * 8 + 8 : n;
        for (size_t i = b * 8; i < end; i++) {
            const uint32_t d = __float_as_uint(m[i]) - ((uint32_t)hi[i] << 16);
            rem[i] = (int16_t)(uint16_t)d;
            t |= (unsigned)(d == 0x8000u) << (i & 7);
        }
        ties[b] = (uint8_t)t;
    }
}

extern "C" zx_status zx_cuda_master_join(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                                         float *out, void *stream) {
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !out) return ZX_ERR_INVALID_ARG;
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_master_join_kernel, (n + 7) / 8, &blocks);
    if (st != ZX_OK) return st;
    zx_master_join_kernel<<<blocks, ZX_CUDA_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(n, hi, rem, ties, out);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

extern "C" zx_status zx_cuda_master_split(size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties,
                                          void *stream) {
    if (n == 0) return ZX_OK;
    if (!m || !hi || !rem || !ties) return ZX_ERR_INVALID_ARG;
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_master_split_kernel, (n + 7) / 8, &blocks);
    if (st != ZX_OK) return st;
    zx_master_split_kernel<<<blocks, ZX_CUDA_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(n, m, hi, rem, ties);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
