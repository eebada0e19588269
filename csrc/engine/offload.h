// offload.h — optimizer offload (offload="cpu"): the host side of the engine's
// optimizer state and the two copy paths between it and the device.
//
// Note [Optimizer offload]
//   With offload="cpu" (stages 1-3) the fp32 master, the optimizer states and the
//   reduced gradient shard live in host memory and are stepped there by the CPU
//   kernel table (the C core's threaded SIMD kernels); the device keeps what
//   forward and backward use: the parameters in param_dtype (stage 3: this rank's
//   shard of them, UnitStore::param_shard, which the unit gathers read), stage 1's gradient
//   buckets, the gradient ring. Per bucket, in bucket order:
//     down  as the bucket's reduction lands (GradReducer::complete), its slice (reduce_dtype)
//           is copied into a pinned slot of the down ring on a copy stream; the
//           worker thread waits for that copy alone, adds (stage 2) or copies (stage 1)
//           the slot into the host gradient shard and frees the slot, while backward
//           goes on;
//     step  opt.step() steps bucket k on the host as soon as its gradient has landed,
//           casts the updated master slice into a pinned slot of the up ring, and
//           copies it into the device's owned slice (stage 3: UnitStore::param_shard) on the copy stream, which
//           overlaps the step of bucket k+1; the device's stream waits for those
//           copies before the parameter all-gather reads the owned slices.
//   Pinned memory is the two rings only (kSlots slots each, one bucket slice per
//   slot): the master, states and gradient shard are ordinary host memory.
//   Per step the link carries the gradient slice down in reduce_dtype and the
//   parameter slice up in param_dtype: 4 B/param with bf16, each bucket once.
//   On a CPU engine the "device" is host memory too: the same buffers, ring,
//   worker thread and order, with synchronous copies; the results are bit-identical
//   to the engine without offload (tests/test_offload.py), because the same kernels
//   run on the same values in the same order.
//   A device buffer a down copy reads (a ring slot's receive/staging buffer) is not
//   written again before that copy is done: acquiring the ring slot makes the
//   device's stream wait for it (before_reuse).
#pragma once

#include <ATen/ATen.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace zx {

class Offload {
public:
    static constexpr int64_t kSlots = 2;   // slots in each ring

    // dev: the parameters' device; down_numel / up_numel: elements of the largest
    // slice a down (reduce_dtype rdt) / up (param_dtype pdt) copy carries.
    Offload(at::Device dev, at::ScalarType rdt, int64_t down_numel, at::ScalarType pdt, int64_t up_numel,
            int64_t num_buckets);
    ~Offload();
    Offload(const Offload &) = delete;
    Offload &operator=(const Offload &) = delete;

    // Host memory for the master, states and gradient shard (ordinary, not pinned).
    static at::TensorOptions host(at::ScalarType dt) { return at::TensorOptions().dtype(dt).device(at::kCPU); }

    // Down: copy src (device, contiguous, <= down_numel of rdt) into a free ring slot
    // after the work the device's stream holds now; the worker thread then runs
    // finish(slot view of src's size) on the host. Bucket b's gradient has landed on
    // the host once its last finish ran (wait_bucket). ring_slot: the engine's ring
    // slot whose buffer src is (-1: none), see before_reuse.
    void down(int64_t b, const at::Tensor &src, int64_t ring_slot, std::function<void(const at::Tensor &)> finish);
    // The device's stream waits for the down copies that read ring slot s's buffers.
    void before_reuse(int64_t ring_slot);
    void wait_bucket(int64_t b);   // bucket b's finishes ran (rethrows the worker's error)
    void drain();                  // every finish ran (rethrows the worker's error)

    // Up: the next up slot, n elements of param_dtype (waits until its last copy is
    // done); fill it on the host, then up() copies it into dst (device) and makes the
    // device's stream wait for that copy.
    at::Tensor up_slot(int64_t n);
    void up(const at::Tensor &slot, const at::Tensor &dst);

    int64_t pinned_bytes() const;  // both rings
    int64_t down_copies() const { return down_traffic_.copies; }
    int64_t up_copies() const { return up_.traffic.copies; }
    int64_t down_bytes() const { return down_traffic_.bytes; }
    int64_t up_bytes() const { return up_.traffic.bytes; }

private:
    struct Job {
        int64_t bucket, slot, ticket;
        std::optional<c10::Event> copied;   // device engines: the down copy's completion
        at::Tensor view;
        std::function<void(const at::Tensor &)> finish;
    };
    struct Traffic {
        int64_t copies = 0, bytes = 0;
    };
    // The up ring: its pinned slots, each one's last copy, the next slot to fill.
    struct UpRing {
        std::vector<at::Tensor> slots;
        std::vector<std::optional<c10::Event>> done;
        int64_t next = 0;
        Traffic traffic;
    };
    // The landing worker's queue of down copies, shared with it under mu; tickets: issued,
    // and every one below finished ran; error: the first finish that threw.
    struct Landing {
        std::mutex mu;
        std::condition_variable cv;
        std::deque<Job> jobs;
        int64_t issued = 0, finished = 0;
        std::exception_ptr error;
        bool stop = false;
    };
    void worker();
    void rethrow();                       // under landing_.mu
    c10::Stream current() const;

    at::Device dev_;
    bool async_;                          // a device with streams (not the CPU)
    std::optional<c10::Stream> copy_stream_;
    // the down ring: pinned slots, which are busy (under landing_.mu), and per engine ring
    // slot the down copy that reads its buffer (before_reuse)
    std::vector<at::Tensor> down_slots_;
    std::vector<char> down_busy_;
    std::vector<std::optional<c10::Event>> reuse_;
    std::vector<int64_t> bucket_ticket_;  // last ticket of each bucket's down copies
    Traffic down_traffic_;
    UpRing up_;
    Landing landing_;
    std::thread thread_;
};

}  // namespace zx
