// build.cpp — an Engine built from its inputs (build.h says in which order): each input
// checked, the Layout planned (layout.cpp), then the owners made from it: the kernel tables,
// the reduce and gather kinds, the buckets as flat tensors on the parameters' device with the
// parameters (and stage 0-1 gradients) as views into them, the fp32 master over this rank's
// shard (optimizer states: fill.cpp), and offload's host rings.
#include "engine/build.h"

#include <algorithm>

#include "engine/check.h"          // defines: zx_check, parse_isa
#include "engine/fill.h"           // defines: plan_state_windows
#include "engine/grad_reducer.h"   // defines: GradReducer, ReduceKind
#include "engine/param_gather.h"   // defines: ParamGather

namespace zx {

static zx_isa isa_of(const EngineOptions &opts) {
    return opts.isa == "auto" ? zx_cpu_best_isa() : parse_isa(opts.isa);
}

Layout plan_engine(const Params &params, const std::vector<int64_t> &groups, const std::vector<int64_t> &units,
                   const EngineOptions &opts, int64_t rank, int64_t world) {
    const int64_t n = (int64_t)params.size();
    TORCH_CHECK(n > 0, "zero_ext: the optimizer has no trainable parameters; build it over parameters with "
                "requires_grad=True (torch.optim.AdamW(model.parameters()))");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: internal: one group index per parameter expected");
    TORCH_CHECK(opts.param_names.empty() || (int64_t)opts.param_names.size() == n,
                "zero_ext: internal: one name per parameter expected, got ", opts.param_names.size());
    TORCH_CHECK(opts.stage >= 0 && opts.stage <= 3, "zero_ext: stage must be 0, 1, 2 or 3, got ", opts.stage,
                "; pass stage=0, 1, 2 or 3");
    TORCH_CHECK(opts.state_dtype == "fp32" || opts.state_dtype == "bf16", "zero_ext: state_dtype must be "
                "'fp32' or 'bf16', got '", opts.state_dtype, "'; pass state_dtype='fp32' (exact) or 'bf16'");
    TORCH_CHECK(opts.stage != 3 || (int64_t)units.size() == n,
                "zero_ext: internal: stage 3 needs one unit id per parameter");
    TORCH_CHECK(zx_cpu_supports(isa_of(opts)), "zero_ext: this CPU cannot run isa='", opts.isa,
                "'; pass isa='auto' (the best ISA this CPU has)");
    const auto pname = [&](int64_t i) { return Layout::pname_in(opts.param_names, i); };
    const at::Device dev = params[0].device();
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t i = 0; i < n; i++) {
        const at::Tensor &p = params[i];
        TORCH_CHECK(p.scalar_type() == at::kFloat, "zero_ext: ", pname(i), " is ", p.scalar_type(),
                    ", expected float32 (the fp32 master weights are taken from it); call model.float() before "
                    "zeroify and choose the compute precision with param_dtype='bf16' or 'fp16'");
        TORCH_CHECK(p.device() == dev, "zero_ext: ", pname(i), " is on ", p.device(), " but ", pname(0),
                    " is on ", dev, "; every trainable parameter must be on one device: call model.to(device) "
                    "before zeroify");
        shapes.push_back(p.sizes().vec());
    }
    Layout layout = Layout::make(opts, dev, std::move(shapes), groups, units, rank, world);
    TORCH_CHECK(opts.grad_quant_bits == 0 || (opts.stage >= 1 && opts.alltoall_reduce_scatter),
                "zero_ext: grad_quant needs stage 1, 2 or 3 and the all-to-all reduce-scatter; pass stage=1, 2 "
                "or 3 and reduce_scatter='auto' or 'alltoall', or grad_quant=None");
    TORCH_CHECK(opts.param_quant_bits == 0 || opts.stage >= 1, "zero_ext: param_quant needs stage 1, 2 or 3; "
                "pass stage=1, 2 or 3, or param_quant=None");
    TORCH_CHECK(!opts.step_in_backward || (opts.stage >= 1 && !opts.offload), "zero_ext: step_in_backward "
                "needs stage 1, 2 or 3 and no offload; pass stage=1, 2 or 3 and offload=None, or "
                "step_in_backward=False");
    if (opts.offload) {   // Note [Optimizer offload]
        TORCH_CHECK(opts.stage >= 1, "zero_ext: offload='cpu' needs stage 1, 2 or 3 (stage 0 shards nothing); "
                    "pass stage=1, 2 or 3, or offload=None");
        // (one rank gathers nothing, so param_quant leaves its parameters exact)
        TORCH_CHECK(opts.grad_quant_bits == 0 && (opts.param_quant_bits == 0 || layout.partitions == 1),
                    "zero_ext: offload='cpu' keeps exact gradients and parameters; pass "
                    "grad_quant=None and param_quant=None with it, or offload=None");
    }
    return layout;
}

