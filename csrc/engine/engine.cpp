// engine.cpp — the Engine facade (engine.h): built (the steps in build.h) and torn down, and
// each call handed to the owner that does it, lent what it needs for the call: the backward to
// GradReducer (reducer.cpp), the optimizer side to the Stepper (stepper.cpp, backward_step.cpp)
// after the engine's own waits, stages 1-2's gathers to ParamGather (gatherer.cpp), stage 3 to
// UnitStore (units.cpp, frozen.cpp, node_size's parts too); the split master's join and settle
// to MasterSplit, the sequence check's marks to the Communicator's Sequence, the report to
// EngineStats::of (stats.cpp).
#include "engine/engine.h"

#include <cstring>

#include "engine/build.h"   // defines: plan_engine, make_kernel_tables, build_buckets, make_offload

namespace zx {

Engine::Engine(std::vector<at::Tensor> params, std::vector<int64_t> groups, std::vector<int64_t> units,
               c10::optional<ProcessGroupPtr> pg, EngineOptions opts)
    : params_(std::move(params)), comm_(std::move(pg)) {
    layout_ = plan_engine(params_, groups, units, opts, comm_.rank(), comm_.world());   // every input checked
    kernels_ = make_kernel_tables(layout_);
    params_.read_pieces(layout_.plan);
    reducer_.configure(layout_, kernels_.device.get());   // the reduce kind, chosen once
    gather_.configure(layout_, kernels_.device.get());    // the gather kind
    book_ = StepBook(params_.size(), layout_.opts.agree_unused, layout_.world);   // Note [Unused parameters]
    build_buckets(unit_work(), units_, reducer_.grads());
    if (layout_.opts.offload) {   // Note [Optimizer offload]
        off_ = make_offload(layout_, (int64_t)buckets_.size());
        if (layout_.opts.stage == 3) upload_unit_shard(unit_work(), units_);
    }
}

Engine::~Engine() {
    // Outstanding collectives must finish before their buffers go away (after a
    // divergence they never will; their works hold the buffers).
    off_.reset();   // its worker's queued finishes use the engine's kernels
    try {
        reducer_.drain(comm_.seq.diverged());
        gather_.drain(comm_.seq.diverged());
        for (auto *bks : {&buckets_, &units_.frozen.buckets()})
            for (auto &bk : *bks)
                if (bk.full.work && !comm_.seq.diverged()) bk.full.work->wait();
    } catch (...) {
    }
}

EngineStats Engine::stats() const {
    return EngineStats::of(
        {layout_, buckets_, params_, shard_, off_.get(), reducer_, gather_, units_, kernels_, comm_});
}

void Engine::set_comm_delay(double ms, bool serialize) {
    Kernels *device = layout_.dev.is_cuda() ? kernels_.device.get() : nullptr;
    comm_.set_delay(ms, serialize, device);
    if (units_.secondary) units_.secondary->comm().set_delay(ms, serialize, device);
}

// --- backward: GradReducer's pass (reducer.cpp), on what reduce_work() lends it ---

void Engine::mark_ready(int64_t i, const at::Tensor &grad) { reducer_.mark_ready(reduce_work(), i, grad); }
void Engine::finalize_backward() { reducer_.finalize(reduce_work()); }
void Engine::wait_reductions() { reducer_.wait_all(reduce_work()); }
void Engine::hide_sharded_grads() { reducer_.hide_grads(reduce_work()); }

void Engine::zero_grad(bool set_to_none, const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    if (!cover.all()) ensure_step_tables();   // one of several optimizers: its fragments
    reducer_.zero_grad(reduce_work(), set_to_none, cover);
}

// --- optimizer: the Stepper (stepper.cpp), after the engine's own waits ---

void Engine::step_adam(const std::vector<zx_adam_hparams> &hps, const std::vector<int64_t> &groups,
                       const at::Tensor &ctl, const at::Tensor &steps) {
    before_step();
    stepper().step<AdamOp>(hps, Groups(groups), ctl, steps);
}

void Engine::step_sgd(const std::vector<zx_sgd_hparams> &hps, const std::vector<int64_t> &groups,
                      const at::Tensor &ctl, const at::Tensor &steps) {
    before_step();
    stepper().step<SgdOp>(hps, Groups(groups), ctl, steps);
}

void Engine::before_step() {
    wait_reductions();
    wait_params();
    settle_masters();   // Note [Split master in the engine]: step the split form
}

void Engine::set_backward_step_adam(std::vector<zx_adam_hparams> hps) {
    TORCH_CHECK(layout_.opts.step_in_backward, "zero_ext: internal: set_backward_step_adam without step_in_backward");
    book_.backward.adam = std::move(hps);
    book_.backward.sgd.clear();
}

void Engine::set_backward_step_sgd(std::vector<zx_sgd_hparams> hps) {
    TORCH_CHECK(layout_.opts.step_in_backward, "zero_ext: internal: set_backward_step_sgd without step_in_backward");
    book_.backward.sgd = std::move(hps);
    book_.backward.adam.clear();
}

void Engine::step_landed(Bucket &bk, const at::Tensor &grad) {
    settle_masters();   // Note [Split master in the engine]
    stepper().land(book_.backward, bk, grad);
    book_.backward.stepped = true;
}

std::vector<at::Tensor> Engine::param_shards(const std::vector<int64_t> &groups) {
    join_masters();   // Note [Split master in the engine]: only with a split master
    return stepper().masters(Groups(groups));
}

std::vector<at::Tensor> Engine::grad_shards(const std::vector<int64_t> &groups) {
    return stepper().grads(Groups(groups));
}

std::vector<int64_t> Engine::bucket_groups(const std::vector<int64_t> &groups) {
    return stepper().bucket_groups(Groups(groups));
}

std::vector<FragmentView> Engine::fragment_views(bool masters, const std::vector<int64_t> &groups) {
    if (masters) join_masters();   // Note [Split master in the engine]: only with a split master
    return stepper().fragment_views(masters, Groups(groups));
}

at::Tensor Engine::master_slice(Bucket &bk) {
    join_masters();   // Note [Split master in the engine]: only with a split master
    return view().master(bk);
}

at::Tensor Engine::state(const std::string &name) { return view().state(name); }

void Engine::scale_grads(double factor, const std::vector<int64_t> &groups) {
    wait_reductions();
    if (factor == 1.0) return;
    if (params_.any_cut()) ensure_step_tables();   // a mixed bucket's pieces (Note [Cut parameters])
    stepper().scale_grads(factor, Groups(groups));
}

std::pair<double, int64_t> Engine::grad_sumsq(double scale) {
    wait_reductions();
    double sumsq = 0.0;
    int64_t nonfinite = 0;
    stepper().grad_sumsq(scale, &sumsq, &nonfinite);
    if (layout_.partitions > 1) {
        // One small all-reduce carries both the norm and the inf/nan count.
        at::Tensor t = at::empty({2}, layout_.on_device(at::kDouble));
        t[0] = sumsq;
        t[1] = (double)nonfinite;
        comm_.all_reduce_sum_blocking(t, "gradient-norm all-reduce");
        sumsq = t[0].item<double>();
        nonfinite = (int64_t)t[1].item<double>();
    }
    return {sumsq, nonfinite};
}

void Engine::grad_sumsq_into(at::Tensor out2) {
    wait_reductions();
    TORCH_CHECK(out2.scalar_type() == at::kFloat && out2.numel() == 2 && out2.is_contiguous() &&
                    out2.device() == layout_.dev,
                "zero_ext: internal: grad_sumsq_into needs a contiguous float32 tensor of 2 elements on ", layout_.dev);
    TORCH_CHECK(!off_, "zero_ext: internal: step control with offload");
    out2.zero_();
    stepper().grad_sumsq_into(out2);
    if (layout_.partitions > 1) comm_.all_reduce_sum_blocking(out2, "gradient-norm all-reduce");
}

void Engine::cast_masters(const std::vector<int64_t> &groups) {
    if (!off_ && (!layout_.dtypes.low() || layout_.opts.stage == 3)) return;   // stage 3 casts at each gather
    if (shard_.split) return settle_masters();   // the parameters hold the rounding unless a master was joined
    wait_params();
    stepper().cast_masters(Groups(groups));
}

// --- parameters every rank computes with, stages 0-2 (which buckets: gatherer.cpp) ---

void Engine::publish_params() {
    wait_params();
    cast_masters();
    if (layout_.opts.stage == 3) {
        // Gathered units hold stale values (node parts too): release them; the next gather
        // reads the shards.
        units_.release_pass(unit_work());
        return;
    }
    all_gather_params();
    wait_params();
}

void Engine::absorb_param_edits() {
    TORCH_CHECK(layout_.opts.stage <= 2,
                "zero_ext: internal: absorb_param_edits is for stages 0-2 (stage 3: commit_unit)");
    wait_params();
    // Note [Cut parameters]: their edits live in their own storage
    if (params_.any_cut()) params_.copy_cut(buckets_, false);
    if (!layout_.dtypes.low() && !gather_.quantized() && !off_) return;   // the owned slice is the master
    // Note [Split master in the engine]: without a joined master the edits already are its top halves
    if (shard_.split && !shard_.master.defined()) return;
    for (auto &bk : buckets_)
        gather_.absorb(master_slice(bk), view().owned(bk.flat_param, bk), layout_.dtypes.param);
}

void Engine::all_gather_params(const std::vector<int64_t> &groups) {
    gather_.gather_stepped(gather_work(), Groups(groups));
}
void Engine::flush_params(bool wait) { gather_.flush(gather_work(), wait); }
void Engine::wait_param_buckets(const std::vector<int64_t> &buckets) { gather_.wait_buckets(gather_work(), buckets); }
void Engine::wait_params() { gather_.wait_params(gather_work()); }

void Engine::broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src) {
    for (auto &t : tensors) comm_.broadcast(t, src);
}

