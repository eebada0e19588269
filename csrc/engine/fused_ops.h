// fused_ops.h — the fused optimizers as one interface (AdamOp, SgdOp), so that one loop
// steps either (Note [One fused step] in stepper.cpp): where a bucket's states lie, the
// hyperparameters at a step count, and the kernel-table call over a stretch of the
// bucket's slice, on the fp32 master chunk by chunk or in one pass over a split master.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "core/zx_core.h"
#include "engine/kernels.h"   // defines: Kernels

namespace zx {

// Note [bf16 optimizer states] (stepper.cpp): the stochastic rounding's seed before the
// step count is added (zero_ext._C.BF16_STATE_SEED, for tests that redo a step).
constexpr uint64_t kStateSeed = 0x5eed0b16c0ffee01ULL;

// Adam / AdamW. The pointers index one bucket's slice from its element 0 (at(): Note
// [State windows]); fp32 states (m, v, and vmax with amsgrad) or bf16 ones (mb, vb).
struct AdamOp {
    using Hparams = zx_adam_hparams;
    float *m = nullptr, *v = nullptr, *vmax = nullptr;
    uint16_t *mb = nullptr, *vb = nullptr;
    uint64_t c0 = 0;   // bf16: the rounding counter of the slice's element 0

    static void at_step(Hparams &h, int64_t step) { h.step = step; }
    // so: where the bucket's slice element 0 falls in the flat states; c0: its counter
    AdamOp at(int64_t so, uint64_t counter) const {
        AdamOp o;
        o.m = m ? m + so : nullptr;
        o.v = v ? v + so : nullptr;
        o.vmax = vmax ? vmax + so : nullptr;
        o.mb = mb ? mb + so : nullptr;
        o.vb = vb ? vb + so : nullptr;
        o.c0 = counter;
        return o;
    }
    // [lo, lo + n) of the slice over a split master of `total` elements (Kernels::adam_split)
    bool one_pass(Kernels &k, int64_t total, int64_t lead, int64_t lo, int64_t n, uint16_t *hi, int16_t *rem,
                  uint8_t *ties, const at::Tensor &grad, const Hparams &hp, const double *ctl,
                  const int64_t *step) const {
        if (mb)
            return k.adam_bf16_states_split(total, lead, n, hi, rem, ties, grad.narrow(0, lo, n), mb + lo, vb + lo,
                                            hp, kStateSeed, c0 + (uint64_t)lo, ctl, step);
        return k.adam_split(total, lead, n, hi, rem, ties, grad.narrow(0, lo, n), m + lo, v + lo,
                            hp.amsgrad && vmax ? vmax + lo : nullptr, hp, ctl, step);
    }
    // [o, o + c) of the slice on the fp32 master p (lp: the low-precision copy of o, or null)
    void chunk(Kernels &k, float *p, int64_t o, int64_t c, const at::Tensor &grad, void *lp, zx_dtype lp_dtype,
               const Hparams &hp, const double *ctl, const int64_t *step) const {
        if (mb)
            return k.adam_bf16_states(c, p, grad.narrow(0, o, c), mb + o, vb + o, lp, lp_dtype, hp, kStateSeed,
                                      c0 + (uint64_t)o, ctl, step);
        k.adam(c, p, grad.narrow(0, o, c), m + o, v + o, hp.amsgrad && vmax ? vmax + o : nullptr, lp, lp_dtype, hp,
               ctl, step);
    }
};

// SGD: the momentum buffer (null without momentum), as AdamOp's states.
struct SgdOp {
    using Hparams = zx_sgd_hparams;
    float *buf = nullptr;

    static void at_step(Hparams &h, int64_t step) { h.first_step = step == 1; }
    SgdOp at(int64_t so, uint64_t) const { return {buf ? buf + so : nullptr}; }
    bool one_pass(Kernels &k, int64_t total, int64_t lead, int64_t lo, int64_t n, uint16_t *hi, int16_t *rem,
                  uint8_t *ties, const at::Tensor &grad, const Hparams &hp, const double *ctl,
                  const int64_t *step) const {
        return k.sgd_split(total, lead, n, hi, rem, ties, grad.narrow(0, lo, n), momentum(hp, lo), hp, ctl, step);
    }
    void chunk(Kernels &k, float *p, int64_t o, int64_t c, const at::Tensor &grad, void *lp, zx_dtype lp_dtype,
               const Hparams &hp, const double *ctl, const int64_t *step) const {
        k.sgd(c, p, grad.narrow(0, o, c), momentum(hp, o), lp, lp_dtype, hp, ctl, step);
    }

private:
    float *momentum(const Hparams &hp, int64_t o) const { return hp.momentum != 0.0 && buf ? buf + o : nullptr; }
};

}  // namespace zx
