// build.cpp — the Engine built from its Layout (layout.cpp): buckets as flat tensors on the
// parameters' device, parameters (and stage 0/1 gradients) as views into them, the fp32
// master over this rank's shard (optimizer states: fill.cpp), each owner configured; torn
// down; and what it reports: fragment views (Note [Fragment views]) and stats().
#include "engine/engine.h"

#include "engine/check.h"      // defines: zx_check, parse_isa, plan_fragments

namespace zx {

Engine::Engine(std::vector<at::Tensor> params, std::vector<int64_t> groups, std::vector<int64_t> units,
               c10::optional<ProcessGroupPtr> pg, EngineOptions opts)
    : params_(std::move(params)), comm_(std::move(pg)) {
    layout_.opts = opts;   // a copy: the constructor reads its argument, the same values
    const int64_t n = (int64_t)params_.size();
    TORCH_CHECK(n > 0, "zero_ext: the optimizer has no trainable parameters; build it over parameters with "
                "requires_grad=True (torch.optim.AdamW(model.parameters()))");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: internal: one group index per parameter expected");
    TORCH_CHECK(opts.param_names.empty() || (int64_t)opts.param_names.size() == n,
                "zero_ext: internal: one name per parameter expected, got ", opts.param_names.size());
    TORCH_CHECK(opts.stage >= 0 && opts.stage <= 3, "zero_ext: stage must be 0, 1, 2 or 3, got ", opts.stage,
                "; pass stage=0, 1, 2 or 3");
    TORCH_CHECK(opts.state_dtype == "fp32" || opts.state_dtype == "bf16", "zero_ext: state_dtype must be "
                "'fp32' or 'bf16', got '", opts.state_dtype, "'; pass state_dtype='fp32' (exact) or 'bf16'");
    const bool s3 = opts.stage == 3;
    TORCH_CHECK(!s3 || (int64_t)units.size() == n, "zero_ext: internal: stage 3 needs one unit id per parameter");
    kernels_.isa = opts.isa == "auto" ? zx_cpu_best_isa() : parse_isa(opts.isa);
    TORCH_CHECK(zx_cpu_supports(kernels_.isa), "zero_ext: this CPU cannot run isa='", opts.isa,
                "'; pass isa='auto' (the best ISA this CPU has)");
    const at::Device dev = params_[0].device();
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t i = 0; i < n; i++) {
        const at::Tensor &p = params_[i];
        TORCH_CHECK(p.scalar_type() == at::kFloat, "zero_ext: ", pname(i), " is ", p.scalar_type(),
                    ", expected float32 (the fp32 master weights are taken from it); call model.float() before "
                    "zeroify and choose the compute precision with param_dtype='bf16' or 'fp16'");
        TORCH_CHECK(p.device() == dev, "zero_ext: ", pname(i), " is on ", p.device(), " but ", pname(0),
                    " is on ", dev, "; every trainable parameter must be on one device: call model.to(device) "
                    "before zeroify");
        shapes.push_back(p.sizes().vec());
    }
    layout_ = Layout::make(opts, dev, std::move(shapes), groups, units, comm_.rank(), comm_.world());
    reducer_.grads().views_ok = layout_.dtypes.reduce == layout_.dtypes.param;
    params_.read_pieces(layout_.plan);

