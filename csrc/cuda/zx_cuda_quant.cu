/* zx_cuda_quant.cu — blockwise int8/int4 quantization kernels on the GPU.
 *
 * The maths is that of the CPU oracle (../core/zx_quant.c and zx_quant_ref.c, Note
 * [Blockwise quantization]) with explicit round-to-nearest intrinsics (Note [Floating
 * point] in zx_cuda_common.cuh), so codes, scales, residuals and dequantized values
 * are bit-identical to the CPU:
 *   amax   integer max of the |x| bit patterns (exact, any order; NaN > inf > finite)
 *   scale  __fdiv_rn(amax, qmax), one ulp up when __fmul_rn(scale, qmax) < amax;
 *          0 for an all-zero block, the quiet NaN 0x7fc00000 for an inf/NaN block
 *   code   rintf(__fdiv_rn(x, scale)) clamped to [-qmax, qmax] (rintf: ties to even)
 *   value  __fmul_rn((float) code, scale); sums with __fadd_rn in slice order
 * Layout: quantize runs one thread block per quantization block (grid-stride over
 * blocks): a block-wide max, then every thread encodes its elements (int4: pairs of
 * elements, one byte each). Dequantize and the slice sum are elementwise.
 *
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_quant.cu
 */
#include "zx_cuda_quant.h"
#include "zx_cuda_common.cuh"  // defines: ZX_CUDA_THREADS, zx_cuda_grid, zx_load_lp1, zx_store_lp1

#define ZX_CUDA_QUANT_NAN_BITS 0x7fc00000u   /* the CPU's ZX_QUANT_NAN_BITS */
#define ZX_CUDA_QUANT_MAX_GRID 65535         /* thread blocks of quantize (grid-stride beyond) */

/* One block's scale, as zx_quant_block_scale in ../core/zx_quant.c. */
struct zx_cuda_qblock {
    float scale;     /* stored; multiplies the codes */
    float divisor;   /* divides the values (1 for an all-zero block) */
    int finite;      /* 0: inf/NaN in the block: codes 0, scale NaN, residual untouched */
};

static __device__ __forceinline__ zx_cuda_qblock zx_cuda_block_scale(unsigned int amax_bits, float qmax) {
    zx_cuda_qblock blk;
    if (amax_bits >= 0x7f800000u) {
        blk.scale = __uint_as_float(ZX_CUDA_QUANT_NAN_BITS);
        blk.divisor = 0.0f;
        blk.finite = 0;
        return blk;
    }
    if (amax_bits == 0u) {
        blk.scale = 0.0f;
        blk.divisor = 1.0f;
        blk.finite = 1;
        return blk;
    }
    float amax = __uint_as_float(amax_bits);
    float scale = __fdiv_rn(amax, qmax);
    if (__fmul_rn(scale, qmax) < amax) scale = __uint_as_float(__float_as_uint(scale) + 1u);
    blk.scale = scale;
    blk.divisor = scale;
    blk.finite = 1;
    return blk;
}

/* src[i] (+ residual[i]) as fp32 */
template <int SRC>
static __device__ __forceinline__ float zx_cuda_q_input(const void *src, const float *residual, size_t i) {
    float x = zx_load_lp1<SRC>(src, i);
    return residual ? __fadd_rn(x, residual[i]) : x;
}

/* zx_q_encode_ref for one element: the code, and the residual when asked for. */
static __device__ __forceinline__ int zx_cuda_q_encode(float x, const zx_cuda_qblock &blk, float qmax,
                                                       float *residual, size_t i) {
    float t = rintf(__fdiv_rn(x, blk.divisor));
    t = fminf(fmaxf(t, -qmax), qmax);
    if (residual) residual[i] = __fsub_rn(x, __fmul_rn(t, blk.scale));
    return (int)t;
}

