// plan_binding.cpp — the C planner (core/zx_plan.c) callable from Python without
// an Engine, so that zero_ext.estimate_memory pads buckets exactly as a run
// would. The order and caps mirror the Engine constructor (engine.cpp: "Plan:").
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "engine/check.h"   // defines: zx_check

namespace {

// The planner's inputs as the Engine constructor builds them (engine.cpp: "Plan:").
struct PlanInputs {
    std::vector<int64_t> order;
    std::vector<int32_t> dtype, group, unit;
    zx_plan_params pp{};
};

void plan_inputs(PlanInputs &in, const std::vector<int64_t> &numel, const std::vector<int64_t> &groups,
                 const std::vector<int64_t> &units, int64_t stage, int64_t partitions, int64_t bucket_bytes,
                 int64_t first_bucket_bytes, int64_t align, int64_t param_dtype) {
    const int64_t n = (int64_t)numel.size();
    TORCH_CHECK(n > 0, "zero_ext: internal: plan_layout needs at least one parameter");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: internal: plan_layout: one group per parameter expected");
    TORCH_CHECK(stage >= 0 && stage <= 3, "zero_ext: internal: stage must be 0-3, got ", stage);
    TORCH_CHECK(param_dtype >= ZX_F32 && param_dtype <= ZX_F16, "zero_ext: internal: bad param dtype ", param_dtype);
    const bool s3 = stage == 3;
    TORCH_CHECK(!s3 || (int64_t)units.size() == n,
                "zero_ext: internal: plan_layout: stage 3 needs one unit per parameter");
    in.order.resize(n);
    in.dtype.assign(n, (int32_t)param_dtype);
    in.group.resize(n);
    in.unit.assign(n, 0);
    for (int64_t i = 0; i < n; i++) {
        in.group[i] = (int32_t)groups[i];
        in.order[i] = n - 1 - i;
        if (s3) in.unit[i] = (int32_t)units[i];
    }
    auto &unit = in.unit;
    if (s3) std::stable_sort(in.order.begin(), in.order.end(), [&](int64_t a, int64_t b) { return unit[a] > unit[b]; });
    const int64_t cap = s3 ? INT64_MAX / 4 : bucket_bytes;
    const int64_t first_cap = s3 ? INT64_MAX / 4 : first_bucket_bytes;
    in.pp = zx_plan_params{(size_t)n, numel.data(), in.dtype.data(), in.group.data(), s3 ? in.unit.data() : nullptr,
                           in.order.data(), (int32_t)partitions, cap, first_cap, align, nullptr, nullptr};
}

// (group, unit, numel, padded_numel, slice_numel) per bucket, in bucket order.
using BucketRow = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<BucketRow> plan_layout(const std::vector<int64_t> &numel, const std::vector<int64_t> &groups,
                                   const std::vector<int64_t> &units, int64_t stage, int64_t partitions,
                                   int64_t bucket_bytes, int64_t first_bucket_bytes, int64_t align,
                                   int64_t param_dtype) {
    PlanInputs in;
    plan_inputs(in, numel, groups, units, stage, partitions, bucket_bytes, first_bucket_bytes, align, param_dtype);
    zx_plan *plan = nullptr;
    zx_check(zx_plan_create(&in.pp, &plan), "planning the bucket layout");
    std::vector<BucketRow> rows;
    const int64_t nb = zx_plan_num_buckets(plan);
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_status st = zx_plan_bucket(plan, b, &bi);
        if (st != ZX_OK) {
            zx_plan_free(plan);
            zx_check(st, "reading the plan");
        }
        rows.emplace_back(bi.group, bi.unit, bi.numel, bi.padded_numel, bi.slice_numel);
    }
    zx_plan_free(plan);
    return rows;
}

