// offload.cpp — Note [Optimizer offload] (offload.h): the two pinned rings, the
// copy stream and the worker thread that lands gradient slices on the host.
// Device-generic through c10's stream and event interface, so the same code
// builds with and without CUDA; on the CPU every copy is synchronous.
#include "engine/offload.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace zx {

Offload::Offload(at::Device dev, at::ScalarType rdt, int64_t down_numel, at::ScalarType pdt, int64_t up_numel,
                 int64_t num_buckets)
    : dev_(dev), async_(!dev.is_cpu()) {
    const auto pinned = [&](at::ScalarType dt) { return host(dt).pinned_memory(async_); };
    for (int64_t s = 0; s < kSlots; s++) {
        down_slots_.push_back(at::empty({std::max<int64_t>(down_numel, 1)}, pinned(rdt)));
        up_.slots.push_back(at::empty({std::max<int64_t>(up_numel, 1)}, pinned(pdt)));
    }
    down_busy_.assign(kSlots, 0);
    up_.done.resize(kSlots);
    bucket_ticket_.assign(num_buckets, -1);
    if (async_) copy_stream_ = c10::impl::VirtualGuardImpl(dev_.type()).getStreamFromGlobalPool(dev_, false);
    thread_ = std::thread([this] { worker(); });
}

Offload::~Offload() {
    {
        std::lock_guard<std::mutex> lock(landing_.mu);
        landing_.stop = true;
    }
    landing_.cv.notify_all();
    if (thread_.joinable()) thread_.join();   // the worker runs what is queued first
    try {
        for (auto &e : up_.done)
            if (e) e->synchronize();   // pinned slots outlive the copies reading them
    } catch (...) {
    }
}

c10::Stream Offload::current() const { return c10::impl::VirtualGuardImpl(dev_.type()).getStream(dev_); }

int64_t Offload::pinned_bytes() const {
    int64_t n = 0;
    for (const auto &t : down_slots_) n += t.nbytes();
    for (const auto &t : up_.slots) n += t.nbytes();
    return n;
}

void Offload::worker() {
    for (;;) {
        Job job;
        {
            std::unique_lock<std::mutex> lock(landing_.mu);
            landing_.cv.wait(lock, [&] { return landing_.stop || !landing_.jobs.empty(); });
            if (landing_.jobs.empty()) return;   // stopping, nothing left
            job = std::move(landing_.jobs.front());
            landing_.jobs.pop_front();
        }
        std::exception_ptr err;
        try {
            if (job.copied) job.copied->synchronize();   // this copy alone
            job.finish(job.view);
        } catch (...) {
            err = std::current_exception();
        }
        {
            std::lock_guard<std::mutex> lock(landing_.mu);
            if (err && !landing_.error) landing_.error = err;
            down_busy_[job.slot] = 0;
            landing_.finished = job.ticket + 1;   // jobs run in ticket order
        }
        landing_.cv.notify_all();
    }
}

void Offload::rethrow() {
    if (!landing_.error) return;
    std::exception_ptr e = landing_.error;
    landing_.error = nullptr;
    std::rethrow_exception(e);
}

void Offload::down(int64_t b, const at::Tensor &src, int64_t ring_slot,
                   std::function<void(const at::Tensor &)> finish) {
    TORCH_CHECK(src.numel() <= down_slots_[0].numel() && src.scalar_type() == down_slots_[0].scalar_type(),
                "zero_ext: internal: offload down copy of ", src.numel(), " ", src.scalar_type(),
                " elements exceeds its ring slot");
    int64_t s = -1;
    {
        std::unique_lock<std::mutex> lock(landing_.mu);
        landing_.cv.wait(lock, [&] {
            for (int64_t k = 0; k < kSlots; k++)
                if (!down_busy_[k]) return true;
            return false;
        });
        rethrow();
        for (int64_t k = 0; k < kSlots && s < 0; k++)
            if (!down_busy_[k]) s = k;
        down_busy_[s] = 1;
    }
    Job job;
    job.bucket = b;
    job.slot = s;
    job.view = down_slots_[s].narrow(0, 0, src.numel());
    job.finish = std::move(finish);
    if (async_) {
        // After what the device's stream holds now (the reduction), on the copy stream.
        c10::Event ready(dev_.type());
        ready.record(current());
        ready.block(*copy_stream_);
        {
            c10::StreamGuard on(*copy_stream_);
            job.view.copy_(src, /*non_blocking=*/true);
        }
        job.copied.emplace(dev_.type());
        job.copied->record(*copy_stream_);
        if (ring_slot >= 0) {
            if ((int64_t)reuse_.size() <= ring_slot) reuse_.resize(ring_slot + 1);
            reuse_[ring_slot].emplace(dev_.type());
            reuse_[ring_slot]->record(*copy_stream_);
        }
    } else {
        job.view.copy_(src);
    }
    down_traffic_.copies++;
    down_traffic_.bytes += src.nbytes();
    {
        std::lock_guard<std::mutex> lock(landing_.mu);
        job.ticket = landing_.issued++;
        bucket_ticket_[b] = job.ticket;
        landing_.jobs.push_back(std::move(job));
    }
    landing_.cv.notify_all();
}

void Offload::before_reuse(int64_t ring_slot) {
    if (ring_slot < (int64_t)reuse_.size() && reuse_[ring_slot]) {
        reuse_[ring_slot]->block(current());
        reuse_[ring_slot].reset();
    }
}

void Offload::wait_bucket(int64_t b) {
    std::unique_lock<std::mutex> lock(landing_.mu);
    const int64_t t = bucket_ticket_[b];
    landing_.cv.wait(lock, [&] { return landing_.finished > t; });
    rethrow();
}

void Offload::drain() {
    std::unique_lock<std::mutex> lock(landing_.mu);
    landing_.cv.wait(lock, [&] { return landing_.finished >= landing_.issued; });
    rethrow();
}

at::Tensor Offload::up_slot(int64_t n) {
    TORCH_CHECK(n <= up_.slots[0].numel(), "zero_ext: internal: offload up copy of ", n,
                " elements exceeds its ring slot");
    const int64_t s = up_.next;
    if (up_.done[s]) {
        up_.done[s]->synchronize();   // its last copy has read it
        up_.done[s].reset();
    }
    return up_.slots[s].narrow(0, 0, n);
}

void Offload::up(const at::Tensor &slot, const at::Tensor &dst) {
    const int64_t s = up_.next;
    up_.next = (up_.next + 1) % kSlots;
    up_.traffic.copies++;
    up_.traffic.bytes += slot.nbytes();
    if (!async_) {
        dst.copy_(slot);
        return;
    }
    // dst may still be read by work on the device's stream (the last backward).
    c10::Event ready(dev_.type());
    ready.record(current());
    ready.block(*copy_stream_);
    {
        c10::StreamGuard on(*copy_stream_);
        dst.copy_(slot, /*non_blocking=*/true);
    }
    up_.done[s].emplace(dev_.type());
    up_.done[s]->record(*copy_stream_);
    up_.done[s]->block(current());   // the parameter gather reads dst after this copy
}

}  // namespace zx
