/* zx_cuda_master_split.cu — Note [Split master] (csrc/core/zx_master_split.c) on
 * the GPU: one thread per element, so a warp reads and writes 32 consecutive
 * elements (coalesced: 64-byte loads of hi and rem, a 128-byte store of the
 * master). A tie byte covers 8 elements, so split gathers a warp's 32 tie bits
 * with one ballot and lanes 0, 8, 16 and 24 each write one byte: no two threads
 * write the same byte, and none reads another's. (The first version gave each
 * thread a whole tie byte, 8 consecutive elements: each warp load then spanned 8
 * times the bytes it used; the 1.31B GPT's step on the H200 lost ~20 ms to it and
 * the join in stages 1-2, benchmarks/reference/h200/runs.md.)
 *
 * Element 0 of a call is bit 0 of ties[0] (callers start chunks on a tie byte),
 * and the grid-stride loop moves whole warps over warp-aligned groups of 32, so
 * a warp's group covers exactly 4 tie bytes (fewer at the end).
 *
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_master_split.cu
 */
#include "zx_cuda_master_split.h"
#include "zx_cuda_common.cuh"  // defines: ZX_CUDA_THREADS, zx_cuda_grid, ZX_CUDA_CHECK_LAUNCH

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
    zx_master_join_kernel(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint32_t h = hi[i];
        int32_t d = (ties[i >> 3] >> (i & 7)) & 1u ? 0x8000 : (int32_t)rem[i];
        if ((h & 0x7fffu) == 0 && d < 0) d = 0;   // an edited zero: no wrap into NaN
        out[i] = __uint_as_float((h << 16) + (uint32_t)d);
    }
}

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
    zx_master_split_kernel(size_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) {
    // Whole warps move together (ZX_CUDA_THREADS is a multiple of 32), so every lane
    // reaches the ballot; lanes past n vote 0, which is the partial last byte's padding.
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const unsigned lane = threadIdx.x & 31u;
    const size_t first = (size_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31u);
    for (size_t base = first; base < n; base += stride) {
        const size_t i = base + lane;
        bool tie = false;
        if (i < n) {
            const uint32_t d = __float_as_uint(m[i]) - ((uint32_t)hi[i] << 16);
            rem[i] = (int16_t)(uint16_t)d;
            tie = d == 0x8000u;
        }
        const unsigned bits = __ballot_sync(0xffffffffu, tie);
        if ((lane & 7u) == 0 && i < n) ties[i >> 3] = (uint8_t)(bits >> lane);
    }
}

extern "C" zx_status zx_cuda_master_join(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties,
                                         float *out, void *stream) {
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !out) return ZX_ERR_INVALID_ARG;
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_master_join_kernel, n, &blocks);
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
    zx_status st = zx_cuda_grid(zx_master_split_kernel, n, &blocks);
    if (st != ZX_OK) return st;
    zx_master_split_kernel<<<blocks, ZX_CUDA_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(n, m, hi, rem, ties);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
