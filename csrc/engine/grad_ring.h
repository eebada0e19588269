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

// A staging/receive pair of the ring.
struct Slot {
    at::Tensor send;                   // (max padded_numel,) stages 2-3: the gradient staged
    at::Tensor recv;                   // all-to-all: (max padded_numel,) receive; reduce-scatter: (slice,) output
    int64_t owner = -1;                // bucket holding the slot, -1 when free
};

class GradRing {
public:
    // Slots hold send_numel / recv_numel elements (0: no such buffer) of `options`;
    // `size` slots before the engine must free one.
    void configure(int64_t send_numel, int64_t recv_numel, at::TensorOptions options, int64_t size) {
        send_numel_ = send_numel, recv_numel_ = recv_numel, options_ = options;
        size_ = std::max<int64_t>(1, size);
    }

    Slot &operator[](int64_t s) { return slots_[s]; }
    int64_t slots() const { return (int64_t)slots_.size(); }
    bool at_size() const { return (int64_t)slots_.size() >= size_; }

    // A free slot, now held by bucket b, or -1 when every slot is held.
    int64_t take_free(int64_t b) {
        for (int64_t s = 0; s < (int64_t)slots_.size(); s++)
            if (slots_[s].owner < 0) {
                slots_[s].owner = b;
                return s;
            }
        return -1;
    }
    // One more slot, held by bucket b.
    int64_t grow(int64_t b) {
        Slot sl;
        // Uninitialized: every element a reduction reads is written first (stage_grad copies each
        // piece, launch_bucket zeroes the gaps, the collective fills recv), so a slot costs the
        // process only the pages a bucket touches (Note [Gradient shard lifetime] in shard_view.cpp).
        if (send_numel_ > 0) sl.send = at::empty({send_numel_}, options_);
        if (recv_numel_ > 0) sl.recv = at::empty({recv_numel_}, options_);
        sl.owner = b;
        slots_.push_back(std::move(sl));
        step_bytes_ = std::max(step_bytes_, bytes());
        return (int64_t)slots_.size() - 1;
    }
    void release(int64_t s) { slots_[s].owner = -1; }
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
            n += (s.send.defined() ? s.send.nbytes() : 0) + (s.recv.defined() ? s.recv.nbytes() : 0);
        return n;
    }

private:
    std::vector<Slot> slots_;
    int64_t send_numel_ = 0, recv_numel_ = 0, size_ = 1, step_bytes_ = 0;
    at::TensorOptions options_;
};

}  // namespace zx
