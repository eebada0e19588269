// plan_binding.cpp — the planner callable from Python without an Engine, through the
// engine's own Layout::make (csrc/engine/layout.cpp), so that zero_ext.estimate_memory pads
// buckets exactly as a run would and the fill balance is the one the engine gets: no process
// group and no tensors, the rank and world size are numbers.
#include <torch/extension.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "engine/check.h"    // defines: zx_check, plan_fragments
#include "engine/layout.h"   // defines: Layout

namespace {

// The options and shapes Layout::make needs, from the planner's arguments (shapes: one per
// parameter, as the engine reads them: rows x cols, or numel alone).
zx::Layout make_layout(std::vector<std::vector<int64_t>> shapes, const std::vector<int64_t> &groups,
                       const std::vector<int64_t> &units, int64_t stage, int64_t partitions, int64_t bucket_bytes,
                       int64_t first_bucket_bytes, int64_t align, int64_t param_dtype,
                       std::vector<int64_t> group_update_kind = {}, std::vector<double> param_state = {},
                       int64_t param_align_bytes = zx::EngineOptions().param_align_bytes) {
    const int64_t n = (int64_t)shapes.size();
    TORCH_CHECK(n > 0, "zero_ext: internal: plan_layout needs at least one parameter");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: internal: plan_layout: one group per parameter expected");
    TORCH_CHECK(stage >= 0 && stage <= 3, "zero_ext: internal: stage must be 0-3, got ", stage);
    TORCH_CHECK(param_dtype >= ZX_F32 && param_dtype <= ZX_F16, "zero_ext: internal: bad param dtype ", param_dtype);
    TORCH_CHECK(stage != 3 || (int64_t)units.size() == n,
                "zero_ext: internal: plan_layout: stage 3 needs one unit per parameter");
    zx::EngineOptions opts;
    opts.stage = stage;
    opts.bucket_bytes = bucket_bytes;
    opts.first_bucket_bytes = first_bucket_bytes;
    opts.align = align;
    opts.param_align_bytes = param_align_bytes;
    opts.param_dtype = param_dtype == ZX_F32 ? "fp32" : param_dtype == ZX_BF16 ? "bf16" : "fp16";
    opts.group_update_kind = std::move(group_update_kind);
    opts.param_state = std::move(param_state);
    // the world is the partitions (stage 0 has one whatever the world size)
    return zx::Layout::make(opts, at::kCPU, std::move(shapes), groups, units, 0, partitions);
}

// (group, unit, numel, padded_numel, slice_numel) per bucket, in bucket order.
using BucketRow = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<BucketRow> plan_layout(const std::vector<int64_t> &numel, const std::vector<int64_t> &groups,
                                   const std::vector<int64_t> &units, int64_t stage, int64_t partitions,
                                   int64_t bucket_bytes, int64_t first_bucket_bytes, int64_t align,
                                   int64_t param_dtype, int64_t param_align_bytes) {
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t k : numel) shapes.push_back({k});
    const zx::Layout layout = make_layout(std::move(shapes), groups, units, stage, partitions, bucket_bytes,
                                          first_bucket_bytes, align, param_dtype, {}, {}, param_align_bytes);
    std::vector<BucketRow> rows;
    const int64_t nb = zx_plan_num_buckets(layout.plan);
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_check(zx_plan_bucket(layout.plan, b, &bi), "reading the plan");
        rows.emplace_back(bi.group, bi.unit, bi.numel, bi.padded_numel, bi.slice_numel);
    }
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
    TORCH_CHECK(cols.size() == n && kinds.size() == n && state.size() == n && groups.size() == n,
                "zero_ext: internal: plan_balance: rows, cols, kinds, state and groups need one entry per parameter");
    // The engine takes the update kind per param group: one optimizer per group.
    std::vector<int64_t> group_kind;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t i = 0; i < n; i++) {
        const size_t g = (size_t)groups[i];
        if (group_kind.size() <= g) group_kind.resize(g + 1, -1);
        TORCH_CHECK(group_kind[g] < 0 || group_kind[g] == kinds[i],
                    "zero_ext: internal: plan_balance: param group ", g, " mixes update kinds");
        group_kind[g] = kinds[i];
        shapes.push_back({rows[i], cols[i]});
    }
    for (int64_t &k : group_kind) k = std::max<int64_t>(k, 0);
    // fill: the state per element lets element-granular parameters fill the atomic buckets'
    // padding, as the engine does in stages 1-2; without it, today's layout, its state counted below
    const zx::Layout layout = make_layout(std::move(shapes), groups, units, stage, partitions, bucket_bytes,
                                          first_bucket_bytes, align, param_dtype, group_kind,
                                          fill ? state : std::vector<double>{});
    zx_plan *plan = layout.plan;
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
            for (int64_t b = 0; b < zx_plan_num_buckets(plan); b++) {
                for (const auto &f : plan_fragments(plan, b, (int32_t)r)) {
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
    return d;
}

}  // namespace

