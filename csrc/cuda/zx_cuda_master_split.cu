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
 * Note [Fused split-master step]
 *   The engine's step over a split master (csrc/engine/master_split.h) on the GPU
 *   was join into fp32 scratch, Adam, split: 8 more bytes per element moved each way
 *   than the step over an fp32 master, which made the 1.31B GPT's stage-1 step ~8 ms
 *   (6 %) slower than with master_remainder=False on the H200 even with the coalesced
 *   kernels above. zx_adam_split_kernel does the three in one pass, element by element
 *   in registers: it reads hi, rem and the tie bit instead of an fp32 master and
 *   writes them back instead of the master and the bf16 copy, so it moves 4 bytes
 *   fewer per element than the fp32-master step, not 16 more. The bits are the
 *   three kernels' (same join, same zx_adam_element, same rounding into hi, same
 *   split), which tests/test_cuda_master_split.py checks. The CPU has the same kernel,
 *   zx_adam_step_split (core/zx_kernels.c, its vector body in core/zx_kernels_simd.inc):
 *   there the chunked path cost 1.8-2.2x the fp32 master's step of 2^19 elements
 *   (benchmarks/bench_step_glue.py), the join and the split each a pass of their own.
 *
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_master_split.cu
 */
#include "zx_cuda_master_split.h"
#include "zx_cuda_adam.cuh"    // defines: zx_adam_scalars(_of), zx_adam_when, zx_adam_element
#include "zx_cuda_common.cuh"  // defines: ZX_CUDA_THREADS, zx_cuda_grid, ZX_CUDA_CHECK_LAUNCH, zx_f32_to_bf16

/* Element i's master from its top half h, remainder r and tie bit. */
static __device__ __forceinline__ float zx_join1(uint32_t h, int16_t r, bool tie) {
    int32_t d = tie ? 0x8000 : (int32_t)r;
    if ((h & 0x7fffu) == 0 && d < 0) d = 0;   // an edited zero: no wrap into NaN
    return __uint_as_float((h << 16) + (uint32_t)d);
}

/* The remainder of m over its top half h (the rounding of m); returns the tie bit. */
static __device__ __forceinline__ bool zx_split1(float m, uint32_t h, int16_t *r) {
    const uint32_t d = __float_as_uint(m) - (h << 16);
    *r = (int16_t)(uint16_t)d;
    return d == 0x8000u;
}

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
    zx_master_join_kernel(size_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = zx_join1(hi[i], rem[i], (ties[i >> 3] >> (i & 7)) & 1u);
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
            int16_t r;
            tie = zx_split1(m[i], hi[i], &r);
            rem[i] = r;
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

struct zx_adam_split_args {
    size_t total, lead, n;
    uint16_t *hi;
    int16_t *rem;
    uint8_t *ties;
    const float *grad;
    float *exp_avg, *exp_avg_sq, *max_exp_avg_sq;   // indexed from element lead
    zx_adam_when when;
    zx_adam_scalars s;
};

/* Warps move as in zx_master_split_kernel: lanes 0, 8, 16, 24 write the ballot's tie
 * bytes. Every lane reads its tie bit before the ballot, so a byte is read before it is
 * written, by the warp that writes it. */
static __global__ void __launch_bounds__(ZX_CUDA_THREADS) zx_adam_split_kernel(zx_adam_split_args a) {
    zx_adam_scalars s = a.s;
    if (!a.when.prepare(s)) return;   // the same answer in every thread
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const unsigned lane = threadIdx.x & 31u;
    const size_t first = (size_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31u);
    for (size_t base = first; base < a.total; base += stride) {
        const size_t i = base + lane;
        bool tie = false;
        if (i < a.total) {
            tie = (a.ties[i >> 3] >> (i & 7)) & 1u;
            const size_t j = i - a.lead;   // wraps below lead: not stepped
            if (i >= a.lead && j < a.n) {
                float m = a.exp_avg[j], v = a.exp_avg_sq[j];
                float vmax = s.amsgrad ? a.max_exp_avg_sq[j] : 0.0f;
                const float p = zx_adam_element(zx_join1(a.hi[i], a.rem[i], tie), a.grad[j], m, v, vmax, s);
                a.exp_avg[j] = m;
                a.exp_avg_sq[j] = v;
                if (s.amsgrad) a.max_exp_avg_sq[j] = vmax;
                const uint16_t h = __bfloat16_as_ushort(zx_f32_to_bf16(p));
                int16_t r;
                tie = zx_split1(p, h, &r);
                a.hi[i] = h;
                a.rem[i] = r;
            }
        }
        const unsigned bits = __ballot_sync(0xffffffffu, tie);
        if ((lane & 7u) == 0 && i < a.total) a.ties[i >> 3] = (uint8_t)(bits >> lane);
    }
}

extern "C" zx_status zx_cuda_adam_step_split(size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                                             uint8_t *ties, const float *grad, float *exp_avg, float *exp_avg_sq,
                                             float *max_exp_avg_sq, const zx_adam_hparams *hp,
                                             const int64_t *device_step, const double *ctl, void *stream) {
    if (hp == nullptr) return ZX_ERR_INVALID_ARG;
    if (device_step == nullptr && hp->step < 1) return ZX_ERR_INVALID_ARG;
    if (lead > total || n > total - lead || total - lead - n >= 8) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !grad || !exp_avg || !exp_avg_sq) return ZX_ERR_INVALID_ARG;
    if (hp->amsgrad && max_exp_avg_sq == nullptr) return ZX_ERR_INVALID_ARG;
    zx_adam_split_args a = {total, lead, n, hi, rem, ties, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                            zx_adam_when_of(hp, device_step, ctl), zx_adam_scalars_of(hp, device_step == nullptr)};
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_adam_split_kernel, total, &blocks);
    if (st != ZX_OK) return st;
    zx_adam_split_kernel<<<blocks, ZX_CUDA_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(a);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
