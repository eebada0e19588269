// master_split.h — the fp32 master of stages 0-2 kept as the bf16 parameter plus a
// 16-bit remainder and a tie bit (Note [Split master], csrc/core/zx_master_split.c).
//
// Note [Split master in the engine]
//   With param_dtype bf16, stages 0-2, one fused optimizer (Adam/AdamW/SGD) and no
//   param_quant or offload, zeroify() turns the master shard into a MasterSplit
//   (Engine::enable_split_master, master_split.cpp): the owned slice of each
//   bucket's flat_param already is the master's rounding, so this rank keeps only
//   rem (2 bytes per shard element) and the tie bits (one per element, each bucket's
//   starting on a byte) instead of 4 bytes of fp32: 16 bytes per parameter of
//   model state in stage 2 with Adam become 14.125.
//   The fused step goes chunk by chunk (over(), at most chunk() elements): join the
//   chunk into fp32 scratch, run the kernel on it (it writes the bf16 parameter, as
//   it always does), split it back. Each chunk starts on a tie byte; elements of the
//   chunk outside the stepped run are joined and split unchanged. The fp32 values the
//   kernel sees are the master's bits, so the trajectory is the one of an fp32
//   master shard, bit for bit (tests/test_split_master.py). Adam with fp32 states skips
//   the chunks: one kernel joins, steps and splits each element in registers (Note [Fused
//   split-master step]: core/zx_kernels.c, cuda/zx_cuda_master_split.cu); the GPU's scratch
//   is made on the first step that needs it (SGD, bf16 states).
//   Everything else that reads or writes the master (checkpoints, loads, the
//   parameter fragments Python reads, gathered_parameters) gets an fp32 master shard
//   joined on demand (Engine::join_masters, from the first master_slice()) that is
//   authoritative until the engine next steps or casts (Engine::settle_masters:
//   round it into the parameters, split it, free it). Between the two it costs the
//   4 bytes per element it saved.
//   In-place edits of the parameters: with a joined master they are folded in as
//   before (absorb, only changed elements); otherwise the edited bf16 value is the
//   new top half and keeps the element's old remainder (a difference below half a
//   bf16 ulp from an fp32 master's exact fold). master_remainder=False keeps the
//   fp32 master shard instead.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/kernels.h"   // defines: Kernels
#include "parallel.h"         // defines: zx_parallel_blocks

namespace zx {

class MasterSplit {
public:
    // slice_numel: each bucket's slice of this rank's shard, at shard offsets
    // shard_offset; dev: where they live (it sets chunk()).
    MasterSplit(const std::vector<int64_t> &slice_numel, const std::vector<int64_t> &shard_offset,
                int64_t shard_numel, const at::Device &dev);

    // GPU: elements a chunk holds, 2^24 (few launches), never more than the largest slice
    // (rounded up to a tie byte). The CPU keeps no scratch tensor: each intra-op task steps
    // kCpuPiece elements at a time through a buffer of its own (128 KiB, in L2), so the join
    // and split cost a pass over data in cache, not over memory, and the per-call cost of
    // the kernels is spread over enough elements.
    static int64_t chunk_numel(int64_t max_slice_numel, bool cuda);
    static constexpr int64_t kCpuPiece = 32768;
    int64_t bytes() const { return rem_.nbytes() + ties_.nbytes(); }   // what replaces the fp32 master
    int64_t scratch_bytes() const { return scratch_.defined() ? scratch_.nbytes() : 0; }

    // Bucket b's master elements [at, at + n) (at a multiple of 8) into out, from hi
    // (the bucket's owned slice of flat_param, bf16 bits), and back.
    void join(Kernels &k, int64_t b, const uint16_t *hi, int64_t at, int64_t n, float *out);
    void split(Kernels &k, int64_t b, const float *m, const uint16_t *hi, int64_t at, int64_t n);

    // Adam over the elements [lo, lo + n) of bucket b's slice (parameters at hi, written) in
    // one pass when k has the fused kernel (Note [Fused split-master step]): m, v, vmax and
    // grad hold those n elements. false: k has none; step through over().
    bool adam(Kernels &k, int64_t b, uint16_t *hi, int64_t slice_numel, int64_t lo, int64_t n,
              const at::Tensor &grad, float *m, float *v, float *vmax, const zx_adam_hparams &hp, const double *ctl,
              const int64_t *step);

    // fn(p, o, n) over the elements [lo, lo + n) of bucket b's slice (slice_numel of
    // them, parameters at hi), with p their fp32 master, chunk by chunk.
    template <class F>
    void over(Kernels &k, int64_t b, const uint16_t *hi, int64_t slice_numel, int64_t lo, int64_t n, F &&fn) {
        const int64_t a0 = lo & ~int64_t(7), end = lo + n;
        if (chunk_ > 0 && !scratch_.defined()) scratch_ = at::empty({chunk_}, rem_.options().dtype(at::kFloat));
        if (!scratch_.defined()) {   // CPU: tasks over whole tie bytes; the kernels run inline in them
            zx_parallel_blocks(end - a0, 8, [&](int64_t, int64_t ta, int64_t tb) {
                // a piece joins whole tie bytes: up to the task's length rounded up to 8
                std::unique_ptr<float[]> piece(new float[(size_t)std::min(kCpuPiece, (tb - ta + 7) & ~int64_t(7))]);
                pieces(k, b, hi, slice_numel, lo, a0 + ta, a0 + tb, kCpuPiece, piece.get(), fn);
            });
            return;
        }
        pieces(k, b, hi, slice_numel, lo, a0, end, scratch_.numel(), scratch_.data_ptr<float>(), fn);
    }

private:
    // [from, to) (from on a tie byte) in pieces of c elements (a multiple of 8) through s,
    // which holds min(c, to - from rounded up to 8): join, fn on the elements at or after
    // lo, split.
    template <class F>
    void pieces(Kernels &k, int64_t b, const uint16_t *hi, int64_t slice_numel, int64_t lo, int64_t from,
                int64_t to, int64_t c, float *s, F &fn) {
        for (int64_t at = from; at < to; at += c) {
            const int64_t e = std::min(at + c, to), whole = std::min((e + 7) & ~int64_t(7), slice_numel);
            const int64_t first = std::max(at, lo);
            join(k, b, hi, at, whole - at, s);
            fn(s + (first - at), first, e - first);
            split(k, b, s, hi, at, whole - at);
        }
    }

    std::vector<int64_t> shard_offset_, tie_offset_;   // per bucket: its rem / tie byte offset
    at::Tensor rem_;       // (shard_numel,) int16
    at::Tensor ties_;      // per bucket ceil(slice / 8) bytes, uint8
    at::Tensor scratch_;   // GPU: (chunk_,) fp32 once a step needed it; CPU: undefined
    int64_t chunk_ = 0;    // chunk_numel(): 0 on the CPU
};

}  // namespace zx