KernelTables make_kernel_tables(const Layout &layout) {
    KernelTables k;
    k.isa = isa_of(layout.opts);
    k.device = make_kernels(layout.dev, k.isa, layout.dtypes.reduce_zx);
    if (layout.opts.offload && !layout.dev.is_cpu()) k.host = make_cpu_kernels(k.isa, layout.dtypes.reduce_zx);
    return k;
}

void GradReducer::configure(const Layout &layout, Kernels *device) {
    const EngineOptions &opts = layout.opts;
    kind_ = opts.stage == 0                ? ReduceKind::kAllReduce
            : opts.grad_quant_bits != 0     ? ReduceKind::kQuantized
            : opts.alltoall_reduce_scatter  ? ReduceKind::kAllToAll
                                            : ReduceKind::kReduceScatter;
    world_ = layout.world, partitions_ = layout.partitions;
    reduce_ = layout.on_device(layout.dtypes.reduce);
    if (quantized())
        quant_ = std::make_unique<QuantReduce>((int32_t)opts.grad_quant_bits, opts.quant_block_numel,
                                               opts.grad_quant_error_feedback, device, layout.dev, layout.partitions);
    const size_t n = layout.shapes.size();
    grads_.views_ok = layout.dtypes.reduce == layout.dtypes.param;
    grads_.views.resize(n);
    pass_.resize(n);
    // Note [Gradient layout]: stages 2-3 stage each gradient in a slot; more than one rank
    // receives a slice (reduce-scatter) or every rank's slices (all-to-all). The slots are
    // allocated at the first backward (acquire_slot), so building the model costs no more.
    // Note [Narrow gradient wire] (reducer.cpp): 16-bit gradients sent as they are
    const bool narrow_wire = kind_ == ReduceKind::kAllToAll && opts.stage >= 2 && layout.world > 1 &&
                             layout.dtypes.low() && layout.dtypes.reduce == at::kFloat && !opts.offload &&
                             layout.dev.is_cpu();
    wire_ = narrow_wire ? layout.dtypes.param : layout.dtypes.reduce;
    ring_.configure(opts.stage >= 2 ? layout.max_padded : 0, layout.world > 1 ? recv_numel(layout.max_padded) : 0,
                    layout.on_device(wire_), opts.grad_ring_buckets, opts.offload || !layout.dev.is_cpu());
    // Note [Coalesced gradient reductions] (reducer.cpp): stage 3's plain reduction path only.
    if (opts.stage == 3 && layout.world > 1 && !quantized() && !opts.offload && !opts.step_in_backward &&
        opts.coalesce_numel > 0)
        groups_.configure(std::max<int64_t>(opts.coalesce_numel / layout.partitions, 1), layout.partitions, reduce_);
}

void ParamGather::configure(const Layout &layout, Kernels *device) {
    const EngineOptions &opts = layout.opts;
    // One rank gathers nothing: its parameters stay exact. Stages 1-2 finish the quantized
    // gathers in the waits (queued); stage 3 each unit's as it waits.
    if (opts.param_quant_bits == 0 || layout.partitions == 1) return;
    quant_ = std::make_unique<QuantGather>((int32_t)opts.param_quant_bits, opts.quant_block_numel, device,
                                           layout.dev, layout.partitions);
    queued_finish_ = opts.stage < 3;
}

