// frozen.cpp — stage 3: parameters that are not trained (requires_grad=False,
// e.g. the base model under LoRA) sharded like trainable ones.
#include "engine/unit_store.h"

namespace zx {

// Note [Stage 3 frozen parameters]
//   add_frozen() gives each unit one more bucket (Bucket::frozen) holding that
//   unit's frozen parameters, in param_dtype, outside the plan: no gradient, no
//   ring slot, no master, no optimizer state, nothing the reducer or the steps
//   visit. Its padded size is a multiple of partitions * zx_plan_slice_align; this rank's
//   slice lives in FrozenParams' shard (param_dtype), the only persistent copy. The
//   bucket is gathered and released with its unit (gather_unit and gather_units
//   take it through UnitStore::members; release_unit, commit_unit and
//   open_unit_fp32 call the *_frozen functions below), its storage
//   resized as a trainable bucket's (Note [Stage 3 parameter lifetime]). In
//   backward a trainable bucket is released when its last gradient is staged;
//   that says nothing about the frozen weights the unit's backward still reads
//   (a frozen linear's input gradient), so Python releases the frozen bucket
//   when the gradients of the unit's inputs are complete (release_frozen), and
//   finalize_backward releases whatever is left. Layout: parameters in the
//   order given, each at its next aligned element (Note [Aligned pieces],
//   core/zx_core.h); frozen_fragments(r) says where rank r's slice holds
//   which piece, as fragments() does for trainable parameters. The state is
//   FrozenParams' (frozen_params.h); the engine drives the collectives.

// ---- FrozenParams: the layout and the parameters' views ----

void FrozenParams::plan(std::vector<at::Tensor> params, const std::vector<int64_t> &units,
                        std::vector<std::string> names, int64_t unit_count, int64_t parts, int64_t quantum,
                        int64_t piece_align, const at::TensorOptions &options) {
    names_ = std::move(names);
    params_ = std::move(params);
    const int64_t n = (int64_t)params_.size();
    views_.assign(n, at::Tensor());
    offset_.assign(n, 0);
    of_unit_.assign(unit_count, -1);
    for (int64_t i = 0; i < n; i++) {
        const int64_t u = units[i];
        if (of_unit_[u] < 0) {
            of_unit_[u] = (int64_t)buckets_.size();
            buckets_.emplace_back();
            buckets_.back().frozen = true;
            buckets_.back().unit = u;
            buckets_.back().group = -1;
        }
        Bucket &bk = buckets_[of_unit_[u]];
        bk.params.push_back(i);
        // Note [Aligned pieces] (core/zx_core.h): numel runs to the parameter's end, gaps included
        offset_[i] = (bk.numel + piece_align - 1) / piece_align * piece_align;
        bk.gap_numel += offset_[i] - bk.numel;
        bk.numel = offset_[i] + params_[i].numel();
    }
    int64_t shard = 0;
    for (auto &bk : buckets_) {
        bk.numel -= bk.gap_numel;   // the parameters' elements, as a trainable bucket counts them
        bk.padded_numel = std::max<int64_t>(1, (bk.numel + bk.gap_numel + quantum - 1) / quantum) * quantum;
        bk.slice_numel = bk.padded_numel / parts;
        bk.shard_offset = shard;
        shard += bk.slice_numel;
    }
    shard_ = at::zeros({shard}, options);
}

std::string FrozenParams::name_in(const std::vector<std::string> &names, int64_t i) {
    if (i >= 0 && i < (int64_t)names.size()) return "frozen parameter '" + names[i] + "'";
    return "frozen parameter " + std::to_string(i);
}

Bucket *FrozenParams::of_unit(int64_t u) {
    return const_cast<Bucket *>(static_cast<const FrozenParams *>(this)->of_unit(u));
}

const Bucket *FrozenParams::of_unit(int64_t u) const {
    if (u < 0 || u >= (int64_t)of_unit_.size() || of_unit_[u] < 0) return nullptr;
    return &buckets_[of_unit_[u]];
}

void FrozenParams::point_at(const Bucket &bk, const at::Tensor &flat) {
    for (int64_t i : bk.params)
        params_[i].set_data(flat.narrow(0, offset_[i], views_[i].numel()).view(views_[i].sizes()));
}

void FrozenParams::point_home(const Bucket &bk) {
    for (int64_t i : bk.params) params_[i].set_data(views_[i]);
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> FrozenParams::fragments(int64_t r) const {
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
    for (const auto &bk : buckets_) {
        const int64_t lo = r * bk.slice_numel, hi = lo + bk.slice_numel;
        for (int64_t i : bk.params) {
            const int64_t a = std::max(lo, offset_[i]);
            const int64_t b = std::min(hi, offset_[i] + views_[(size_t)i].numel());
            if (a < b) out.emplace_back(i, a - offset_[i], bk.shard_offset + a - lo, b - a);
        }
    }
    return out;
}

std::vector<FragmentView> FrozenParams::fragment_views(int64_t r) const {
    std::vector<FragmentView> out;
    for (const auto &[i, poff, soff, n] : fragments(r))
        out.push_back({i, poff, -1, soff, n, shard_.narrow(0, soff, n)});
    return out;
}

// ---- UnitStore: checks, storage, collectives ----

void UnitStore::add_frozen(UnitWork w, std::vector<at::Tensor> params, std::vector<int64_t> units,
                           std::vector<std::string> names) {
    const Layout &layout = w.layout();
    TORCH_CHECK(layout.opts.stage == 3, "zero_ext: internal: frozen parameters are sharded in stage 3 only");
    TORCH_CHECK(frozen.empty(), "zero_ext: internal: add_frozen was already called on this engine");
    TORCH_CHECK(params.size() == units.size() && (names.empty() || names.size() == params.size()),
                "zero_ext: internal: add_frozen needs one unit id (and one name) per frozen parameter");
    if (params.empty()) return;
    for (size_t i = 0; i < params.size(); i++) {
        TORCH_CHECK(units[i] >= 0, "zero_ext: internal: frozen parameter ", i, " has unit ", units[i]);
        TORCH_CHECK(params[i].device() == layout.dev && params[i].is_floating_point(), "zero_ext: ",
                    FrozenParams::name_in(names, (int64_t)i),
                    " is ", params[i].scalar_type(), " on ", params[i].device(), ", expected a floating-point "
                    "tensor on ", layout.dev, " (where the trainable parameters are); call model.to(", layout.dev,
                    ") before zeroify");
        ensure(units[i]);
    }
    const auto pt = layout.on_device(layout.dtypes.param);
    // Note [Aligned pieces] (core/zx_core.h): the planner's rule for trainable buckets
    const int64_t slice_align = zx_plan_slice_align(layout.opts.align, layout.opts.piece_align_bytes());
    const int64_t piece_align = zx_plan_piece_align(layout.opts.piece_align_bytes(), layout.dtypes.param_zx);
    TORCH_CHECK(slice_align > 0 && piece_align > 0, "zero_ext: internal: alignments ", layout.opts.align, ", ",
                layout.opts.piece_align_bytes(), " bytes");
    frozen.plan(std::move(params), units, std::move(names), count(), layout.partitions,
                layout.partitions * slice_align, piece_align, pt);
    at::NoGradGuard ng;
    for (auto &bk : frozen.buckets()) {
        // Without values (meta build) the pages stay untouched until open_unit_fp32.
        bk.flat_param = layout.opts.copy_params ? at::zeros({bk.padded_numel}, pt) : at::empty({bk.padded_numel}, pt);
        for (int64_t i : bk.params) {
            at::Tensor &p = frozen.param(i);
            at::Tensor view = bk.flat_param.narrow(0, frozen.offset(i), p.numel()).view(p.sizes());
            if (layout.opts.copy_params) view.copy_(p);   // rounds to param_dtype, as a replicated frozen one was
            p.set_data(view);
            frozen.set_home(i, view);
        }
        if (layout.opts.copy_params) frozen.slice(bk).copy_(w.shard().owned(bk.flat_param, bk));
        bk.full.gathered = true;
        meter.add(bk.flat_param.nbytes());
        release_bucket(w, bk);
    }
}

void UnitStore::release_frozen(UnitWork w, int64_t u) {
    if (Bucket *bk = frozen.of_unit(u)) release_bucket(w, *bk);
}

void UnitStore::release_all_frozen(UnitWork w) {
    for (auto &bk : frozen.buckets()) release_bucket(w, bk);
}

void UnitStore::commit_frozen(UnitWork &w, int64_t u, int64_t src) {
    Bucket *bk = frozen.of_unit(u);
    if (bk == nullptr) return;
    w.comm.seq.subject(subject_of(w, *bk), u);
    if (bk->full.fp32_values.defined()) {   // open_unit_fp32: full-precision values, rounded once
        w.comm.broadcast(bk->full.fp32_values, src);
        frozen.slice(*bk).copy_(w.shard().owned(bk->full.fp32_values, *bk));
        release_bucket(w, *bk);
        return;
    }
    TORCH_CHECK(bk->full.gathered, "zero_ext: internal: commit_unit needs unit ", u, " gathered");
    w.comm.broadcast(bk->flat_param, src);
    frozen.slice(*bk).copy_(w.shard().owned(bk->flat_param, *bk));
}

void UnitStore::open_frozen_fp32(UnitWork &w, int64_t u) {
    Bucket *bk = frozen.of_unit(u);
    if (bk == nullptr) return;
    // Only with a low param_dtype (open_unit_fp32 gathers fp32 units as they are).
    // As open_unit_fp32: an fp32 buffer holding the current values, so that an
    // init writes full precision and is rounded once, at commit.
    release_bucket(w, *bk);
    at::Tensor full = at::empty({bk->padded_numel}, w.layout().on_device(w.layout().dtypes.param));
    if (w.layout().world == 1) {
        full.copy_(frozen.slice(*bk));
    } else {
        w.comm.seq.subject(subject_of(w, *bk), u);
        w.comm.watch(w.comm.all_gather(full, frozen.slice(*bk)), "unit all-gather");
    }
    bk->full.fp32_values = full.to(at::kFloat);
    meter.add(bk->full.fp32_values.nbytes());
    meter.note_peak();
    frozen.point_at(*bk, bk->full.fp32_values);
}

}  // namespace zx
