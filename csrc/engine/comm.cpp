// comm.cpp — see comm.h.
#include "engine/comm.h"

#include "engine/kernels.h"   // defines: Kernels::comm_delay_begin

#include <algorithm>
#include <thread>

// Note [Communication delay]
//   Overlap is proven, not assumed (tests/test_overlap.py, in the style of FSDP2's
//   overlap test): set_delay(ms) makes every collective launched here take at least ms
//   longer, as if the link were that slow, and a step must then cost its compute plus
//   only a small part of the delays, where a run that waits for every collective at its
//   launch (serialize) pays them all. The delay sits in the one place every collective
//   goes through, so the C++ collectives (reduce-scatters in backward hooks, gathers,
//   prefetches) are delayed as they really run:
//     - CPU: the link is one queue: a collective launched at t completes no earlier
//       than max(t, the previous one's end) + ms (DelayedWork: its wait() waits for the
//       real collective, then sleeps until then);
//     - CUDA: a side stream waits for the current stream, sleeps ms there (a spin
//       kernel, Kernels::comm_delay_begin), and is the current stream while the
//       collective is launched, so the collective's stream waits for the sleep; the
//       compute stream waits only where the engine waits for the collective. One side
//       stream: the sleeps queue as the CPU link does.
//   Python's collectives (zero_ext/comm.py) sleep ms after each, synchronously.

// Note [Collective entry points]
//   _allgather_base, _reduce_scatter_base and alltoall_base are deprecated in
//   torch 2.13 in favour of *_single, which torch 2.11 (the GPU machine) lacks;
//   the old names exist in both, so we keep them and silence the warning.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace zx {

namespace {

using Clock = std::chrono::steady_clock;

// A collective that completes no earlier than `ready` (Note [Communication delay]).
class DelayedWork final : public c10d::Work {
public:
    DelayedWork(WorkPtr inner, Clock::time_point ready) : inner_(std::move(inner)), ready_(ready) {}
    bool isCompleted() override { return inner_->isCompleted() && Clock::now() >= ready_; }
    std::exception_ptr exception() const override { return inner_->exception(); }
    std::vector<at::Tensor> result() override { return inner_->result(); }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
    void abort() override { inner_->abort(); }
    bool wait(std::chrono::milliseconds timeout) override {
        const auto start = Clock::now();
        const bool ok = inner_->wait(timeout);
        if (timeout.count() == 0 || ready_ <= start + timeout) {   // 0: no timeout
            std::this_thread::sleep_until(ready_);
            return ok;
        }
        std::this_thread::sleep_until(start + timeout);
        TORCH_CHECK(false, "zero_ext: a delayed collective did not complete within ", timeout.count(), " ms");
    }

private:
    WorkPtr inner_;
    Clock::time_point ready_;
};

}  // namespace

Communicator::Communicator(c10::optional<ProcessGroupPtr> pg) : pg_(std::move(pg)) {
    if (pg_.has_value()) {
        rank_ = (*pg_)->getRank();
        world_ = (*pg_)->getSize();
    }
    seq.attach(pg_, rank_, world_);
}

void Communicator::wait(const WorkPtr &work, const char *what) {
    try {
        work->wait();
    } catch (const std::exception &e) {
        TORCH_CHECK(false, "zero_ext: ", what, " failed: ", e.what(),
                    "\nAnother rank probably died, or stopped calling the same collectives; "
                    "this rank cannot continue. Restart the job from the last checkpoint.");
    }
}

void Communicator::watch(const WorkPtr &work, const char *what) {
    const auto t0 = Clock::now();
    seq.watch(work, what);
    waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void Communicator::timed_wait(const WorkPtr &work, const char *what) {
    const auto t0 = Clock::now();
    wait(work, what);
    waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

void CommDelay::set(double ms, bool serialize, Kernels *kern) {
    TORCH_CHECK(ms >= 0, "zero_ext: a communication delay of ", ms, " ms; pass 0 or more");
    std::lock_guard<std::mutex> lk(mu_);
    ms_ = ms;
    serialize_ = serialize;
    kern_ = kern;
    link_free_ = Clock::time_point{};
}

template <class F>
WorkPtr CommDelay::apply(F &&issue) {
    if (kern_ != nullptr) {   // CUDA: the sleep on the side stream the collective waits for
        kern_->comm_delay_begin(ms_);
        WorkPtr work;
        try {
            work = issue();
        } catch (...) {
            kern_->comm_delay_end();
            throw;
        }
        kern_->comm_delay_end();
        return work;
    }
    Clock::time_point ready;
    {
        std::lock_guard<std::mutex> lk(mu_);
        const auto now = Clock::now();
        link_free_ = std::max(now, link_free_) +
                     std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms_));
        ready = link_free_;
    }
    return c10::make_intrusive<DelayedWork>(issue(), ready);
}

