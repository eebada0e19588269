// grad_ring.h — the ring of gradient slots (Note [Gradient layout], bucket.h): a
// send/receive pair per slot, each sized for the largest bucket, held by one bucket at a
// time while its gradient is staged and reduced. The ring grows one slot at a time, up to
// grad_ring_buckets before the engine finishes the oldest reduction to free one (and
// beyond, only when every slot is held by a bucket still filling).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zx {

// A staging/receive pair of the ring: the receive buffer only while a bucket holds it (Note [Ring slot lifetime]).
struct Slot {
    at::Tensor send;                   // (max padded_numel,) stages 2-3: the gradient staged
    at::Tensor recv;                   // all-to-all: (max padded_numel,) receive; reduce-scatter: (slice,) output
    // Note [Narrow gradient wire] (reducer.cpp): a bucket that needs reduce_dtype after all, for one reduction
    at::Tensor wide_send, wide_recv;
    int64_t owner = -1;                // bucket holding the slot, -1 when free
};

class GradRing {
public:
    // Slots hold send_numel / recv_numel elements (0: no such buffer) of `options`;
    // `size` slots before the engine must free one; keep: a slot keeps its buffers from
    // bucket to bucket (Note [Ring slot lifetime]).
    void configure(int64_t send_numel, int64_t recv_numel, at::TensorOptions options, int64_t size, bool keep) {
        send_numel_ = send_numel, recv_numel_ = recv_numel, options_ = options, keep_ = keep;
        size_ = std::max<int64_t>(1, size);
    }

    Slot &operator[](int64_t s) { return slots_[s]; }
    int64_t slots() const { return (int64_t)slots_.size(); }
    bool at_size() const { return (int64_t)slots_.size() >= size_; }

    // A free slot, now held by bucket b (its buffers made), or -1 when every slot is held.
    int64_t take_free(int64_t b) {
        for (int64_t s = 0; s < (int64_t)slots_.size(); s++)
            if (slots_[s].owner < 0) {
                hold(s, b);
                return s;
            }
        return -1;
    }
    // One more slot, held by bucket b.
    int64_t grow(int64_t b) {
        slots_.emplace_back();
        hold((int64_t)slots_.size() - 1, b);
        return (int64_t)slots_.size() - 1;
    }
    // Note [Ring slot lifetime]
    //   A slot's receive buffer lives while a bucket holds the slot: it is made (uninitialized,
    //   no pages yet) when the bucket takes the slot, written by the collective, read by the
    //   landing and freed with the slot. Kept from bucket to bucket, the last unit's received
    //   slices stayed resident through the next unit's backward, where stage 3's bf16 peak was
    //   (benchmarks/bench_peak_process.py: 14 MiB of 758 at 4 ranks). The send buffer is
    //   kept: the next bucket stages its gradients into it from its first one on, so freeing
    //   it would save only the part not yet staged, and each bucket would fault in its pages
    //   again (measured: a few % of an fp32 stage-3 step on the CPU; the receive buffer's
    //   faults cost half that). Every element a reduction reads is written first (stage_grad
    //   copies each piece, launch_bucket zeroes the gaps, the collective fills recv). Kept
    //   where another stream or thread may read it after the landing (configure's keep): on
    //   a GPU, and offload's down copies (Note [Optimizer offload]).
    void release(int64_t s) {
        Slot &sl = slots_[s];
        sl.owner = -1;
        sl.wide_send = sl.wide_recv = at::Tensor();
        if (!keep_) sl.recv = at::Tensor();
    }
    // zero_grad(set_to_none=True), nothing in flight: the slots go, to grow again at the next reduce
    void release_all() {
        for (const auto &s : slots_)
            if (s.owner >= 0) return;
        slots_.clear();
    }

    // The most the ring held at once (what a step needs: it is released between steps).
    int64_t step_bytes() const { return step_bytes_; }
    // What it holds now.
    int64_t bytes() const {
        int64_t n = 0;
        for (const auto &s : slots_)
            for (const at::Tensor *t : {&s.send, &s.recv, &s.wide_send, &s.wide_recv})
                n += t->defined() ? t->nbytes() : 0;
        return n;
    }

private:
    void hold(int64_t s, int64_t b) {
        Slot &sl = slots_[s];
        if (send_numel_ > 0 && !sl.send.defined()) sl.send = at::empty({send_numel_}, options_);
        if (recv_numel_ > 0 && !sl.recv.defined()) sl.recv = at::empty({recv_numel_}, options_);
        sl.owner = b;
        step_bytes_ = std::max(step_bytes_, bytes());
    }

    std::vector<Slot> slots_;
    int64_t send_numel_ = 0, recv_numel_ = 0, size_ = 1, step_bytes_ = 0;
    bool keep_ = true;
    at::TensorOptions options_;
};

}  // namespace zx