// The padding between and after a bucket's pieces, spans (offset, numel) (atomic buckets pad
// every slice).
static std::vector<std::pair<int64_t, int64_t>> gaps_of(std::vector<std::pair<int64_t, int64_t>> spans,
                                                        const zx_bucket_info &bi) {
    std::vector<std::pair<int64_t, int64_t>> gaps;
    std::sort(spans.begin(), spans.end());
    int64_t at = 0;
    for (const auto &sp : spans) {
        if (sp.first > at) gaps.emplace_back(at, sp.first - at);
        at = std::max(at, sp.first + sp.second);
    }
    if (at < bi.padded_numel) gaps.emplace_back(at, bi.padded_numel - at);
    return gaps;
}

void build_buckets(UnitWork w, UnitStore &units, ShardedGrads &grads) {
    const Layout &layout = w.layout();
    const EngineOptions &opts = layout.opts;
    ShardView view = w.shard();
    Params &params = w.params;
    const int64_t n = (int64_t)params.size();
    const bool s3 = opts.stage == 3, low = layout.dtypes.low();
    const auto f32 = layout.on_device(at::kFloat), pt = layout.on_device(layout.dtypes.param);
    const auto rt = layout.on_device(layout.dtypes.reduce);
    const int64_t nb = zx_plan_num_buckets(layout.plan);
    w.buckets.resize(nb);
    // param_quant: the owned slice of flat_param holds dequantized values, so the
    // master is a shard of its own (Note [Quantized parameter gather]); so does offload.
    if (s3 || low || w.gather.quantized() || opts.offload)
        view.buffers.master = at::zeros({layout.shard_numel}, view.on_shard(at::kFloat));
    if (s3) units.param_views.resize(n);
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_check(zx_plan_bucket(layout.plan, b, &bi), "reading the plan");
        Bucket &bk = w.buckets[b];
        bk.group = bi.group;
        bk.numel = bi.numel;
        bk.gap_numel = bi.gap_numel;
        bk.padded_numel = bi.padded_numel;
        bk.slice_numel = bi.slice_numel;
        bk.shard_offset = zx_plan_shard_offset(layout.plan, b);
        bk.pending = bi.num_params;
        bk.unit = bi.unit;
        bk.atomic = bi.atomic != 0;
        bk.full.gathered = true;
        // Stage 3 without values: never touch the pages (peak = shards + one unit).
        bk.flat_param = s3 && !opts.copy_params ? at::empty({bi.padded_numel}, pt) : at::zeros({bi.padded_numel}, pt);
        // Stages 0-1: the views are made over bytes that go at the end (Note [Bucket gradient lifetime]),
        // unless a gradient is copied in
        if (opts.stage <= 1) bk.flat_grad = at::empty({bi.padded_numel}, rt);
        bool grad_in = false;
        // Low precision: the fp32 values, from which the master is taken.
        at::Tensor src32 = low && opts.copy_params ? at::zeros({bi.padded_numel}, f32) : at::Tensor();
        std::vector<std::pair<int64_t, int64_t>> spans;   // where the pieces lie
        for (int64_t k = 0; k < bi.num_params; k++) {
            zx_piece pc;
            zx_check(zx_plan_bucket_piece(layout.plan, b, k, &pc), "reading the plan");
            spans.emplace_back(pc.offset, pc.numel);
            const int64_t i = pc.param;
            bk.params.push_back(i);
            at::Tensor &p = params[i];
            if (params.cut(i)) {
                // Note [Cut parameters]: this piece's values; the parameter keeps storage of its own.
                bk.mixed = bk.mixed || bk.atomic;
                if (opts.copy_params) {
                    at::NoGradGuard ng;
                    (low ? src32 : bk.flat_param).narrow(0, pc.offset, pc.numel)
                        .copy_(p.detach().reshape(-1).narrow(0, pc.param_offset, pc.numel));
                }
                continue;
            }
            bk.mixed = bk.mixed || (bk.atomic && zx_plan_owner(layout.plan, i) < 0);
            zx_param_loc loc;
            zx_check(zx_plan_param(layout.plan, i, &loc), "reading the plan");
            at::Tensor v = bk.flat_param.narrow(0, loc.offset, loc.numel).view(p.sizes());
            if (opts.copy_params) {
                at::NoGradGuard ng;
                (low ? src32.narrow(0, loc.offset, loc.numel).view(p.sizes()) : v).copy_(p);
            }
            p.set_data(v);
            if (s3) units.param_views[i] = v;
            if (opts.stage <= 1) {
                at::Tensor &gv = grads.views[i];
                gv = bk.flat_grad.narrow(0, loc.offset, loc.numel).view(p.sizes());
                if (p.grad().defined()) {
                    if (!grad_in) bk.flat_grad.zero_();
                    grad_in = true;
                    gv.copy_(p.grad());
                }
            }
            p.mutable_grad() = at::Tensor();
        }
        if (bk.mixed) {
            for (int64_t i : bk.params)
                if (std::find(bk.groups.begin(), bk.groups.end(), layout.group_of[i]) == bk.groups.end())
                    bk.groups.push_back(layout.group_of[i]);
            bk.stepped.assign(bk.groups.size(), 0);
        }
        bk.gaps = gaps_of(std::move(spans), bi);
        if (!grad_in) release_bucket_grad(bk);   // (stages 2-3: none)
        if (opts.copy_params && low) {
            bk.flat_param.copy_(src32);                            // rounds to param_dtype
            view.master(bk).copy_(view.owned(src32, bk));
        } else if (opts.copy_params && (s3 || w.gather.quantized() || opts.offload)) {
            view.master(bk).copy_(view.owned(bk.flat_param, bk));
        }
        if (s3) {
            // Keep only this rank's slice (Note [Stage 3 parameter lifetime]).
            units.add(bk.unit, b);
            units.meter.add(bk.flat_param.nbytes());
            units.release_bucket(w, bk);
        }
    }
    if (s3) units.meter.reset_peak();
    TORCH_CHECK(!s3 || !params.any_cut(), "zero_ext: internal: stage 3 cuts no parameter");
    for (int64_t i = 0; i < n; i++) {
        if (!params.cut(i)) continue;
        // Note [Cut parameters]: storage of its own in param_dtype, filled from the buckets.
        at::Tensor &p = params[i];
        const at::Tensor grad = p.grad();
        p.set_data(at::empty(layout.shapes[i], pt));
        p.mutable_grad() = at::Tensor();
        if (grad.defined() && opts.stage <= 1)
            for (const zx_piece &pc : params.pieces(i))
                bucket_grad(w.buckets[pc.bucket]).narrow(0, pc.offset, pc.numel)
                    .copy_(grad.reshape(-1).narrow(0, pc.param_offset, pc.numel));
    }
    if (params.any_cut()) params.copy_cut(w.buckets, true);
    view.buffers.states.set_numel(plan_state_windows(layout, w.buckets));   // Note [State windows]
    // The gradient shard is allocated at the first backward (ShardView::grad).
}

std::unique_ptr<Offload> make_offload(const Layout &layout, int64_t num_buckets) {
    // Down: a reduce-scatter's slice, an all-to-all's whole receive buffer, or (one rank) the
    // whole bucket; up: a slice in param_dtype.
    const int64_t slice = layout.max_padded / std::max<int64_t>(layout.partitions, 1);
    const int64_t down = layout.opts.alltoall_reduce_scatter && layout.world > 1 ? layout.max_padded : slice;
    return std::make_unique<Offload>(layout.dev, layout.dtypes.reduce, down, layout.dtypes.param, slice, num_buckets);
}

void upload_unit_shard(UnitWork w, UnitStore &units) {
    units.param_shard = at::empty({w.layout().shard_numel}, w.layout().on_device(w.layout().dtypes.param));
    w.step.param_shard = units.param_shard;
    for (auto &bk : w.buckets) w.step.upload(bk);
}

}  // namespace zx
