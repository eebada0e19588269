/* zx_cuda.h — the CUDA kernels of zero_ext: extern "C" launchers.
 *
 * Every launcher takes raw device pointers and a stream (a cudaStream_t passed
 * as void*, so C/C++ code without the CUDA headers can include this; NULL is
 * the legacy default stream), enqueues its kernel(s) and returns a zx_status
 * (never exits, never synchronizes the device, never allocates), so every call
 * can be captured in a CUDA graph. Arithmetic mirrors the CPU kernels of
 * ../core/zx_core.h element for element (torch.optim single-tensor maths).
 *
 * Built only when the extension is built with CUDA (setup.py: the .cu files of csrc/cuda
 * with -DZX_WITH_CUDA); every .cu also compiles alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_adam.cu
 */
#ifndef ZX_CUDA_H
#define ZX_CUDA_H

#include "zx_cuda_adam.h"   /* defines: zx_cuda_adam_step, zx_cuda_increment_step */
#include "zx_cuda_adam_sr.h" /* defines: zx_cuda_adam_step_bf16_states */
#include "zx_cuda_sgd.h"    /* defines: zx_cuda_sgd_step */
#include "zx_cuda_norm.h"   /* defines: zx_cuda_grad_sumsq, zx_cuda_scale */
#include "zx_cuda_pack.h"   /* defines: zx_cuda_sum_slices, zx_cuda_cast_from_f32, zx_cuda_cast_to_f32 */
#include "zx_cuda_control.h" /* defines: zx_cuda_clip_control, zx_cuda_step_control, ZX_CTL_* */
#include "zx_cuda_quant.h"  /* defines: zx_cuda_quantize, zx_cuda_dequantize, zx_cuda_dequantize_sum */
#include "zx_cuda_master_split.h" /* defines: zx_cuda_master_join, zx_cuda_master_split, zx_cuda_adam_step_split */

#endif /* ZX_CUDA_H */
