// layout.cpp — Layout (layout.h), decided once from the parameters' shapes and the options:
// the dtypes, the C plan (buckets, slices, pieces, fragments), this rank's place, where each
// parameter lies; no tensors and no process group (the rank and world size are numbers).
// The engine turns it into tensors (build.cpp).
#include "engine/layout.h"

#include <algorithm>

#include "engine/check.h"   // defines: zx_check, plan_fragments, plan_pieces

namespace zx {

// Note [Mixed precision]
//   param_dtype (layout_.dtypes.param) is what parameters compute in and are all-gathered as;
//   reduce_dtype (layout_.dtypes.reduce) what gradients accumulate and are reduced in; master
//   weights and optimizer states are always fp32 over this rank's shard.
//   With layout_.dtypes.param = fp32 the owned slice of a stage 0-2 bucket *is* the master; else
//   shard_.master holds it and the fused step writes the low-precision copy in
//   the same pass straight into what is gathered next: the owned slice of the
//   bucket (stages 0-2; the all-gather runs in place). Stage 3 keeps no
//   low-precision shard: each gather casts the master into place (Note [Stage 3
//   parameter lifetime] in units.cpp).
//   Autograd produces gradients in layout_.dtypes.param. When layout_.dtypes.reduce ==
//   layout_.dtypes.param stage 0/1 gradients are views of flat_grad as in fp32;
//   otherwise the hook adds each gradient
//   into the reduce_dtype bucket and drops it, so accumulation over micro-steps
//   happens in reduce_dtype, never silently in bf16. Stage 2/3 cast into the
//   ring as they stage. Kernels read fp32 gradients: low-precision ones are
//   converted in small cache-resident chunks (with_f32_grads).
//   Memory per element: stage 3 = 4 (master) + |rdt| + 8 over N (16Ψ/N with an
//   fp32 reduce, FSDP2's; 14Ψ/N with a bf16 one); with rdt = pdt = bf16 stages 0-2
//   match the ZeRO paper's mixed-precision formulas (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N);
//   fp32 reduce adds 2 bytes per gradient element (6Ψ+12Ψ/N, 2Ψ+16Ψ/N).

// Note [Parameter names in messages]
//   An error a user can cause names the parameter as the model does
//   ('blocks.0.attn.weight'), never by its engine index: zeroify passes the names
//   once (EngineOptions::param_names; add_frozen's names), and every message that
//   names a parameter goes through Layout::pname(i) / FrozenParams::name(i). The sequence check
//   reads the same names.

static std::pair<at::ScalarType, zx_dtype> parse_dtype(const std::string &name, const char *what) {
    if (name == "fp32") return {at::kFloat, ZX_F32};
    if (name == "bf16") return {at::kBFloat16, ZX_BF16};
    if (name == "fp16") return {at::kHalf, ZX_F16};
    TORCH_CHECK(false, "zero_ext: ", what, " must be 'fp32', 'bf16' or 'fp16', got '", name, "'; pass ", what,
                "='fp32', 'bf16' or 'fp16'");
    return {at::kFloat, ZX_F32};
}

Layout Layout::make(const EngineOptions &opts, at::Device dev, std::vector<std::vector<int64_t>> shapes,
                    const std::vector<int64_t> &groups, const std::vector<int64_t> &units, int64_t rank,
                    int64_t world) {
    Layout l;
    l.opts = opts;
    l.dev = dev;
    l.rank = rank;
    l.world = world;
    l.partitions = opts.stage == 0 ? 1 : world;
    std::tie(l.dtypes.param, l.dtypes.param_zx) = parse_dtype(opts.param_dtype, "param_dtype");
    std::tie(l.dtypes.reduce, l.dtypes.reduce_zx) = parse_dtype(opts.reduce_dtype, "reduce_dtype");
    l.shapes = std::move(shapes);
    const int64_t n = (int64_t)l.shapes.size();
    const bool s3 = opts.stage == 3;

    // Plan: reverse registration order, which is roughly gradient-ready order;
    // stage 3: units in reverse forward order, so buckets again follow backward.
    std::vector<int64_t> numel(n), order(n);
    std::vector<int32_t> dtype(n, l.dtypes.param_zx), group(n), unit(n, 0);
    std::vector<double> cost(n, 0.0);
    bool any_atomic = false;
    for (int64_t i = 0; i < n; i++) {
        const std::vector<int64_t> &shape = l.shapes[i];
        numel[i] = 1;
        for (int64_t d : shape) numel[i] *= d;
        const int64_t kind = groups[i] < (int64_t)opts.group_update_kind.size() ? opts.group_update_kind[groups[i]] : 0;
        if (kind != 0 && numel[i] > 0) {
            // Note [Tensor-atomic buckets]: rows = first dimension, cols = the rest.
            const int64_t rows = shape.empty() ? 1 : shape[0];
            cost[i] = zx_update_cost((zx_update_kind)kind, rows, numel[i] / std::max<int64_t>(rows, 1));
            TORCH_CHECK(cost[i] > 0, "zero_ext: internal: unknown update kind ", kind, " for param group ", groups[i]);
            any_atomic = true;
        }
        group[i] = (int32_t)groups[i];
        order[i] = n - 1 - i;
        if (s3) unit[i] = (int32_t)units[i];
    }
    if (s3) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return unit[a] > unit[b]; });
    // Stage 3: one bucket per (unit, group); the unit is the granularity.
    const int64_t cap = s3 ? INT64_MAX / 4 : opts.bucket_bytes;
    const int64_t first_cap = s3 ? INT64_MAX / 4 : opts.first_bucket_bytes;
    // Note [Cut parameters]: state per element, so element-granular pieces fill the padding.
    const bool fill = any_atomic && !opts.param_state.empty() && (opts.stage == 1 || opts.stage == 2);
    TORCH_CHECK(opts.param_state.empty() || (int64_t)opts.param_state.size() == n,
                "zero_ext: internal: one state size per parameter expected, got ", opts.param_state.size());
    zx_plan_params pp{(size_t)n, numel.data(), dtype.data(), group.data(), s3 ? unit.data() : nullptr,
                      order.data(), (int32_t)l.partitions, cap, first_cap, opts.align,
                      any_atomic ? cost.data() : nullptr, fill ? opts.param_state.data() : nullptr,
                      opts.piece_align_bytes()};
    zx_plan *plan = nullptr;
    zx_check(zx_plan_create(&pp, &plan), "planning the bucket layout");
    l.plan.owner.reset(plan, zx_plan_free);
    l.shard_numel = zx_plan_shard_numel(l.plan);
    l.group_of = groups;
    for (int64_t b = 0; b < zx_plan_num_buckets(l.plan); b++) {
        zx_bucket_info bi;
        zx_check(zx_plan_bucket(l.plan, b, &bi), "reading the plan");
        l.max_padded = std::max(l.max_padded, bi.padded_numel);
    }
    // Each parameter's bucket and offset there: its only piece's, or (Note [Cut parameters]) its first's.
    l.bucket_of.assign(n, -1);
    l.offset_of.assign(n, 0);
    for (int64_t i = 0; i < n; i++) {
        const std::vector<zx_piece> pieces = plan_pieces(l.plan, i);
        if (pieces.empty()) continue;
        l.bucket_of[i] = pieces[0].bucket;
        l.offset_of[i] = pieces[0].offset;
        if (pieces.size() == 1) {
            zx_param_loc loc;
            zx_check(zx_plan_param(l.plan, i, &loc), "reading the plan");
            l.offset_of[i] = loc.offset;
        }
    }
    return l;
}