void zx_bind_plan(pybind11::module_ &m) {
    // zx_update_kind (core/zx_core.h): what one tensor's update costs (zero_ext/whole.py)
    m.attr("UPDATE_FACTORED") = py::int_((int)ZX_UPDATE_FACTORED);
    m.attr("UPDATE_ORTHOGONALIZED") = py::int_((int)ZX_UPDATE_ORTHOGONALIZED);
    m.def("plan_layout", &plan_layout, py::arg("numel"), py::arg("groups"), py::arg("units"), py::arg("stage"),
          py::arg("partitions"), py::arg("bucket_bytes"), py::arg("first_bucket_bytes"), py::arg("align"),
          py::arg("param_dtype"), py::arg("param_align_bytes") = zx::EngineOptions().param_align_bytes,
          "The planner's buckets for parameters of these sizes, as the engine would lay them out: "
          "[(group, unit, numel, padded_numel, slice_numel)] in bucket order. param_dtype: 0 fp32, "
          "1 bf16, 2 fp16 (bucket caps are in bytes of it); partitions: 1 in stage 0, else the world size; "
          "param_align_bytes: each parameter's start (Note [Aligned pieces]; 0 packs them tight).");
    // Note [Aligned pieces]: the rule the engine's frozen buckets follow too (frozen.cpp)
    m.def("plan_alignments", [](int64_t align, int64_t param_dtype) {
              zx::EngineOptions opts;
              opts.align = align;
              const int64_t bytes = opts.piece_align_bytes();
              const int64_t piece = zx_plan_piece_align(bytes, (zx_dtype)param_dtype);
              const int64_t slice = zx_plan_slice_align(align, bytes);
              TORCH_CHECK(piece > 0 && slice > 0, "zero_ext: internal: no alignment for align ", align, ", dtype ",
                          param_dtype);
              return std::make_pair(piece, slice);
          }, py::arg("align"), py::arg("param_dtype"),
          "(piece_align, slice_align) in elements: every parameter starts at a multiple of piece_align inside "
          "its bucket, every slice is a multiple of slice_align (Note [Aligned pieces]).");
    m.def("plan_balance", &plan_balance, py::arg("rows"), py::arg("cols"), py::arg("kinds"), py::arg("state"),
          py::arg("groups"), py::arg("units"), py::arg("stage"), py::arg("partitions"), py::arg("bucket_bytes"),
          py::arg("first_bucket_bytes"), py::arg("align"), py::arg("param_dtype"), py::arg("fill"),
          "The planned per-rank balance of tensor-atomic parameters (kinds: zx_update_kind per parameter, "
          "0 = element-granular; state: optimizer state bytes per element): {state_per_rank, "
          "whole_state_per_rank, cost_per_rank, padding, atomic_padding, numel, fill_level}. fill: let "
          "element-granular parameters fill the atomic buckets' padding (Note [Filling atomic buckets]); "
          "without it the state is counted on the same layout the engine builds today.");
}
