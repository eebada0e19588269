// master_split.h — the fp32 master of stages 0-2 kept as the bf16 parameter plus a
// 16-bit remainder and a tie bit (Note [Split master], csrc/core/zx_master_split.c).
//
// Note [Split master in the engine]
//   With param_dtype bf16, stages 0-2, one fused optimizer (Adam/AdamW/SGD) and no
//   param_quant or offload, zeroify() turns the master shard into a MasterSplit
//   (Engine::enable_split_master, engine.cpp): the owned slice of each
//   bucket's flat_param already is the master's rounding, so this rank keeps only
//   rem (2 bytes per shard element) and the tie bits (one per element, each bucket's
//   starting on a byte) instead of 4 bytes of fp32: 16 bytes per parameter of
//   model state in stage 2 with Adam become 14.125.
//   The fused step is one call of the kernel table over the split master (one_pass(),
//   Note [Fused split-master step]): each element joined, stepped, rounded into the bf16
//   parameter and split again, in registers (Adam, CPU and GPU) or through an L1 block
//   (SGD and bf16 states on the CPU). Where the table has no such call (the GPU's SGD and
//   bf16-state steps) it goes chunk by chunk (over()): join the chunk into fp32 scratch
//   (made at the first such step), run the kernel on it, split it back. Either way the
//   fp32 values the kernel sees are the master's bits, so the trajectory is the one of
//   an fp32 master shard, bit for bit (tests/test_split_master.py).
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
#include <vector>

#include "engine/kernels.h"   // defines: Kernels

namespace zx {

class MasterSplit {
public:
    // slice_numel: each bucket's slice of this rank's shard, at shard offsets
    // shard_offset; dev: where they live (it sets the chunk size).
    MasterSplit(const std::vector<int64_t> &slice_numel, const std::vector<int64_t> &shard_offset,
                int64_t shard_numel, const at::Device &dev);

    // Elements a chunk of over() holds: 2^24 on a GPU (few launches), 2^15 on the CPU
    // (whose table has every one-pass call, so it never chunks); never more than the largest
    // slice (rounded up to a tie byte).
    static int64_t chunk_numel(int64_t max_slice_numel, bool cuda);
    int64_t bytes() const { return rem_.nbytes() + ties_.nbytes(); }   // what replaces the fp32 master
    int64_t scratch_bytes() const { return scratch_.defined() ? scratch_.nbytes() : 0; }

    // Bucket b's master elements [at, at + n) (at a multiple of 8) into out, from hi
    // (the bucket's owned slice of flat_param, bf16 bits), and back.
    void join(Kernels &k, int64_t b, const uint16_t *hi, int64_t at, int64_t n, float *out);
    void split(Kernels &k, int64_t b, const float *m, const uint16_t *hi, int64_t at, int64_t n);
    // Every bucket's whole slice: joined into master (fp32, laid out as the shard; hi(b):
    // bucket b's bf16 parameters), and settled back: the parameters := master's rounding (the
    // step's), the remainders and ties := the rest.
    template <class Hi>
    void join_all(Kernels &k, Hi &&hi, float *master) {
        for (int64_t b = 0; b < (int64_t)slice_numel_.size(); b++)
            join(k, b, hi(b), 0, slice_numel_[b], master + shard_offset_[b]);
    }
    template <class Hi>
    void settle_all(Kernels &k, Hi &&hi, const float *master) {
        for (int64_t b = 0; b < (int64_t)slice_numel_.size(); b++) {
            const float *m = master + shard_offset_[b];
            k.cast_from_f32(slice_numel_[b], m, hi(b), ZX_BF16);
            split(k, b, m, hi(b), 0, slice_numel_[b]);
        }
    }

    // A step over the elements [lo, lo + n) of bucket b's slice (parameters at hi, written) in
    // one call (Note [Fused split-master step]): call(total, lead, hi, rem, ties), the kernel
    // table's one-pass call over those whole tie bytes; false: the table has none (then step
    // through over()).
    template <class F>
    bool one_pass(int64_t b, uint16_t *hi, int64_t slice_numel, int64_t lo, int64_t n, F &&call) {
        const int64_t a0 = lo & ~int64_t(7), end = std::min((lo + n + 7) & ~int64_t(7), slice_numel);
        return call(end - a0, lo - a0, hi + a0, rem_.data_ptr<int16_t>() + shard_offset_[b] + a0,
                    ties_.data_ptr<uint8_t>() + tie_offset_[b] + a0 / 8);
    }

    // fn(p, o, n) over the elements [lo, lo + n) of bucket b's slice (slice_numel of
    // them, parameters at hi), with p their fp32 master, chunk by chunk through the scratch.
    template <class F>
    void over(Kernels &k, int64_t b, const uint16_t *hi, int64_t slice_numel, int64_t lo, int64_t n, F &&fn) {
        if (!scratch_.defined()) scratch_ = at::empty({chunk_}, rem_.options().dtype(at::kFloat));
        pieces(k, b, hi, slice_numel, lo, lo & ~int64_t(7), lo + n, chunk_, scratch_.data_ptr<float>(), fn);
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

    std::vector<int64_t> slice_numel_, shard_offset_, tie_offset_;   // per bucket: its slice, rem and tie byte offset
    at::Tensor rem_;       // (shard_numel,) int16
    at::Tensor ties_;      // per bucket ceil(slice / 8) bytes, uint8
    at::Tensor scratch_;   // (chunk_,) fp32 once a step needed it (over())
    int64_t chunk_ = 0;    // chunk_numel()
};

}  // namespace zx