    // Buckets as tensors; parameters (and stage 0/1 gradients) become views.
    kernels_.device = make_kernels(layout_.dev, kernels_.isa, layout_.dtypes.reduce_zx);
    if (opts.grad_quant_bits != 0) {
        TORCH_CHECK(opts.stage >= 1 && opts.alltoall_reduce_scatter,
                    "zero_ext: grad_quant needs stage 1, 2 or 3 and the all-to-all reduce-scatter; pass stage=1, 2 "
                    "or 3 and reduce_scatter='auto' or 'alltoall', or grad_quant=None");
    }
    // The reduce kind, chosen once (grad_reducer.h).
    const ReduceKind kind = opts.stage == 0            ? ReduceKind::kAllReduce
                            : opts.grad_quant_bits != 0 ? ReduceKind::kQuantized
                            : opts.alltoall_reduce_scatter ? ReduceKind::kAllToAll
                                                            : ReduceKind::kReduceScatter;
    reducer_.configure(kind, layout_.world, layout_.partitions, layout_.on_device(layout_.dtypes.reduce),
                       kind == ReduceKind::kQuantized
                           ? std::make_unique<QuantReduce>((int32_t)opts.grad_quant_bits, opts.quant_block_numel,
                                                           opts.grad_quant_error_feedback, kernels_.device.get(),
                                                           layout_.dev, layout_.partitions)
                           : nullptr);
    if (opts.param_quant_bits != 0) {
        TORCH_CHECK(opts.stage >= 1, "zero_ext: param_quant needs stage 1, 2 or 3; pass stage=1, 2 or 3, or "
                    "param_quant=None");
        // One rank gathers nothing: its parameters stay exact.
        if (layout_.partitions > 1)
            gather_.configure(std::make_unique<QuantGather>((int32_t)opts.param_quant_bits, opts.quant_block_numel,
                                                            kernels_.device.get(), layout_.dev, layout_.partitions),
                              opts.stage < 3);
    }
    TORCH_CHECK(!opts.step_in_backward || (opts.stage >= 1 && !opts.offload), "zero_ext: step_in_backward "
                "needs stage 1, 2 or 3 and no offload; pass stage=1, 2 or 3 and offload=None, or "
                "step_in_backward=False");
    if (opts.offload) {   // Note [Optimizer offload]
        TORCH_CHECK(opts.stage >= 1, "zero_ext: offload='cpu' needs stage 1, 2 or 3 (stage 0 shards nothing); "
                    "pass stage=1, 2 or 3, or offload=None");
        TORCH_CHECK(!reducer_.quantized() && !gather_.quantized(), "zero_ext: offload='cpu' keeps exact gradients "
                    "and parameters; pass "
                    "grad_quant=None and param_quant=None with it, or offload=None");
        if (!layout_.dev.is_cpu()) kernels_.host = make_cpu_kernels(kernels_.isa, layout_.dtypes.reduce_zx);
    }
    const auto f32 = layout_.on_device(at::kFloat), pt = layout_.on_device(layout_.dtypes.param);
    const auto rt = layout_.on_device(layout_.dtypes.reduce);
    const int64_t nb = zx_plan_num_buckets(layout_.plan);
    buckets_.resize(nb);
    // param_quant: the owned slice of flat_param holds dequantized values, so the
    // master is a shard of its own (Note [Quantized parameter gather]); so does offload.
    if (s3 || layout_.dtypes.low() || gather_.quantized() || opts.offload)
        shard_.master = at::zeros({layout_.shard_numel}, view().on_shard(at::kFloat));
    reducer_.grads().views.resize(n);
    if (s3) units_.param_views.resize(n);
    reducer_.pass().resize(n);
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_check(zx_plan_bucket(layout_.plan, b, &bi), "reading the plan");
        Bucket &bk = buckets_[b];
        bk.group = bi.group;
        bk.numel = bi.numel;
        bk.padded_numel = bi.padded_numel;
        bk.slice_numel = bi.slice_numel;
        bk.shard_offset = zx_plan_shard_offset(layout_.plan, b);
        bk.pending = bi.num_params;
        bk.unit = bi.unit;
        bk.atomic = bi.atomic != 0;
        bk.full.gathered = true;
        // Stage 3 without values: never touch the pages (peak = shards + one unit).
        bk.flat_param = s3 && !opts.copy_params ? at::empty({bi.padded_numel}, pt)
                                                 : at::zeros({bi.padded_numel}, pt);
        if (opts.stage <= 1) bk.flat_grad = at::zeros({bi.padded_numel}, rt);
        // Low precision: the fp32 values, from which the master is taken.
        at::Tensor src32 = layout_.dtypes.low() && opts.copy_params ? at::zeros({bi.padded_numel}, f32) : at::Tensor();
        for (int64_t k = 0; k < bi.num_params; k++) {
            zx_piece pc;
            zx_check(zx_plan_bucket_piece(layout_.plan, b, k, &pc), "reading the plan");
            const int64_t i = pc.param;
            bk.params.push_back(i);
            at::Tensor &p = params_[i];
            if (params_.cut(i)) {
                // Note [Cut parameters]: this piece's values; the parameter keeps storage of its own.
                bk.mixed = bk.mixed || bk.atomic;
                if (opts.copy_params) {
                    at::NoGradGuard ng;
                    (layout_.dtypes.low() ? src32 : bk.flat_param).narrow(0, pc.offset, pc.numel)
                        .copy_(p.detach().reshape(-1).narrow(0, pc.param_offset, pc.numel));
                }
                continue;
            }
            bk.mixed = bk.mixed || (bk.atomic && zx_plan_owner(layout_.plan, i) < 0);
            zx_param_loc loc;
            zx_check(zx_plan_param(layout_.plan, i, &loc), "reading the plan");
            at::Tensor view = bk.flat_param.narrow(0, loc.offset, loc.numel).view(p.sizes());
            if (opts.copy_params) {
                at::NoGradGuard ng;
                (layout_.dtypes.low() ? src32.narrow(0, loc.offset, loc.numel).view(p.sizes()) : view).copy_(p);
            }
            p.set_data(view);
            if (s3) units_.param_views[i] = view;
            if (opts.stage <= 1) {
                at::Tensor &gv = reducer_.grads().views[i];
                gv = bk.flat_grad.narrow(0, loc.offset, loc.numel).view(p.sizes());
                if (p.grad().defined()) gv.copy_(p.grad());
                p.mutable_grad() = at::Tensor();
            } else {
                p.mutable_grad() = at::Tensor();
            }
        }
        if (bk.mixed) {
            for (int64_t i : bk.params)
                if (std::find(bk.groups.begin(), bk.groups.end(), layout_.group_of[i]) == bk.groups.end())
                    bk.groups.push_back(layout_.group_of[i]);
            bk.stepped.assign(bk.groups.size(), 0);
        }
        // Padding between and after the pieces (atomic buckets pad every slice).
        std::vector<std::pair<int64_t, int64_t>> spans;
        for (int64_t k = 0; k < bi.num_params; k++) {
            zx_piece pc;
            zx_check(zx_plan_bucket_piece(layout_.plan, b, k, &pc), "reading the plan");
            spans.emplace_back(pc.offset, pc.numel);
        }
        std::sort(spans.begin(), spans.end());
        int64_t at = 0;
        for (const auto &sp : spans) {
            if (sp.first > at) bk.gaps.emplace_back(at, sp.first - at);
            at = std::max(at, sp.first + sp.second);
        }
        if (at < bk.padded_numel) bk.gaps.emplace_back(at, bk.padded_numel - at);
        if (opts.copy_params && layout_.dtypes.low()) {
            bk.flat_param.copy_(src32);                            // rounds to param_dtype
            master_slice(bk).copy_(view().owned(src32, bk));
        } else if (opts.copy_params && (s3 || gather_.quantized() || opts.offload)) {
            master_slice(bk).copy_(view().owned(bk.flat_param, bk));
        }
        if (s3) {
            // Keep only this rank's slice (Note [Stage 3 parameter lifetime]).
            units_.add(bk.unit, b);
            units_.meter.add(bk.flat_param.nbytes());
            release_bucket(bk);
        }
    }
    if (s3) units_.meter.reset_peak();
    TORCH_CHECK(!s3 || !params_.any_cut(), "zero_ext: internal: stage 3 cuts no parameter");
    for (int64_t i = 0; i < n; i++) {
        if (!params_.cut(i)) continue;
        // Note [Cut parameters]: storage of its own in param_dtype, filled from the buckets.
        at::Tensor &p = params_[i];
        const at::Tensor grad = p.grad();
        p.set_data(at::empty(layout_.shapes[i], pt));
        p.mutable_grad() = at::Tensor();
        if (grad.defined() && opts.stage <= 1)
            for (const zx_piece &pc : params_.pieces(i))
                buckets_[pc.bucket].flat_grad.narrow(0, pc.offset, pc.numel)
                    .copy_(grad.reshape(-1).narrow(0, pc.param_offset, pc.numel));
    }
    if (params_.any_cut()) params_.copy_cut(buckets_, true);
    shard_.states.set_numel(plan_state_windows(layout_, buckets_));   // Note [State windows]
    if (opts.offload) {
        // Down: a reduce-scatter's slice, an all-to-all's whole receive buffer, or (one
        // rank) the whole bucket; up: a slice in param_dtype.
        const int64_t slice = layout_.max_padded / std::max<int64_t>(layout_.partitions, 1);
        const int64_t down = opts.alltoall_reduce_scatter && layout_.world > 1 ? layout_.max_padded : slice;
        off_ = std::make_unique<Offload>(layout_.dev, layout_.dtypes.reduce, down, layout_.dtypes.param, slice, nb);
        if (s3) {   // what the unit gathers read: the master in param_dtype, kept current by upload()
            units_.param_shard = at::empty({layout_.shard_numel}, pt);
            for (auto &bk : buckets_) stepper().upload(bk);
        }
    }
    // Note [Gradient layout]: stages 2-3 stage each gradient in a slot; more than one rank
    // receives a slice (reduce-scatter) or every rank's slices (all-to-all).
    reducer_.ring().configure(opts.stage >= 2 ? layout_.max_padded : 0,
                              layout_.world > 1 ? reducer_.recv_numel(layout_.max_padded) : 0,
                              layout_.on_device(layout_.dtypes.reduce), opts.grad_ring_buckets);
    book_ = StepBook(params_.size(), opts.agree_unused, layout_.world);   // Note [Unused parameters]
    // Note [Coalesced gradient reductions] (reducer.cpp): stage 3's plain reduction path only.
    if (s3 && layout_.world > 1 && !reducer_.quantized() && !off_ && !opts.step_in_backward &&
        opts.coalesce_numel > 0)
        reducer_.groups().configure(std::max<int64_t>(opts.coalesce_numel / layout_.partitions, 1), layout_.partitions,
                           layout_.on_device(layout_.dtypes.reduce));
    // The gradient shard and the ring are allocated at the first backward
    // (ShardView::grad, acquire_slot), so building the model costs no more.
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
    zx_plan_free(layout_.plan);
}