// --- tensor-atomic parameters (atomic.cpp) ---

std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> Engine::owned_tensors(const std::vector<int64_t> &groups) {
    join_masters();   // Note [Split master in the engine]: only with a split master
    return stepper().owned_tensors(Groups(groups));
}

AtomicStats Engine::atomic_stats() const { return AtomicStats::of(layout_, buckets_, params_); }

std::vector<int64_t> Engine::cut_params() const { return params_.cut_list(); }

std::vector<std::tuple<int64_t, int64_t, int64_t>> Engine::state_windows() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto &bk : buckets_) out.emplace_back(bk.window.lo, bk.window.numel, bk.window.offset);
    return out;
}

// --- the step book's collective and step counts (Note [Unused parameters], unused.cpp) ---

void Engine::ensure_step_tables() {
    if (!book_.has_fragments() && !buckets_.empty())
        book_.read_fragments(layout_.plan, (int64_t)buckets_.size(), (int32_t)layout_.part());
}

void Engine::begin_step(bool advance) {
    ensure_step_tables();
    if (units_.secondary) units_.secondary->drop_all();   // the masters change (Note [Hierarchical partitioning])
    if (book_.agrees()) {
        const std::vector<uint8_t> flags = book_.agreement_flags();
        at::Tensor t = at::empty({(int64_t)flags.size()}, at::kByte);
        std::memcpy(t.data_ptr<uint8_t>(), flags.data(), flags.size());
        t = t.to(layout_.dev);
        comm_.all_reduce_max_blocking(t, comm_.count.used_flags, "unused-parameter flags all-reduce");
        t = t.cpu();
        book_.begin(t.data_ptr<uint8_t>());
    } else {
        book_.begin(nullptr);
    }
    if (advance) advance_steps();
}

