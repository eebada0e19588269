// plan_binding.cpp — the C planner (core/zx_plan.c) callable from Python without
// an Engine, so that zero_ext.estimate_memory pads buckets exactly as a run
// would. The order and caps mirror the Engine constructor (engine.cpp: "Plan:").
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "kernels_binding.h"   // defines: zx_check

namespace {

// (group, unit, numel, padded_numel, slice_numel) per bucket, in bucket order.
using BucketRow = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<BucketRow> plan_layout(const std::vector<int64_t> &numel, const std::vector<int64_t> &groups,
                                   const std::vector<int64_t> &units, int64_t stage, int64_t partitions,
                                   int64_t bucket_bytes, int64_t first_bucket_bytes, int64_t align,
                                   int64_t param_dtype) {
    const int64_t n = (int64_t)numel.size();
    TORCH_CHECK(n > 0, "zero_ext: plan_layout needs at least one parameter");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: plan_layout: one group per parameter expected");
    TORCH_CHECK(stage >= 0 && stage <= 3, "zero_ext: stage must be 0-3, got ", stage);
    TORCH_CHECK(param_dtype >= ZX_F32 && param_dtype <= ZX_F16, "zero_ext: bad param dtype ", param_dtype);
    const bool s3 = stage == 3;
    TORCH_CHECK(!s3 || (int64_t)units.size() == n, "zero_ext: plan_layout: stage 3 needs one unit per parameter");
    std::vector<int64_t> order(n);
    std::vector<int32_t> dtype(n, (int32_t)param_dtype), group(n), unit(n, 0);
    for (int64_t i = 0; i < n; i++) {
        group[i] = (int32_t)groups[i];
        order[i] = n - 1 - i;
        if (s3) unit[i] = (int32_t)units[i];
    }
    if (s3) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return unit[a] > unit[b]; });
    const int64_t cap = s3 ? INT64_MAX / 4 : bucket_bytes;
    const int64_t first_cap = s3 ? INT64_MAX / 4 : first_bucket_bytes;
    zx_plan_params pp{(size_t)n, numel.data(), dtype.data(), group.data(), s3 ? unit.data() : nullptr,
                      order.data(), (int32_t)partitions, cap, first_cap, align};
    zx_plan *plan = nullptr;
    zx_check(zx_plan_create(&pp, &plan), "planning the bucket layout");
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

}  // namespace

void zx_bind_plan(pybind11::module_ &m) {
    m.def("plan_layout", &plan_layout, py::arg("numel"), py::arg("groups"), py::arg("units"), py::arg("stage"),
          py::arg("partitions"), py::arg("bucket_bytes"), py::arg("first_bucket_bytes"), py::arg("align"),
          py::arg("param_dtype"),
          "The planner's buckets for parameters of these sizes, as the engine would lay them out: "
          "[(group, unit, numel, padded_numel, slice_numel)] in bucket order. param_dtype: 0 fp32, "
          "1 bf16, 2 fp16 (bucket caps are in bytes of it); partitions: 1 in stage 0, else the world size.");
}