// Note [Fragment views]
//   Python code that reads or writes this rank's share of a parameter (checkpoint
//   save and load, model.load_state_dict, edits folded into the master, the generic
//   step's unstepped elements) asks the engine where it lies, instead of rebuilding
//   the shard layout from param_shards() offsets and fragments() itself: each view
//   names the parameter, where the piece starts in it, its bucket (an index into
//   param_shards(), so a caller can find the generic optimizer's tensor) and where it
//   starts in that bucket's slice, and carries a view of the master over exactly the
//   piece. Only the buckets of the groups asked for are listed (Note [Groups as an
//   argument]), as param_shards() lists them.
std::vector<FragmentView> Engine::fragment_views(bool masters, const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    const int64_t r = layout_.partitions > 1 ? layout_.rank : 0;
    std::vector<FragmentView> out;
    int64_t index = 0;   // among the covered buckets
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        Bucket &bk = buckets_[b];
        if (!cover.has(bk.group)) continue;
        const std::vector<zx_fragment> fr = plan_fragments(layout_.plan, b, (int32_t)r);
        at::Tensor m = !fr.empty() && masters ? master_slice(bk) : at::Tensor();
        for (const auto &f : fr)
            out.push_back({f.param, f.param_offset, index, f.slice_offset, f.numel,
                           m.defined() ? m.narrow(0, f.slice_offset, f.numel) : at::Tensor()});
        index++;
    }
    return out;
}

