/* zx_cuda_pack.cu — the local half of a reduce-scatter (sum of slices) and the
 * fp32 <-> bf16/fp16 casts on the GPU.
 *
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_pack.cu
 */
#include "zx_cuda_pack.h"
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_launch_elementwise, zx_load_lp*, zx_store_lp*

/* src[i] + src[slice_n + i] + ..., slices summed in increasing order, every
 * partial sum rounded, as zx_sum_slices_ref. */
static __device__ __forceinline__ float zx_sum_slices_element(const float *src, size_t slice_n,
                                                              int32_t nslices, size_t i) {
    float sum = src[i];
    for (int32_t j = 1; j < nslices; j++) sum = __fadd_rn(sum, src[(size_t)j * slice_n + i]);
    return sum;
}

struct zx_sum_slices_op {
    const float *src;          /* (nslices*slice_n,) */
    float *dst;                /* (slice_n,), may alias slice 0 when !accumulate */
    size_t slice_n;
    int32_t nslices;
    int32_t accumulate;
    float scale;

    __device__ bool prepare() { return true; }

    __device__ float finish(float old, float sum) const {
        float scaled = __fmul_rn(scale, sum);
        return accumulate ? __fadd_rn(old, scaled) : scaled;
    }

    __device__ void one(size_t i) {
        float sum = zx_sum_slices_element(src, slice_n, nslices, i);
        float old = accumulate ? dst[i] : 0.0f;
        dst[i] = finish(old, sum);
    }

    __device__ void vec4(size_t i) {
        float4 sum = zx_load4(src, i);
        for (int32_t j = 1; j < nslices; j++) {
            float4 x = zx_load4(src, (size_t)j * slice_n + i);
            sum.x = __fadd_rn(sum.x, x.x);
            sum.y = __fadd_rn(sum.y, x.y);
            sum.z = __fadd_rn(sum.z, x.z);
            sum.w = __fadd_rn(sum.w, x.w);
        }
        float4 old = accumulate ? zx_load4(dst, i) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 out = make_float4(finish(old.x, sum.x), finish(old.y, sum.y),
                                 finish(old.z, sum.z), finish(old.w, sum.w));
        zx_store4(dst, i, out);
    }
};

extern "C" zx_status zx_cuda_sum_slices(size_t slice_n, int32_t nslices, const float *src, float *dst,
                                        int32_t accumulate, float scale, void *stream) {
    if (nslices < 1) return ZX_ERR_INVALID_ARG;
    if (slice_n == 0) return ZX_OK;
    if (src == nullptr || dst == nullptr) return ZX_ERR_INVALID_ARG;
    if (accumulate && dst == src) return ZX_ERR_INVALID_ARG;
    zx_sum_slices_op op = {src, dst, slice_n, nslices, accumulate, scale};
    /* Every slice must share src's alignment for the float4 body: with more
     * than one slice, slice_n must be a multiple of 4 (else scalar path). */
    const void *f32[2] = {src, dst};
    zx_span span = zx_span_plan(slice_n, f32, 2, nullptr, 0);
    if (nslices > 1 && slice_n % 4 != 0) span = zx_span{0, 0, slice_n};
    return zx_launch_elementwise(op, span, static_cast<cudaStream_t>(stream));
}

/* dst[i] = (DST) src[i] */
template <int DST>
struct zx_cast_from_f32_op {
    const float *src;
    void *dst;

    __device__ bool prepare() { return true; }
    __device__ void one(size_t i) { zx_store_lp1<DST>(dst, i, src[i]); }
    __device__ void vec4(size_t i) { zx_store_lp4<DST>(dst, i, zx_load4(src, i)); }
};

extern "C" zx_status zx_cuda_cast_from_f32(size_t n, const float *src, void *dst, zx_dtype dst_dtype,
                                           void *stream) {
    size_t dst_elem_bytes = zx_dtype_size(dst_dtype);
    if (dst_elem_bytes == 0) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (src == nullptr || dst == nullptr) return ZX_ERR_INVALID_ARG;
    const void *f32[1] = {src};
    zx_span span = zx_span_plan(n, f32, 1, dst, dst_elem_bytes);
    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    switch (dst_dtype) {
    case ZX_BF16: return zx_launch_elementwise(zx_cast_from_f32_op<ZX_BF16>{src, dst}, span, cuda_stream);
    case ZX_F16: return zx_launch_elementwise(zx_cast_from_f32_op<ZX_F16>{src, dst}, span, cuda_stream);
    case ZX_F32: return zx_launch_elementwise(zx_cast_from_f32_op<ZX_F32>{src, dst}, span, cuda_stream);
    }
    return ZX_ERR_INVALID_ARG;
}

/* dst[i] = (float) src[i] */
template <int SRC>
struct zx_cast_to_f32_op {
    const void *src;
    float *dst;

    __device__ bool prepare() { return true; }
    __device__ void one(size_t i) { dst[i] = zx_load_lp1<SRC>(src, i); }
    __device__ void vec4(size_t i) { zx_store4(dst, i, zx_load_lp4<SRC>(src, i)); }
};

extern "C" zx_status zx_cuda_cast_to_f32(size_t n, const void *src, zx_dtype src_dtype, float *dst,
                                         void *stream) {
    size_t src_elem_bytes = zx_dtype_size(src_dtype);
    if (src_elem_bytes == 0) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (src == nullptr || dst == nullptr) return ZX_ERR_INVALID_ARG;
    const void *f32[1] = {dst};
    zx_span span = zx_span_plan(n, f32, 1, src, src_elem_bytes);
    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    switch (src_dtype) {
    case ZX_BF16: return zx_launch_elementwise(zx_cast_to_f32_op<ZX_BF16>{src, dst}, span, cuda_stream);
    case ZX_F16: return zx_launch_elementwise(zx_cast_to_f32_op<ZX_F16>{src, dst}, span, cuda_stream);
    case ZX_F32: return zx_launch_elementwise(zx_cast_to_f32_op<ZX_F32>{src, dst}, span, cuda_stream);
    }
    return ZX_ERR_INVALID_ARG;
}