// Note [Filling atomic buckets] (core/zx_core.h): the planned per-rank balance
// of tensor-atomic parameters (rows x cols, update kind per parameter) with and
// without element-granular parameters filling their padding.
py::dict plan_balance(const std::vector<int64_t> &rows, const std::vector<int64_t> &cols,
                      const std::vector<int64_t> &kinds, const std::vector<double> &state,
                      const std::vector<int64_t> &groups, const std::vector<int64_t> &units, int64_t stage,
                      int64_t partitions, int64_t bucket_bytes, int64_t first_bucket_bytes, int64_t align,
                      int64_t param_dtype, bool fill) {
    const size_t n = rows.size();
    TORCH_CHECK(cols.size() == n && kinds.size() == n && state.size() == n,
                "zero_ext: internal: plan_balance: rows, cols, kinds and state need one entry per parameter");
    std::vector<int64_t> numel(n);
    std::vector<double> cost(n, 0.0);
    bool any_atomic = false;
    for (size_t i = 0; i < n; i++) {
        numel[i] = rows[i] * cols[i];
        if (kinds[i] != 0) {
            cost[i] = zx_update_cost((zx_update_kind)kinds[i], rows[i], cols[i]);
            TORCH_CHECK(cost[i] > 0, "zero_ext: internal: plan_balance: unknown update kind ", kinds[i]);
            any_atomic = true;
        }
    }
    PlanInputs in;
    plan_inputs(in, numel, groups, units, stage, partitions, bucket_bytes, first_bucket_bytes, align, param_dtype);
    in.pp.cost = any_atomic ? cost.data() : nullptr;
    in.pp.state = fill ? state.data() : nullptr;   // no fill: today's layout, its state counted below
    zx_plan *plan = nullptr;
    zx_check(zx_plan_create(&in.pp, &plan), "planning the bucket layout");
    py::list state_per_rank, whole_per_rank, cost_per_rank;
    int64_t padding = 0, atomic_padding = 0, total = 0;
    for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
        zx_bucket_info bi;
        zx_plan_bucket(plan, b, &bi);
        padding += bi.padded_numel - bi.numel;
        if (bi.atomic) atomic_padding += bi.padded_numel - bi.numel;
        total += bi.numel;
    }
    for (int64_t r = 0; r < partitions; r++) {
        double s = 0.0, w = 0.0, c = 0.0;
        int64_t m = 0;
        zx_plan_rank_state(plan, (int32_t)r, &s, &w);
        if (!fill) {
            std::vector<zx_fragment> fr;
            for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
                int64_t count = 0;
                zx_plan_fragments(plan, b, (int32_t)r, nullptr, 0, &count);
                fr.resize((size_t)count);
                zx_plan_fragments(plan, b, (int32_t)r, fr.data(), count, &count);
                for (const auto &f : fr) {
                    s += (double)f.numel * state[f.param];
                    if (kinds[f.param] != 0) w += (double)f.numel * state[f.param];
                }
            }
        }
        zx_plan_rank_load(plan, (int32_t)r, &c, &m);
        state_per_rank.append(s);
        whole_per_rank.append(w);
        cost_per_rank.append(c);
    }
    py::dict d;
    d["state_per_rank"] = state_per_rank;
    d["whole_state_per_rank"] = whole_per_rank;
    d["cost_per_rank"] = cost_per_rank;
    d["padding"] = padding;
    d["atomic_padding"] = atomic_padding;
    d["numel"] = total;
    d["fill_level"] = zx_plan_fill_level(plan);
    zx_plan_free(plan);
    return d;
}

}  // namespace

void zx_bind_plan(pybind11::module_ &m) {
    m.def("plan_layout", &plan_layout, py::arg("numel"), py::arg("groups"), py::arg("units"), py::arg("stage"),
          py::arg("partitions"), py::arg("bucket_bytes"), py::arg("first_bucket_bytes"), py::arg("align"),
          py::arg("param_dtype"),
          "The planner's buckets for parameters of these sizes, as the engine would lay them out: "
          "[(group, unit, numel, padded_numel, slice_numel)] in bucket order. param_dtype: 0 fp32, "
          "1 bf16, 2 fp16 (bucket caps are in bytes of it); partitions: 1 in stage 0, else the world size.");
    m.def("plan_balance", &plan_balance, py::arg("rows"), py::arg("cols"), py::arg("kinds"), py::arg("state"),
          py::arg("groups"), py::arg("units"), py::arg("stage"), py::arg("partitions"), py::arg("bucket_bytes"),
          py::arg("first_bucket_bytes"), py::arg("align"), py::arg("param_dtype"), py::arg("fill"),
          "The planned per-rank balance of tensor-atomic parameters (kinds: zx_update_kind per parameter, "
          "0 = element-granular; state: optimizer state bytes per element): {state_per_rank, "
          "whole_state_per_rank, cost_per_rank, padding, atomic_padding, numel, fill_level}. fill: let "
          "element-granular parameters fill the atomic buckets' padding (Note [Filling atomic buckets]); "
          "without it the state is counted on the same layout the engine builds today.");
}
