/* zx_cuda_norm.cu — the fused gradient scan (sum of squares + inf/nan count)
 * and in-place scaling on the GPU.
 *
 * zx_cuda_grad_sumsq: each thread sums its elements in double, a block sums
 * its threads (warp shuffles, then one warp over the warp sums) and adds the
 * block's partial to the caller's device float[2] with atomicAdd, so calls
 * for several buffers accumulate into the same two floats.
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_norm.cu
 */
#include "zx_cuda_norm.h"
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_cuda_grid, zx_launch_elementwise

#define ZX_WARP_SIZE 32

/* One element of the scan, as zx_grad_sumsq_ref: a non-finite grad counts and
 * is left out; a finite one adds (grad*scale)^2, formed in double (exact). */
static __device__ __forceinline__ void zx_sumsq_element(float grad, float scale, double &sumsq,
                                                        unsigned long long &nonfinite) {
    if (isfinite(grad)) {
        double x = __dmul_rn((double)grad, (double)scale);
        sumsq = __dadd_rn(sumsq, __dmul_rn(x, x));
    } else {
        nonfinite += 1;
    }
}

static __device__ __forceinline__ double zx_warp_sum(double x) {
    for (int offset = ZX_WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
    return x;
}
static __device__ __forceinline__ unsigned long long zx_warp_sum(unsigned long long x) {
    for (int offset = ZX_WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
    return x;
}

static __global__ void __launch_bounds__(ZX_CUDA_THREADS)
zx_grad_sumsq_kernel(const float *grad, float scale, zx_span span, float *out2) {
    __shared__ double warp_sumsq[ZX_CUDA_THREADS / ZX_WARP_SIZE];
    __shared__ unsigned long long warp_nonfinite[ZX_CUDA_THREADS / ZX_WARP_SIZE];

    double sumsq = 0.0;
    unsigned long long nonfinite = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t v = first; v < span.n_vec; v += stride) {
        float4 g = zx_load4(grad, span.head + 4 * v);
        zx_sumsq_element(g.x, scale, sumsq, nonfinite);
        zx_sumsq_element(g.y, scale, sumsq, nonfinite);
        zx_sumsq_element(g.z, scale, sumsq, nonfinite);
        zx_sumsq_element(g.w, scale, sumsq, nonfinite);
    }
    for (size_t k = first; k < span.n_scalar; k += stride) {
        zx_sumsq_element(grad[zx_span_scalar_index(span, k)], scale, sumsq, nonfinite);
    }

    /* Block reduction: within each warp, then warp 0 over the warp partials. */
    const int lane = threadIdx.x % ZX_WARP_SIZE, warp = threadIdx.x / ZX_WARP_SIZE;
    sumsq = zx_warp_sum(sumsq);
    nonfinite = zx_warp_sum(nonfinite);
    if (lane == 0) {
        warp_sumsq[warp] = sumsq;
        warp_nonfinite[warp] = nonfinite;
    }
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / ZX_WARP_SIZE;
        sumsq = lane < num_warps ? warp_sumsq[lane] : 0.0;
        nonfinite = lane < num_warps ? warp_nonfinite[lane] : 0ull;
        sumsq = zx_warp_sum(sumsq);
        nonfinite = zx_warp_sum(nonfinite);
        if (lane == 0) {
            if (sumsq != 0.0) atomicAdd(&out2[0], (float)sumsq);
            if (nonfinite != 0) atomicAdd(&out2[1], (float)nonfinite);
        }
    }
}

extern "C" zx_status zx_cuda_grad_sumsq(size_t n, const float *grad, float scale, float *out2,
                                        void *stream) {
    if (out2 == nullptr) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (grad == nullptr) return ZX_ERR_INVALID_ARG;
    const void *f32[1] = {grad};
    zx_span span = zx_span_plan(n, f32, 1, nullptr, 0);
    int blocks = 0;
    zx_status st = zx_cuda_grid(zx_grad_sumsq_kernel, span.n_vec > span.n_scalar ? span.n_vec : span.n_scalar, &blocks);
    if (st != ZX_OK) return st;
    zx_grad_sumsq_kernel<<<blocks, ZX_CUDA_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        grad, scale, span, out2);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

/* x[i] *= s */
struct zx_scale_op {
    float *x;
    float s;

    __device__ bool prepare() { return true; }
    __device__ void one(size_t i) { x[i] = __fmul_rn(x[i], s); }
    __device__ void vec4(size_t i) {
        float4 v = zx_load4(x, i);
        v.x = __fmul_rn(v.x, s);
        v.y = __fmul_rn(v.y, s);
        v.z = __fmul_rn(v.z, s);
        v.w = __fmul_rn(v.w, s);
        zx_store4(x, i, v);
    }
};

extern "C" zx_status zx_cuda_scale(size_t n, float *x, float s, void *stream) {
    if (n == 0) return ZX_OK;
    if (x == nullptr) return ZX_ERR_INVALID_ARG;
    const void *f32[1] = {x};
    zx_scale_op op = {x, s};
    return zx_launch_elementwise(op, zx_span_plan(n, f32, 1, nullptr, 0), static_cast<cudaStream_t>(stream));
}
