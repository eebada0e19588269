// reduce_groups.h — stage 3: the gradients of several small buckets reduced by one
// collective (Note [Coalesced gradient reductions] in reducer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace zx {

// A run of consecutive buckets whose gradients one reduce-scatter (or all-to-all) sums.
struct ReduceGroup {
    std::vector<int64_t> members;   // bucket indices, in launch order
    int64_t numel = 0;              // sum of their slices: this rank's part of the group
    int64_t unit = -1;              // the first member's unit: the sequence check names the group by it
    at::Tensor rows;                // filling: (parts, capacity); row r holds every member's slice r
    at::Tensor send, recv;          // in flight: (parts * numel,) rank-major; what the collective left
};

class ReduceGroups {
public:
    // capacity: elements per rank row (0: off); parts: the partitions of a bucket
    void configure(int64_t capacity, int64_t parts, at::TensorOptions options) {
        capacity_ = capacity;
        partitions_ = parts;
        options_ = options;
    }
    bool enabled() const { return capacity_ > 0; }
    // a bucket whose slice is this small joins a group; a larger one is reduced alone
    bool coalesces(int64_t slice) const { return enabled() && slice < capacity_; }
    bool fits(int64_t slice) const { return filling_.numel + slice <= capacity_; }
    bool filling() const { return !filling_.members.empty(); }

    // Bucket b's gradient (parts * slice,) joins the group being filled; unit: b's unit.
    void add(int64_t b, int64_t unit, const at::Tensor &padded, int64_t slice) {
        if (!filling_.rows.defined()) filling_.rows = at::empty({partitions_, capacity_}, options_);
        if (filling_.members.empty()) filling_.unit = unit;
        filling_.rows.narrow(1, filling_.numel, slice).copy_(padded.view({partitions_, slice}));
        filling_.members.push_back(b);
        filling_.numel += slice;
    }

    // The group being filled, closed: its send buffer laid out rank-major.
    ReduceGroup close() {
        ReduceGroup g = std::move(filling_);
        filling_ = ReduceGroup();
        g.send = g.rows.narrow(1, 0, g.numel).contiguous().view({-1});
        g.rows = at::Tensor();
        return g;
    }

    void drop_filling() { filling_ = ReduceGroup(); }   // zero_grad: its sums are void

    // In flight, keyed by the last member (the bucket the reducer's queue names).
    void fly(ReduceGroup g) {
        const int64_t last = g.members.back();
        flying_.emplace(last, std::move(g));
    }
    bool flying(int64_t last) const { return flying_.count(last) > 0; }
    ReduceGroup land(int64_t last) {
        auto it = flying_.find(last);
        ReduceGroup g = std::move(it->second);
        flying_.erase(it);
        return g;
    }

private:
    int64_t capacity_ = 0, partitions_ = 1;
    at::TensorOptions options_;
    ReduceGroup filling_;
    std::map<int64_t, ReduceGroup> flying_;
};

}  // namespace zx