std::vector<int64_t> Layout::owners() const {
    std::vector<int64_t> out(shapes.size());
    for (size_t i = 0; i < shapes.size(); i++) out[i] = zx_plan_owner(plan, (int64_t)i);
    return out;
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> Layout::fragments(int64_t r) const {
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
    int64_t b = 0;
    for (const auto &bucket : bucket_fragments(r)) {
        for (const auto &[i, poff, soff, n] : bucket)
            out.emplace_back(i, poff, zx_plan_shard_offset(plan, b) + soff, n);
        b++;
    }
    return out;
}

std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> Layout::bucket_fragments(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < std::max<int64_t>(partitions, 1), "zero_ext: internal: no rank ", r, " among ",
                partitions, " partitions");
    std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> out(zx_plan_num_buckets(plan));
    for (int64_t b = 0; b < (int64_t)out.size(); b++)
        for (const auto &f : plan_fragments(plan, b, (int32_t)r))
            out[b].emplace_back(f.param, f.param_offset, f.slice_offset, f.numel);
    return out;
}

std::string Layout::describe() const {
    size_t need = 0;
    zx_plan_describe(plan, nullptr, 0, &need);
    std::string s(need + 1, '\0');
    zx_check(zx_plan_describe(plan, s.data(), s.size(), &need), "describing the plan");
    s.resize(need);
    return s;
}

}  // namespace zx