template <class F>
WorkPtr Communicator::launch(F &&issue) {
    if (delay_.ms() <= 0) return issue();
    WorkPtr work = delay_.apply(std::forward<F>(issue));
    if (delay_.serialize()) timed_wait(work, "delayed collective");
    return work;
}

WorkPtr Communicator::all_reduce_sum(at::Tensor t) {
    count.all_reduce.add(t.numel(), t.element_size());
    seq.before(kSeqAllReduce, t.numel());
    std::vector<at::Tensor> ts{std::move(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;   // never AVG: gloo's AVG has been wrong
    return launch([&] { return (*pg_)->allreduce(ts, o); });
}

void Communicator::all_reduce_sum_blocking(at::Tensor t, const char *what) {
    seq.subject(-1, -1);
    watch(all_reduce_sum(std::move(t)), what);
}

void Communicator::all_reduce_max_blocking(at::Tensor t, CommCounter &counter, const char *what) {
    counter.add(t.numel(), t.element_size());
    seq.subject(-1, -1);
    seq.before(kSeqAllReduce, t.numel());   // recorded like every collective (Note [Collective sequence check])
    std::vector<at::Tensor> ts{std::move(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    watch(launch([&] { return (*pg_)->allreduce(ts, o); }), what);
}

WorkPtr Communicator::reduce_scatter_sum(at::Tensor recv, at::Tensor send) {
    count.reduce_scatter.add(send.numel(), send.element_size());
    seq.before(kSeqReduceScatter, send.numel());
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return launch([&] { return (*pg_)->_reduce_scatter_base(recv, send, o); });
}

WorkPtr Communicator::all_to_all(at::Tensor recv, at::Tensor send, int64_t logical_numel, int64_t logical_elem) {
    // Counted as the reduce-scatter it implements.
    count.reduce_scatter.add(logical_numel, logical_elem > 0 ? logical_elem : send.element_size(),
                             logical_numel * send.element_size());
    seq.before(kSeqReduceScatter, logical_numel);
    std::vector<int64_t> splits;   // empty: equal splits
    return launch([&] { return (*pg_)->alltoall_base(recv, send, splits, splits); });
}

std::pair<WorkPtr, WorkPtr> Communicator::all_to_all_quantized(at::Tensor codes_recv, at::Tensor codes_send,
                                                             at::Tensor scales_recv, at::Tensor scales_send,
                                                             int64_t logical_numel, int64_t logical_elem) {
    count.reduce_scatter.add(logical_numel, logical_elem, codes_send.nbytes() + scales_send.nbytes());
    seq.before(kSeqReduceScatter, logical_numel);
    std::vector<int64_t> splits;   // empty: equal splits
    WorkPtr scales = launch([&] { return (*pg_)->alltoall_base(scales_recv, scales_send, splits, splits); });
    WorkPtr codes = launch([&] { return (*pg_)->alltoall_base(codes_recv, codes_send, splits, splits); });
    return {scales, codes};
}

WorkPtr Communicator::all_gather(at::Tensor out, at::Tensor in) {
    count.all_gather.add(out.numel(), out.element_size());
    seq.before(kSeqAllGather, out.numel());
    return launch([&] { return (*pg_)->_allgather_base(out, in); });
}

WorkPtr Communicator::all_gather_quantized(at::Tensor recv, at::Tensor send, int64_t logical_numel,
                                           int64_t logical_elem) {
    count.all_gather.add(logical_numel, logical_elem, recv.nbytes());
    seq.before(kSeqAllGather, logical_numel);
    return launch([&] { return (*pg_)->_allgather_base(recv, send); });
}

void Communicator::broadcast(at::Tensor t, int64_t src) {
    if (world_ == 1) return;
    count.broadcast.add(t.numel(), t.element_size());
    seq.before(kSeqBroadcast, t.numel());
    std::vector<at::Tensor> one{std::move(t)};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    watch(launch([&] { return (*pg_)->broadcast(one, o); }), "broadcast");
}

}  // namespace zx
