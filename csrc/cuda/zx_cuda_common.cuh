/* zx_cuda_common.cuh — pieces shared by the CUDA kernels of zero_ext (internal).
 *
 * Included only by the .cu files of csrc/cuda; never by C/C++ code outside this folder.
 * It holds: the launch constants, the status mapping of CUDA errors, the
 * aligned/unaligned split of a flat range (zx_span), the low-precision stores,
 * and the generic elementwise driver that every optimizer/cast kernel uses.
 * Built as part of each .cu: `nvcc -c -arch=sm_90 -std=c++17 -I csrc/core x.cu`.
 *
 * Note [Vector and scalar paths]
 *   Every kernel works on flat arrays of n elements with any alignment. The
 *   launcher looks at the pointers once (zx_span_plan): when every fp32 array
 *   becomes 16-byte aligned at the same element `head` (0..3), and a
 *   low-precision array (if any) becomes 8-byte aligned there too, elements
 *   [head, head + 4*n_vec) are processed four at a time with float4 loads and
 *   stores; the few elements before `head` and after the body go one at a
 *   time. When the arrays disagree about alignment (a view offset by a
 *   different amount in each), all n elements take the scalar path. The maths
 *   of both paths is the same per-element __device__ function, so results do
 *   not depend on which path an element took.
 *
 * Note [Floating point]
 *   The GPU kernels reproduce the CPU oracle (csrc/core/zx_kernels_ref.c) bit
 *   for bit: every per-element formula is the same sequence of correctly
 *   rounded IEEE operations, written here as explicit intrinsics (__fmul_rn,
 *   __fadd_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn) so that nvcc cannot contract
 *   a*b+c into an fma the oracle does not have, nor split one it has. Build
 *   without --use_fast_math. Conversions to bf16/fp16 are round to nearest even
 *   (hardware cvt.rn), and a NaN keeps its sign and top payload bits and is made
 *   quiet, as the oracle (and x86's vcvtneps2bf16/vcvtps2ph) do. The one
 *   exception is zx_cuda_grad_sumsq, whose double sum is taken in another order.
 */
#ifndef ZX_CUDA_COMMON_CUH
#define ZX_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

/* Threads per block of every elementwise kernel, and the most resident blocks
 * per multiprocessor we ask for (grid-stride loops cover the rest). */
#define ZX_CUDA_THREADS 256
#define ZX_CUDA_BLOCKS_PER_SM 8

/* Template tag for "no low-precision copy-out"; otherwise the tag is a zx_dtype. */
#define ZX_CUDA_LP_NONE (-1)

/* ------------------------------------------------------------------ status */

/* Map a CUDA error to a zx_status. zx_core.h has no device-error code yet, so
 * anything that is not an argument or memory problem reads as UNSUPPORTED
 * (e.g. no kernel image for this GPU's architecture). */
static inline zx_status zx_cuda_status(cudaError_t err) {
    switch (err) {
    case cudaSuccess: return ZX_OK;
    case cudaErrorMemoryAllocation: return ZX_ERR_OUT_OF_MEMORY;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return ZX_ERR_INVALID_ARG;
    default: return ZX_ERR_UNSUPPORTED;
    }
}

/* After every launch: read (and clear) the launch error, return it as a status. */
#define ZX_CUDA_CHECK_LAUNCH() \
    do { \
        zx_status zx_launch_status_ = zx_cuda_status(cudaGetLastError()); \
        if (zx_launch_status_ != ZX_OK) return zx_launch_status_; \
    } while (0)

/* ------------------------------------------------------------------ spans */

/* How a flat range [0, n) is split between the float4 body and scalar
 * elements; see Note [Vector and scalar paths]. */
typedef struct zx_span {
    size_t head;       /* scalar elements before the body (0..3) */
    size_t n_vec;      /* float4 groups in the body, the first at element `head` */
    size_t n_scalar;   /* elements done one at a time: [0, head) and [head + 4*n_vec, n) */
} zx_span;

/* Element index of the k-th scalar element (0 <= k < span.n_scalar). */
static __device__ __forceinline__ size_t zx_span_scalar_index(const zx_span &span, size_t k) {
    return k < span.head ? k : k + 4 * span.n_vec;
}

/* Plan the split for n elements. f32[0..n_f32) are fp32 arrays (NULL entries
 * are skipped; at least one non-NULL), lp is an optional array of
 * lp_elem_bytes-sized elements that is accessed 4 elements at a time in the
 * body. Each array may alias another; alignment is all that matters here. */
