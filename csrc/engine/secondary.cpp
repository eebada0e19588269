// secondary.cpp — see secondary.h (Note [Hierarchical partitioning]).

#include <algorithm>

#include "engine/secondary.h"

namespace zx {

Secondary::Secondary(ProcessGroupPtr node_pg, int64_t world) : node_comm_(node_pg), world_(world) {
    TORCH_CHECK(world_ % node_comm_.world() == 0, "zero_ext: node_size ", node_comm_.world(),
                " does not divide the world size ", world_, "; pass a node_size that divides it (the ranks per "
                "node), or node_size=None");
}

void Secondary::keep(int64_t s, const at::Tensor &flat) {
    const int64_t part = flat.numel() / node_comm_.world();
    TORCH_CHECK(part * node_comm_.world() == flat.numel(), "zero_ext: internal: bucket of ", flat.numel(),
                " elements does not split into ", node_comm_.world(), " node parts");
    drop(s);
    at::Tensor t = flat.narrow(0, node_comm_.rank() * part, part).clone();
    bytes_ += t.nbytes();
    peak_bytes_ = std::max(peak_bytes_, bytes_);
    node_parts_[s] = std::move(t);
}

WorkPtr Secondary::launch(int64_t s, at::Tensor flat) {
    auto it = node_parts_.find(s);
    TORCH_CHECK(it != node_parts_.end(), "zero_ext: internal: no secondary part for bucket ", s);
    at::Tensor part = it->second;
    node_parts_.erase(it);
    inflight_[s] = part;
    node_comm_.seq.subject(s, -1);
    return node_comm_.all_gather(std::move(flat), part);
}

void Secondary::finish(int64_t s) {
    auto it = inflight_.find(s);
    if (it == inflight_.end()) return;
    bytes_ -= it->second.nbytes();
    inflight_.erase(it);
}

void Secondary::drop(int64_t s) {
    auto it = node_parts_.find(s);
    if (it == node_parts_.end()) return;
    bytes_ -= it->second.nbytes();
    node_parts_.erase(it);
}

void Secondary::drop_all() {
    for (auto &kv : node_parts_) bytes_ -= kv.second.nbytes();
    node_parts_.clear();
}

// A counter's share exchanged with other nodes: num/den of its bytes (rounded down).
static CommCounter share(const CommCounter &c, int64_t num, int64_t den) {
    CommCounter out;
    out.calls = c.calls;
    out.numel = c.numel * num / den;
    out.bytes = c.bytes * num / den;
    out.wire_bytes = c.wire_bytes * num / den;
    return out;
}

static CommCounter minus(const CommCounter &a, const CommCounter &b) {
    CommCounter out;
    out.calls = a.calls;
    out.numel = a.numel - b.numel;
    out.bytes = a.bytes - b.bytes;
    out.wire_bytes = a.wire_bytes - b.wire_bytes;
    return out;
}

CommGroupStats Secondary::group_stats(const Communicator &w) const {
    const int64_t L = node_comm_.world(), N = world_;
    const CommStats &all = w.count;
    CommGroupStats g;
    for (CommCounter CommStats::*kind : kCommKinds) {
        g.inter.*kind = share(all.*kind, N - L, N);
        g.intra.*kind = minus(all.*kind, g.inter.*kind);
    }
    g.node_all_gather = node_comm_.count.all_gather;   // the backward gathers, all intra
    g.node_size = L;
    return g;
}

}  // namespace zx
