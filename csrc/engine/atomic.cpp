// atomic.cpp — tensor-atomic parameters (Note [Tensor-atomic buckets] in
// core/zx_core.h): optimizers such as Muon and Adafactor update a tensor from
// the whole tensor, so the planner gives each of their tensors whole to one rank
// inside equal bucket slices. Here: the owner's whole-tensor views for the torch
// optimizer that runs on them (Stepper::owned_tensors, for the groups of one wrapped
// optimizer), and the balance figures for stats() (AtomicStats::of).
#include "engine/check.h"      // defines: zx_check
#include "engine/layout.h"     // defines: Layout
#include "engine/params.h"     // defines: Params
#include "engine/stats.h"      // defines: AtomicStats
#include "engine/stepper.h"    // defines: Stepper

namespace zx {

std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> Stepper::owned_tensors(const Groups &groups) {
    std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> out;
    const Layout &layout = shard.layout;
    const int64_t r = layout.opts.stage == 0 ? 0 : layout.rank;
    for (auto &bk : buckets) {
        if (!bk.atomic || !groups.has(bk.group)) continue;
        at::Tensor master = shard.master(bk), grad = shard.grad(bk);
        for (int64_t i : bk.params) {
            if (zx_plan_owner(layout.plan, i) != r) continue;
            zx_param_loc loc;
            zx_check(zx_plan_param(layout.plan, i, &loc), "reading the plan");
            const int64_t at = loc.offset - r * bk.slice_numel, n = loc.numel;   // (stage 3 parameters may be empty now)
            const std::vector<int64_t> &shape = layout.shapes[i];
            out.emplace_back(i, master.narrow(0, at, n).view(shape), grad.narrow(0, at, n).view(shape));
        }
    }
    return out;
}

AtomicStats AtomicStats::of(const Layout &layout, const std::vector<Bucket> &buckets, const Params &params) {
    // Per rank: update cost and elements of its whole tensors; max/mean of each
    // (1.0 = perfect balance); the padding of the atomic buckets in elements.
    AtomicStats st;
    double cmax = 0.0, csum = 0.0;
    int64_t nmax = 0, nsum = 0;
    for (int64_t r = 0; r < layout.partitions; r++) {
        double c = 0.0;
        int64_t m = 0;
        zx_check(zx_plan_rank_load(layout.plan, (int32_t)r, &c, &m), "reading the plan");
        st.cost_per_rank.push_back(c);
        st.numel_per_rank.push_back(m);
        cmax = std::max(cmax, c);
        csum += c;
        nmax = std::max(nmax, m);
        nsum += m;
    }
    int64_t filled = 0;   // elements of element-granular pieces inside atomic buckets
    for (const auto &bk : buckets) {
        if (!bk.atomic) continue;
        st.buckets++;
        for (int64_t i : bk.params) {
            if (zx_plan_owner(layout.plan, i) >= 0) {
                st.tensors++;
                int64_t m = 1;   // (stage 3 parameters may be empty now: the logical shape)
                for (int64_t d : layout.shapes[i]) m *= d;
                st.numel += m;
            }
        }
        st.padding += bk.padded_numel - bk.numel;
        filled += bk.numel;
    }
    // Planned optimizer state per rank (zx_plan_rank_state; 0 unless the
    // optimizers' state sizes were given: Note [Filling atomic buckets]).
    double smax = 0.0, ssum = 0.0;
    for (int64_t r = 0; r < layout.partitions; r++) {
        double bytes = 0.0, whole = 0.0;
        zx_check(zx_plan_rank_state(layout.plan, (int32_t)r, &bytes, &whole), "reading the plan");
        st.state_bytes_per_rank.push_back(bytes);
        smax = std::max(smax, bytes);
        ssum += bytes;
    }
    st.cost_balance = csum > 0 ? cmax / (csum / (double)layout.partitions) : 1.0;
    st.numel_balance = nsum > 0 ? (double)nmax / ((double)nsum / (double)layout.partitions) : 1.0;
    st.filled_numel = filled - st.numel;   // pieces of element-granular parameters in the padding
    st.state_balance = ssum > 0 ? smax / (ssum / (double)layout.partitions) : 1.0;
    st.cut_params = (int64_t)params.cut_list().size();   // Note [Cut parameters]
    return st;
}

}  // namespace zx