static inline zx_span zx_span_plan(size_t n, const void *const *f32, int n_f32,
                                   const void *lp, size_t lp_elem_bytes) {
    zx_span scalar_only = {0, 0, n};
    const void *first = NULL;
    for (int k = 0; k < n_f32 && first == NULL; k++) first = f32[k];
    if (first == NULL) return scalar_only;
    uintptr_t first_addr = (uintptr_t)first;
    if (first_addr % 4 != 0) return scalar_only;
    size_t head = (size_t)((16 - first_addr % 16) % 16) / 4;
    if (head > n) head = n;
    for (int k = 0; k < n_f32; k++) {
        if (f32[k] != NULL && ((uintptr_t)f32[k] + 4 * head) % 16 != 0) return scalar_only;
    }
    if (lp != NULL && ((uintptr_t)lp + lp_elem_bytes * head) % (4 * lp_elem_bytes) != 0) {
        return scalar_only;
    }
    zx_span span;
    span.head = head;
    span.n_vec = (n - head) / 4;
    span.n_scalar = n - 4 * span.n_vec;
    return span;
}

/* ------------------------------------------------------------------ grid */

/* Blocks for `items` independent work items of `kernel` (ZX_CUDA_THREADS
 * threads per block): enough to cover them once, at most as many as can be
 * resident on the current device at once, so a grid-stride loop has no
 * half-empty second wave. Host-side queries only; no synchronization. */
template <typename Kernel>
static zx_status zx_cuda_grid(Kernel kernel, size_t items, int *blocks) {
    int device = 0, sm_count = 0, per_sm = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ZX_CUDA_THREADS, 0);
    if (err != cudaSuccess) return zx_cuda_status(err);
    if (per_sm < 1) per_sm = 1;
    if (per_sm > ZX_CUDA_BLOCKS_PER_SM) per_sm = ZX_CUDA_BLOCKS_PER_SM;
    size_t cap = (size_t)(sm_count > 0 ? sm_count : 1) * (size_t)per_sm;
    size_t want = (items + ZX_CUDA_THREADS - 1) / ZX_CUDA_THREADS;
    if (want < 1) want = 1;
    *blocks = (int)(want < cap ? want : cap);
    return ZX_OK;
}

/* ------------------------------------------------------------------ low-precision I/O */

/* fp32 -> bf16 / fp16, round to nearest even; NaN: sign and top payload bits
 * kept, made quiet (Note [Floating point]). */
static __device__ __forceinline__ __nv_bfloat16 zx_f32_to_bf16(float x) {
    if (isnan(x)) return __ushort_as_bfloat16((unsigned short)((__float_as_uint(x) >> 16) | 0x0040u));
    return __float2bfloat16_rn(x);
}
static __device__ __forceinline__ __half zx_f32_to_f16(float x) {
    if (isnan(x)) {
        unsigned int u = __float_as_uint(x);
        return __ushort_as_half((unsigned short)(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x03ffu)));
    }
    return __float2half_rn(x);
}

/* dst[i] = x as LP; LP is ZX_F32, ZX_BF16 or ZX_F16. */
template <int LP>
static __device__ __forceinline__ void zx_store_lp1(void *dst, size_t i, float x) {
    if constexpr (LP == ZX_BF16) {
        static_cast<__nv_bfloat16 *>(dst)[i] = zx_f32_to_bf16(x);
    } else if constexpr (LP == ZX_F16) {
        static_cast<__half *>(dst)[i] = zx_f32_to_f16(x);
    } else if constexpr (LP == ZX_F32) {
        static_cast<float *>(dst)[i] = x;
    }
}

