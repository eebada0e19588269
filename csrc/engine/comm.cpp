// comm.cpp — see comm.h.
#include "engine/comm.h"

// Note [Collective entry points]
//   _allgather_base, _reduce_scatter_base and alltoall_base are deprecated in
//   torch 2.13 in favour of *_single, which torch 2.11 (the GPU machine) lacks;
//   the old names exist in both, so we keep them and silence the warning.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace zx {

Communicator::Communicator(c10::optional<ProcessGroupPtr> pg) : pg_(std::move(pg)) {
    if (pg_.has_value()) {
        rank_ = (*pg_)->getRank();
        world_ = (*pg_)->getSize();
    }
    seq.attach(pg_, rank_, world_);
}

py::dict counter_dict(const CommCounter &c) {
    py::dict d;
    d["calls"] = c.calls;
    d["numel"] = c.numel;
    d["bytes"] = c.bytes;
    d["wire_bytes"] = c.wire_bytes;
    return d;
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

WorkPtr Communicator::all_reduce_sum(at::Tensor t) {
    c_all_reduce.add(t.numel(), t.element_size());
    seq.before(kSeqAllReduce, t.numel());
    std::vector<at::Tensor> ts{std::move(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;   // never AVG: gloo's AVG has been wrong
    return (*pg_)->allreduce(ts, o);
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
    watch((*pg_)->allreduce(ts, o), what);
}

WorkPtr Communicator::reduce_scatter_sum(at::Tensor recv, at::Tensor send) {
    c_reduce_scatter.add(send.numel(), send.element_size());
    seq.before(kSeqReduceScatter, send.numel());
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return (*pg_)->_reduce_scatter_base(recv, send, o);
}

WorkPtr Communicator::all_to_all(at::Tensor recv, at::Tensor send, int64_t logical_numel) {
    // Counted as the reduce-scatter it implements.
    c_reduce_scatter.add(logical_numel, send.element_size());
    seq.before(kSeqReduceScatter, logical_numel);
    std::vector<int64_t> splits;   // empty: equal splits
    return (*pg_)->alltoall_base(recv, send, splits, splits);
}

std::pair<WorkPtr, WorkPtr> Communicator::all_to_all_quantized(at::Tensor codes_recv, at::Tensor codes_send,
                                                             at::Tensor scales_recv, at::Tensor scales_send,
                                                             int64_t logical_numel, int64_t logical_elem) {
    c_reduce_scatter.add(logical_numel, logical_elem, codes_send.nbytes() + scales_send.nbytes());
    seq.before(kSeqReduceScatter, logical_numel);
    std::vector<int64_t> splits;   // empty: equal splits
    WorkPtr scales = (*pg_)->alltoall_base(scales_recv, scales_send, splits, splits);
    WorkPtr codes = (*pg_)->alltoall_base(codes_recv, codes_send, splits, splits);
    return {scales, codes};
}

WorkPtr Communicator::all_gather(at::Tensor out, at::Tensor in) {
    c_all_gather.add(out.numel(), out.element_size());
    seq.before(kSeqAllGather, out.numel());
    return (*pg_)->_allgather_base(out, in);
}

WorkPtr Communicator::all_gather_quantized(at::Tensor recv, at::Tensor send, int64_t logical_numel,
                                           int64_t logical_elem) {
    c_all_gather.add(logical_numel, logical_elem, recv.nbytes());
    seq.before(kSeqAllGather, logical_numel);
    return (*pg_)->_allgather_base(recv, send);
}

void Communicator::broadcast(at::Tensor t, int64_t src) {
    if (world_ == 1) return;
    c_broadcast.add(t.numel(), t.element_size());
    seq.before(kSeqBroadcast, t.numel());
    std::vector<at::Tensor> one{std::move(t)};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    watch((*pg_)->broadcast(one, o), "broadcast");
}

}  // namespace zx
