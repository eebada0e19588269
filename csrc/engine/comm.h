// comm.h — the engine's collectives on the user's c10d ProcessGroup, and their
// counters. Every collective the engine issues goes through a Communicator, so
// that one place counts bytes per kind (stats()["comm"]) and turns a failed
// wait into one message.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/sequence.h"   // defines: Sequence (Note [Collective sequence check])
#include "engine/stats.h"      // defines: CommCounter, CommStats

namespace zx {

class Kernels;

// Note [Communication delay] (comm.cpp): the slow link a test asks for, which every
// collective of one Communicator goes through.
class CommDelay {
public:
    // ms: added to every collective; serialize: the launch waits for it; kern: the kernel
    // table of a CUDA engine (the sleep runs on a side stream), null on the CPU.
    void set(double ms, bool serialize, Kernels *kern);
    double ms() const { return ms_; }
    bool serialize() const { return serialize_; }
    // The collective issue() returns, delayed (ms() > 0).
    template <class F>
    c10::intrusive_ptr<c10d::Work> apply(F &&issue);

private:
    double ms_ = 0;
    bool serialize_ = false;
    Kernels *kern_ = nullptr;
    std::mutex mu_;
    std::chrono::steady_clock::time_point link_free_{};   // the CPU delay's link: busy until then
};

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class Communicator {
public:
    explicit Communicator(c10::optional<ProcessGroupPtr> pg);

    int64_t rank() const { return rank_; }
    int64_t world() const { return world_; }

    // Asynchronous collectives; the caller waits with wait().
    WorkPtr all_reduce_sum(at::Tensor t);
    // send (N equal slices) -> recv: the SUM of every rank's slice r on rank r.
    WorkPtr reduce_scatter_sum(at::Tensor recv, at::Tensor send);
    // send (N equal slices) -> recv (N slices: slice j from rank j), for a
    // reduce-scatter summed locally (Note [Reduce-scatter on gloo]).
    // logical_elem: bytes an element counts as (0: send's; Note [Narrow gradient wire] sends fewer)
    WorkPtr all_to_all(at::Tensor recv, at::Tensor send, int64_t logical_numel, int64_t logical_elem = 0);
    // The quantized form (Note [Quantized gradient reduction] in quant_reduce.h): codes
    // (bytes) and scales (fp32) of N equal slices, two all-to-alls; counted as a
    // reduce-scatter of logical_numel elements of logical_elem bytes whose wire bytes
    // are the codes' and scales'. Returns (scales' work, codes' work).
    std::pair<WorkPtr, WorkPtr> all_to_all_quantized(at::Tensor codes_recv, at::Tensor codes_send,
                                                     at::Tensor scales_recv, at::Tensor scales_send,
                                                     int64_t logical_numel, int64_t logical_elem);
    // in (one slice) -> out (N slices); in may be the owned slice of out.
    WorkPtr all_gather(at::Tensor out, at::Tensor in);
    // The quantized form (Note [Quantized parameter gather] in quant_gather.h): one
    // packed record (bytes) per rank; counted as an all-gather of logical_numel
    // elements of logical_elem bytes whose wire bytes are the N records.
    WorkPtr all_gather_quantized(at::Tensor recv, at::Tensor send, int64_t logical_numel, int64_t logical_elem);
    // Blocking.
    void broadcast(at::Tensor t, int64_t src);
    void all_reduce_sum_blocking(at::Tensor t, const char *what);
    void all_reduce_max_blocking(at::Tensor t, CommCounter &counter, const char *what);

    // Every wait on a collective goes through here, so that a peer that died
    // (or a timeout of the process group) surfaces as one message naming what failed.
    static void wait(const WorkPtr &work, const char *what);
    // wait(), watched by the sequence check: ranks that diverged are named. Timed:
    // the host's time blocked here is waited_s() (exposed communication on the CPU).
    void watch(const WorkPtr &work, const char *what);
    // wait() of a collective of another group (the node group), timed like watch().
    void timed_wait(const WorkPtr &work, const char *what);
    double waited_s() const { return (double)waited_ns_ * 1e-9; }

    // Note [Communication delay]: every collective launched here goes through CommDelay.
    void set_delay(double ms, bool serialize, Kernels *device_kern) { delay_.set(ms, serialize, device_kern); }
    double delay_ms() const { return delay_.ms(); }

    // Bytes and calls per kind, as stats()["comm"] reports them (Note [Engine stats], engine/stats.h);
    // count.used_flags: Note [Unused parameters]'s one byte per parameter per step.
    CommStats count;
    Sequence seq;   // records every collective issued here; the engine sets seq.subject()

private:
    // Issues one collective (issue() returns its Work) under Note [Communication delay].
    template <class F>
    WorkPtr launch(F &&issue);

    c10::optional<ProcessGroupPtr> pg_;
    int64_t rank_ = 0, world_ = 1;
    int64_t waited_ns_ = 0;
    CommDelay delay_;
};

}  // namespace zx