/* dst[i..i+3] = x as LP; dst + i is 4*sizeof(LP)-byte aligned. */
template <int LP>
static __device__ __forceinline__ void zx_store_lp4(void *dst, size_t i, float4 x) {
    if constexpr (LP == ZX_BF16 || LP == ZX_F16) {
        unsigned int b0, b1, b2, b3;   /* the four 16-bit patterns, stored as one uint2 */
        if constexpr (LP == ZX_BF16) {
            b0 = __bfloat16_as_ushort(zx_f32_to_bf16(x.x));
            b1 = __bfloat16_as_ushort(zx_f32_to_bf16(x.y));
            b2 = __bfloat16_as_ushort(zx_f32_to_bf16(x.z));
            b3 = __bfloat16_as_ushort(zx_f32_to_bf16(x.w));
        } else {
            b0 = __half_as_ushort(zx_f32_to_f16(x.x));
            b1 = __half_as_ushort(zx_f32_to_f16(x.y));
            b2 = __half_as_ushort(zx_f32_to_f16(x.z));
            b3 = __half_as_ushort(zx_f32_to_f16(x.w));
        }
        *reinterpret_cast<uint2 *>(static_cast<unsigned short *>(dst) + i) =
            make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
    } else if constexpr (LP == ZX_F32) {
        *reinterpret_cast<float4 *>(static_cast<float *>(dst) + i) = x;
    }
}

/* (float) src[i] for an LP source. */
template <int LP>
static __device__ __forceinline__ float zx_load_lp1(const void *src, size_t i) {
    if constexpr (LP == ZX_BF16) return __bfloat162float(static_cast<const __nv_bfloat16 *>(src)[i]);
    if constexpr (LP == ZX_F16) return __half2float(static_cast<const __half *>(src)[i]);
    return static_cast<const float *>(src)[i];
}

/* (float) src[i..i+3] for an LP source; src + i is 4*sizeof(LP)-byte aligned. */
template <int LP>
static __device__ __forceinline__ float4 zx_load_lp4(const void *src, size_t i) {
    if constexpr (LP == ZX_BF16 || LP == ZX_F16) {
        uint2 b = *reinterpret_cast<const uint2 *>(static_cast<const unsigned short *>(src) + i);
        unsigned short h0 = (unsigned short)(b.x & 0xffffu), h1 = (unsigned short)(b.x >> 16);
        unsigned short h2 = (unsigned short)(b.y & 0xffffu), h3 = (unsigned short)(b.y >> 16);
        if constexpr (LP == ZX_BF16) {
            return make_float4(__bfloat162float(__ushort_as_bfloat16(h0)), __bfloat162float(__ushort_as_bfloat16(h1)),
                               __bfloat162float(__ushort_as_bfloat16(h2)), __bfloat162float(__ushort_as_bfloat16(h3)));
        } else {
            return make_float4(__half2float(__ushort_as_half(h0)), __half2float(__ushort_as_half(h1)),
                               __half2float(__ushort_as_half(h2)), __half2float(__ushort_as_half(h3)));
        }
    } else {
        return *reinterpret_cast<const float4 *>(static_cast<const float *>(src) + i);
    }
}

static __device__ __forceinline__ float4 zx_load4(const float *p, size_t i) {
    return *reinterpret_cast<const float4 *>(p + i);
}
static __device__ __forceinline__ void zx_store4(float *p, size_t i, float4 x) {
    *reinterpret_cast<float4 *>(p + i) = x;
}

/* ------------------------------------------------------------------ elementwise driver */

/* Runs op over a span with a grid-stride loop: op.vec4(i) for each body group
 * (elements i..i+3, aligned), then op.one(i) for each scalar element.
 * op.prepare() runs once per thread first (e.g. bias corrections from a
 * step count that lives on the device); when it returns false the thread does
 * nothing (a step skipped by a device-side verdict, Note [Step control]).
 * Op holds only pointers and scalars. */
template <typename Op>
__global__ void __launch_bounds__(ZX_CUDA_THREADS) zx_elementwise_kernel(Op op, zx_span span) {
    Op local = op;
    if (!local.prepare()) return;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t v = first; v < span.n_vec; v += stride) local.vec4(span.head + 4 * v);
    for (size_t k = first; k < span.n_scalar; k += stride) local.one(zx_span_scalar_index(span, k));
}

/* Launch zx_elementwise_kernel<Op> on `stream` and return its launch status. */
template <typename Op>
static zx_status zx_launch_elementwise(const Op &op, zx_span span, cudaStream_t stream) {
    size_t items = span.n_vec > span.n_scalar ? span.n_vec : span.n_scalar;
    if (items == 0) return ZX_OK;
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_elementwise_kernel<Op>, items, &blocks);
    if (st != ZX_OK) return st;
    zx_elementwise_kernel<Op><<<blocks, ZX_CUDA_THREADS, 0, stream>>>(op, span);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

#endif /* ZX_CUDA_COMMON_CUH */