void Engine::advance_steps(const std::vector<int64_t> &groups) {
    TORCH_CHECK(book_.begun(), "zero_ext: internal: advance_steps() without begin_step()");
    const Groups cover(groups);
    book_.advance([&](int64_t i) { return cover.has(layout_.group_of[i]); });
}

void Engine::set_param_steps(const std::vector<int64_t> &steps) {
    book_.set_steps(steps);
}

// --- the split master (Note [Split master in the engine], master_split.h) ---

void Engine::enable_split_master() {
    if (shard_.split) return;
    TORCH_CHECK(layout_.opts.stage <= 2 && layout_.dtypes.param == at::kBFloat16 && !gather_.quantized() && !off_ &&
                    shard_.master.defined(),
                "zero_ext: master_remainder needs param_dtype='bf16' in stage 0, 1 or 2 without param_quant or "
                "offload; pass master_remainder=False");
    std::vector<int64_t> slices, offsets;
    for (const auto &bk : buckets_) {
        TORCH_CHECK(!bk.atomic, "zero_ext: master_remainder is for element-granular buckets (one fused "
                    "optimizer); pass master_remainder=False");
        slices.push_back(bk.slice_numel);
        offsets.push_back(bk.shard_offset);
    }
    shard_.split = std::make_unique<MasterSplit>(slices, offsets, layout_.shard_numel, layout_.dev);
    settle_masters();
}