template <int SRC, int BITS>
__global__ void __launch_bounds__(ZX_CUDA_THREADS)
zx_cuda_quantize_kernel(size_t block_numel, size_t n, size_t nblocks, const void *src, float *residual,
                        unsigned char *q, float *scales) {
    __shared__ unsigned int warp_max[ZX_CUDA_THREADS / 32];
    __shared__ zx_cuda_qblock shared_blk;
    const float qmax = BITS == 8 ? 127.0f : 7.0f;
    const size_t block_bytes = BITS == 8 ? block_numel : block_numel / 2;
    for (size_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const size_t lo = b * block_numel;
        const size_t len = n - lo < block_numel ? n - lo : block_numel;
        /* pass 1: the block's amax */
        unsigned int amax = 0u;
        for (size_t i = threadIdx.x; i < len; i += blockDim.x) {
            unsigned int u = __float_as_uint(zx_cuda_q_input<SRC>(src, residual, lo + i)) & 0x7fffffffu;
            amax = u > amax ? u : amax;
        }
        for (int off = 16; off > 0; off >>= 1) {
            unsigned int other = __shfl_xor_sync(0xffffffffu, amax, off);
            amax = other > amax ? other : amax;
        }
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int m = 0u;
            for (int w = 0; w < (int)(blockDim.x / 32); w++) m = warp_max[w] > m ? warp_max[w] : m;
            shared_blk = zx_cuda_block_scale(m, qmax);
            scales[b] = shared_blk.scale;
        }
        __syncthreads();
        const zx_cuda_qblock blk = shared_blk;
        unsigned char *qb = q + b * block_bytes;
        /* pass 2: codes (0 for padding and for an inf/NaN block), residuals */
        if (BITS == 8) {
            for (size_t i = threadIdx.x; i < block_numel; i += blockDim.x) {
                int code = 0;
                if (i < len && blk.finite)
                    code = zx_cuda_q_encode(zx_cuda_q_input<SRC>(src, residual, lo + i), blk, qmax,
                                            residual, lo + i);
                qb[i] = (unsigned char)(signed char)code;
            }
        } else {
            for (size_t p = threadIdx.x; p < block_numel / 2; p += blockDim.x) {
                int c0 = 0, c1 = 0;
                if (blk.finite) {
                    size_t e0 = 2 * p, e1 = 2 * p + 1;
                    if (e0 < len)
                        c0 = zx_cuda_q_encode(zx_cuda_q_input<SRC>(src, residual, lo + e0), blk, qmax,
                                              residual, lo + e0);
                    if (e1 < len)
                        c1 = zx_cuda_q_encode(zx_cuda_q_input<SRC>(src, residual, lo + e1), blk, qmax,
                                              residual, lo + e1);
                }
                qb[p] = (unsigned char)((c0 & 0x0f) | ((c1 & 0x0f) << 4));
            }
        }
        __syncthreads();   /* shared_blk / warp_max are reused by the next block */
    }
}

/* The code of element k of a block's payload qb. */
template <int BITS>
static __device__ __forceinline__ int zx_cuda_q_code(const unsigned char *qb, size_t k) {
    if (BITS == 8) return (int)(signed char)qb[k];
    int v = (k & 1) ? (qb[k / 2] >> 4) : (qb[k / 2] & 0x0f);
    return v >= 8 ? v - 16 : v;
}

template <int BITS, int DST>
__global__ void __launch_bounds__(ZX_CUDA_THREADS)
zx_cuda_dequantize_kernel(size_t block_numel, size_t n, const unsigned char *q, const float *scales,
                          void *dst) {
    const size_t block_bytes = BITS == 8 ? block_numel : block_numel / 2;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        size_t b = i / block_numel;
        int code = zx_cuda_q_code<BITS>(q + b * block_bytes, i - b * block_numel);
        zx_store_lp1<DST>(dst, i, __fmul_rn((float)code, scales[b]));
    }
}

template <int BITS>
__global__ void __launch_bounds__(ZX_CUDA_THREADS)
zx_cuda_dequantize_sum_kernel(size_t block_numel, size_t n, int32_t nslices, size_t slice_blocks,
                              const unsigned char *q, const float *scales, float *dst, int32_t accumulate,
                              float scale) {
    const size_t block_bytes = BITS == 8 ? block_numel : block_numel / 2;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        size_t b = i / block_numel, k = i - b * block_numel;
        float sum = 0.0f;
        for (int32_t j = 0; j < nslices; j++) {
            size_t blk = (size_t)j * slice_blocks + b;
            float v = __fmul_rn((float)zx_cuda_q_code<BITS>(q + blk * block_bytes, k), scales[blk]);
            sum = j == 0 ? v : __fadd_rn(sum, v);
        }
        float t = __fmul_rn(scale, sum);
        dst[i] = accumulate ? __fadd_rn(dst[i], t) : t;
    }
}

/* ------------------------------------------------------------------ launchers */

static int zx_cuda_q_valid(int32_t bits, size_t block_numel) {
    return block_numel > 0 && (bits == 8 || (bits == 4 && block_numel % 2 == 0));
}