std::vector<FragmentView> Engine::frozen_fragment_views() const {
    std::vector<FragmentView> out;
    if (units_.frozen.empty()) return out;
    for (const auto &[i, poff, soff, n] : frozen_fragments(layout_.partitions > 1 ? layout_.rank : 0))
        out.push_back({i, poff, -1, soff, n, units_.frozen.shard().narrow(0, soff, n)});
    return out;
}

void Engine::set_comm_delay(double ms, bool serialize) {
    Kernels *device = layout_.dev.is_cuda() ? kernels_.device.get() : nullptr;
    comm_.set_delay(ms, serialize, device);
    if (units_.secondary) units_.secondary->comm().set_delay(ms, serialize, device);
}

EngineStats Engine::stats() const {
    EngineStats st;
    int64_t param_bytes = 0, grad_bytes = 0, numel = 0, padded = 0;
    for (const auto &bk : buckets_) {
        if (layout_.opts.stage < 3) param_bytes += bk.flat_param.nbytes();
        if (bk.flat_grad.defined()) grad_bytes += bk.flat_grad.nbytes();
        numel += bk.numel;
        padded += bk.padded_numel;
    }
    if (shard_.grad.defined() && !off_) grad_bytes += shard_.grad.nbytes();   // offload: in offload_stats()
    int64_t master_bytes = 0;
    // stage 3: the fp32 master is the parameter shard; with a low param_dtype the gather
    // casts it, so no low-precision copy persists (it is counted as master weights)
    if (layout_.opts.stage == 3 && !layout_.dtypes.low() && !off_) param_bytes += shard_.master.nbytes();
    if (units_.param_shard.defined()) param_bytes += units_.param_shard.nbytes();   // offload, stage 3
    if ((layout_.dtypes.low() || (gather_.quantized() && layout_.opts.stage < 3)) && !off_)
        master_bytes =
            (shard_.master.defined() ? shard_.master.nbytes() : 0) + (shard_.split ? shard_.split->bytes() : 0);
    const int64_t state_bytes = off_ ? 0 : shard_.states.bytes();
    const int64_t ring_bytes = reducer_.ring().bytes();
    ModelStateBytes &msb = st.model_state_bytes;
    msb.parameters = param_bytes;
    msb.gradients = grad_bytes;
    msb.master_weights = master_bytes;
    msb.optimizer_states = state_bytes;
    msb.total = param_bytes + grad_bytes + master_bytes + state_bytes;
    BufferBytes &buf = st.buffer_bytes;
    buf.grad_ring = ring_bytes;
    buf.grad_landing = shard_.land.defined() ? shard_.land.nbytes() : 0;
    buf.ring_slots = reducer_.ring().slots();
    buf.gathered_params = units_.meter.now();
    buf.peak_gathered_params = units_.meter.peak();
    const QuantReduce *quant = reducer_.quant();
    buf.quant_buffers = quant ? quant->buffer_bytes() : 0;
    buf.quant_residual = quant ? quant->residual_bytes() : 0;
    const QuantGather *qg = gather_.quant();
    buf.quant_gather_buffers = qg ? qg->buffer_bytes() : 0;
    buf.peak_quant_gather_buffers = qg ? qg->peak_buffer_bytes() : 0;
    buf.kernel_scratch = kernels_.device->scratch_bytes();
    buf.split_master_scratch = shard_.split ? shard_.split->scratch_bytes() : 0;
    buf.secondary = units_.secondary ? units_.secondary->bytes() : 0;
    buf.peak_secondary = units_.secondary ? units_.secondary->peak_bytes() : 0;
    buf.total = buf.grad_ring + buf.grad_landing + buf.gathered_params + buf.quant_buffers + buf.quant_residual +
                buf.quant_gather_buffers + buf.kernel_scratch + buf.secondary + buf.split_master_scratch;
    st.stage = layout_.opts.stage;
    st.world_size = layout_.world;
    st.rank = layout_.rank;
    st.isa = zx_isa_name(kernels_.isa);
    st.device = layout_.dev.str();
    st.kernels = kernels_.device->name();
    st.num_params = numel;
    st.padded_numel = padded;
    st.shard_numel = layout_.shard_numel;
    st.num_buckets = (int64_t)buckets_.size();
    st.param_dtype = layout_.opts.param_dtype;
    st.reduce_dtype = layout_.opts.reduce_dtype;
    const EngineOptions &o = layout_.opts;
    st.reduce_scatter_impl = reducer_.quantized() ? (o.grad_quant_bits == 8 ? "alltoall-int8" : "alltoall-int4")
                             : o.alltoall_reduce_scatter ? "alltoall" : "native";
    st.param_gather_impl = gather_.quantized() ? "allgather-int8" : "allgather";
    st.comm = comm_.count;
    st.comm_wait_s = comm_.waited_s() + (units_.secondary ? units_.secondary->comm().waited_s() : 0.0);
    st.comm_delay_ms = comm_.delay_ms();
    if (units_.secondary) st.comm_groups = units_.secondary->group_stats(comm_);   // Note [Per-group byte counters]
    st.reductions = reducer_.pass().reductions();
    st.num_units = units_.count();
    st.frozen_shard_bytes = frozen_shard_bytes();
    st.atomic = atomic_stats();
    st.offload = offload_stats();
    return st;
}

std::optional<OffloadStats> Engine::offload_stats() const {
    if (!off_) return std::nullopt;
    OffloadStats o;
    o.master_weights = shard_.master.nbytes();
    o.optimizer_states = shard_.states.bytes();
    o.gradients = shard_.grad.defined() ? shard_.grad.nbytes() : 0;
    o.pinned_ring = off_->pinned_bytes();
    o.total = o.master_weights + o.optimizer_states + o.gradients + o.pinned_ring;
    o.down_copies = off_->down_copies();
    o.down_bytes = off_->down_bytes();
    o.up_copies = off_->up_copies();
    o.up_bytes = off_->up_bytes();
    return o;
}

}  // namespace zx
