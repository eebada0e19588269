/* zx_cuda_control.cu — the step's control scalars on the device (Note [Step
 * control] in ../core/zx_step_control.h): one-thread kernels running the
 * same inline rules as the CPU.
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_control.cu
 */
#include "zx_cuda_control.h"
#include "zx_cuda_common.cuh"  // defines: ZX_CUDA_CHECK_LAUNCH

static __global__ void zx_clip_control_kernel(double *ctl, const float *out2, double divisor,
                                              const zx_loss_scaler *scaler, double max_norm, float *norm_out) {
    zx_clip_control(ctl, out2, divisor, scaler, max_norm, norm_out);
}

static __global__ void zx_step_control_kernel(double *ctl, const float *out2, double divisor,
                                              zx_loss_scaler *scaler, float *scale_out, int64_t *steps,
                                              int32_t n_steps) {
    zx_step_control(ctl, out2, divisor, scaler, scale_out, steps, n_steps);
}

extern "C" zx_status zx_cuda_clip_control(double *ctl, const float *out2, double divisor,
                                          const zx_loss_scaler *scaler, double max_norm, float *norm_out,
                                          void *stream) {
    if (ctl == nullptr || out2 == nullptr || norm_out == nullptr || !(divisor > 0.0)) return ZX_ERR_INVALID_ARG;
    zx_clip_control_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(ctl, out2, divisor, scaler, max_norm,
                                                                          norm_out);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}

extern "C" zx_status zx_cuda_step_control(double *ctl, const float *out2, double divisor, zx_loss_scaler *scaler,
                                          float *scale_out, int64_t *steps, int32_t n_steps, void *stream) {
    if (ctl == nullptr || !(divisor > 0.0) || n_steps < 0 || (n_steps > 0 && steps == nullptr)) {
        return ZX_ERR_INVALID_ARG;
    }
    zx_step_control_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(ctl, out2, divisor, scaler, scale_out,
                                                                          steps, n_steps);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