template <int SRC, int BITS>
static zx_status zx_cuda_quantize_launch(size_t block_numel, size_t n, const void *src, float *residual,
                                         void *q, float *scales, cudaStream_t stream) {
    size_t nblocks = zx_quant_blocks(n, block_numel);
    int grid = (int)(nblocks < ZX_CUDA_QUANT_MAX_GRID ? nblocks : ZX_CUDA_QUANT_MAX_GRID);
    zx_cuda_quantize_kernel<SRC, BITS><<<grid, ZX_CUDA_THREADS, 0, stream>>>(
        block_numel, n, nblocks, src, residual, static_cast<unsigned char *>(q), scales);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

template <int SRC>
static zx_status zx_cuda_quantize_bits(int32_t bits, size_t block_numel, size_t n, const void *src,
                                       float *residual, void *q, float *scales, cudaStream_t stream) {
    if (bits == 8) return zx_cuda_quantize_launch<SRC, 8>(block_numel, n, src, residual, q, scales, stream);
    return zx_cuda_quantize_launch<SRC, 4>(block_numel, n, src, residual, q, scales, stream);
}

extern "C" zx_status zx_cuda_quantize(int32_t bits, size_t block_numel, size_t n, const void *src,
                                      zx_dtype src_dtype, float *residual, void *q, float *scales,
                                      void *stream) {
    if (!zx_cuda_q_valid(bits, block_numel) || zx_dtype_size(src_dtype) == 0) return ZX_ERR_INVALID_ARG;
    size_t bytes = 0;
    zx_status st = zx_quant_bytes(bits, block_numel, n, &bytes);
    if (st != ZX_OK) return st;
    if (n == 0) return ZX_OK;
    if (src == nullptr || q == nullptr || scales == nullptr) return ZX_ERR_INVALID_ARG;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (src_dtype) {
    case ZX_F32: return zx_cuda_quantize_bits<ZX_F32>(bits, block_numel, n, src, residual, q, scales, s);
    case ZX_BF16: return zx_cuda_quantize_bits<ZX_BF16>(bits, block_numel, n, src, residual, q, scales, s);
    case ZX_F16: return zx_cuda_quantize_bits<ZX_F16>(bits, block_numel, n, src, residual, q, scales, s);
    }
    return ZX_ERR_INVALID_ARG;
}

template <int BITS, int DST>
static zx_status zx_cuda_dequantize_launch(size_t block_numel, size_t n, const void *q, const float *scales,
                                           void *dst, cudaStream_t stream) {
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_cuda_dequantize_kernel<BITS, DST>, n, &blocks);
    if (st != ZX_OK) return st;
    zx_cuda_dequantize_kernel<BITS, DST><<<blocks, ZX_CUDA_THREADS, 0, stream>>>(
        block_numel, n, static_cast<const unsigned char *>(q), scales, dst);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

template <int DST>
static zx_status zx_cuda_dequantize_bits(int32_t bits, size_t block_numel, size_t n, const void *q,
                                         const float *scales, void *dst, cudaStream_t stream) {
    if (bits == 8) return zx_cuda_dequantize_launch<8, DST>(block_numel, n, q, scales, dst, stream);
    return zx_cuda_dequantize_launch<4, DST>(block_numel, n, q, scales, dst, stream);
}

extern "C" zx_status zx_cuda_dequantize(int32_t bits, size_t block_numel, size_t n, const void *q,
                                        const float *scales, void *dst, zx_dtype dst_dtype, void *stream) {
    if (!zx_cuda_q_valid(bits, block_numel) || zx_dtype_size(dst_dtype) == 0) return ZX_ERR_INVALID_ARG;
    size_t bytes = 0;
    zx_status st = zx_quant_bytes(bits, block_numel, n, &bytes);
    if (st != ZX_OK) return st;
    if (n == 0) return ZX_OK;
    if (q == nullptr || scales == nullptr || dst == nullptr) return ZX_ERR_INVALID_ARG;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (dst_dtype) {
    case ZX_F32: return zx_cuda_dequantize_bits<ZX_F32>(bits, block_numel, n, q, scales, dst, s);
    case ZX_BF16: return zx_cuda_dequantize_bits<ZX_BF16>(bits, block_numel, n, q, scales, dst, s);
    case ZX_F16: return zx_cuda_dequantize_bits<ZX_F16>(bits, block_numel, n, q, scales, dst, s);
    }
    return ZX_ERR_INVALID_ARG;
}

template <int BITS>
static zx_status zx_cuda_dequantize_sum_launch(size_t block_numel, size_t n, int32_t nslices,
                                               size_t slice_blocks, const void *q, const float *scales,
                                               float *dst, int32_t accumulate, float scale,
                                               cudaStream_t stream) {
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_cuda_dequantize_sum_kernel<BITS>, n, &blocks);
    if (st != ZX_OK) return st;
    zx_cuda_dequantize_sum_kernel<BITS><<<blocks, ZX_CUDA_THREADS, 0, stream>>>(
        block_numel, n, nslices, slice_blocks, static_cast<const unsigned char *>(q), scales, dst,
        accumulate, scale);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

extern "C" zx_status zx_cuda_dequantize_sum(int32_t bits, size_t block_numel, size_t n, int32_t nslices,
                                            size_t slice_blocks, const void *q, const float *scales,
                                            float *dst, int32_t accumulate, float scale, void *stream) {
    if (!zx_cuda_q_valid(bits, block_numel) || nslices < 1) return ZX_ERR_INVALID_ARG;
    if (slice_blocks < zx_quant_blocks(n, block_numel)) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (q == nullptr || scales == nullptr || dst == nullptr) return ZX_ERR_INVALID_ARG;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (bits == 8)
        return zx_cuda_dequantize_sum_launch<8>(block_numel, n, nslices, slice_blocks, q, scales, dst,
                                                accumulate, scale, s);
    return zx_cuda_dequantize_sum_launch<4>(block_numel, n, nslices, slice_blocks, q, scales, dst,
                                            accumulate, scale, s);
}