void Engine::join_masters() {
    if (!shard_.split || shard_.master.defined()) return;
    wait_params();
    shard_.master = at::empty({layout_.shard_numel}, layout_.on_device(at::kFloat));
    shard_.split->join_all(*kernels_.device, [&](int64_t b) { return view().hi_bits(buckets_[b]); },
                           shard_.master.data_ptr<float>());
}

void Engine::settle_masters() {
    if (!shard_.split || !shard_.master.defined()) return;
    wait_params();
    shard_.split->settle_all(*kernels_.device, [&](int64_t b) { return view().hi_bits(buckets_[b]); },
                             shard_.master.data_ptr<float>());
    shard_.master = at::Tensor();
}

// --- the collective sequence check (Note [Collective sequence check], sequence.h) ---

void Engine::enable_sequence_check(c10::optional<StorePtr> store, double patience_s,
                                   c10::optional<ProcessGroupPtr> group, bool every_phase, int64_t id,
                                   c10::optional<StorePtr> meet) {
    if (group.has_value()) {
        TORCH_CHECK((*group)->getSize() == layout_.world && (*group)->getRank() == layout_.rank,
                    "zero_ext: internal: the sequence-check group must hold the engine's ranks in the same order");
        comm_.seq.attach(*group, layout_.rank, layout_.world);
    }
    // Note [Parameter names in messages]: the names zeroify gave the engine
    comm_.seq.enable(store.has_value() ? *store : StorePtr(), layout_.opts.param_names, patience_s, every_phase, id,
                     meet.has_value() ? *meet : StorePtr());
}

void Engine::sequence_sync() { comm_.seq.sync(); }

bool Engine::sequence_mark(int64_t phase, bool servable) {
    if (!comm_.seq.enabled()) return false;
    if (phase >= kUnitNeedBase) {
        comm_.seq.unit_need(phase - kUnitNeedBase);
        return comm_.seq.away();
    }
    TORCH_CHECK(phase > kPhaseNone && phase <= kPhaseLast, "zero_ext: internal: unknown sequence phase ", phase);
    // Python collectives follow the phases after kPhaseForwardNoGrad: exchange first.
    return comm_.seq.mark(phase, FrozenSummary::of(params_, layout_.bucket_of), phase >= kPhaseModelState, servable);
}

// --- stage 3: UnitStore's units (units.cpp) and frozen parameters (frozen.cpp), on unit_work() ---

bool Engine::gather_unit(int64_t u, bool wait) { return units_.gather_unit(unit_work(), u, wait); }
void Engine::gather_units(const std::vector<int64_t> &units) { units_.gather_units(unit_work(), units); }
void Engine::release_unit(int64_t u, bool keep) { units_.release_unit(unit_work(), u, keep); }
void Engine::commit_unit(int64_t u, int64_t src) { units_.commit_unit(unit_work(), u, src); }
void Engine::open_unit_fp32(int64_t u) { units_.open_unit_fp32(unit_work(), u); }
void Engine::release_frozen(int64_t u) { units_.release_frozen(unit_work(), u); }
std::vector<at::Tensor> Engine::unit_part(int64_t u) { return units_.unit_part(unit_work(), u); }
void Engine::install_unit(int64_t u, const std::vector<std::vector<at::Tensor>> &parts) {
    units_.install_unit(unit_work(), u, parts);
}
void Engine::enable_hierarchy(ProcessGroupPtr node_pg) { units_.enable_hierarchy(unit_work(), std::move(node_pg)); }

void Engine::add_frozen(std::vector<at::Tensor> params, std::vector<int64_t> units, std::vector<std::string> names) {
    units_.add_frozen(unit_work(), std::move(params), std::move(units), std::move(names));
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> Engine::frozen_fragments(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < layout_.partitions, "zero_ext: internal: no rank ", r, " among ", layout_.partitions,
                " partitions");
    return units_.frozen.fragments(r);
}

}  // namespace zx
