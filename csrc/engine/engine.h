// engine.h — the torch-facing ZeRO engine (stages 0-3): flat buckets, gradient
// readiness, asynchronous collectives on a c10d ProcessGroup, fused steps, and
// (stage 3) parameter buckets gathered per unit on demand.
//
// The C planner (core/zx_plan.c) decides every offset; the engine only turns
// the plan into tensors and drives the collectives. Python glue (zero_ext/)
// creates one Engine per zeroify() call and calls into it from thin hooks.
//
// The Engine facade and the owners it holds, each in its own files (csrc/engine/):
//   engine.cpp       the facade's calls handed to an owner: GradReducer, UnitStore, the Stepper,
//                    MasterSplit, the sequence check, Secondary (construction and stats: build.cpp)
//   build.cpp        the buckets, shards and views built from the Layout; teardown; fragment views, stats
//   layout.h/.cpp    Layout, fixed at construction (Layout::make, no tensors, no process group): options
//                    (options.h), device and dtypes, the plan, this rank's place, each parameter's group,
//                    shape and bucket
//   stats.h          what stats() reports, as plain data (the binding makes the dicts)
//   fill.h/.cpp      cut parameters copied to and from their pieces (Params::copy_cut); state windows
//   grad_reducer.h   GradReducer: backward's reductions and the reduce kind, chosen once (reducer.cpp:
//                    gradient readiness, launch and landing of each bucket's reduction, zero_grad),
//                    on what the engine lends it per call (ReduceWork); it holds:
//     sharded_grads.h  what .grad shows: stage 0-1 views, the wrappers after backward (Note [Sharded gradients])
//     backward_pass.h  where a backward stands (readiness, launch order, no_sync, counters)
//     grad_ring.h      the gradient slots of stages 2-3
//     reduce_groups.h  stage 3: small buckets' gradients reduced together (Note [Coalesced gradient reductions])
//     quant_reduce.h/.cpp grad_quant's codes, scales and residuals (Note [Quantized gradient reduction])
//   param_gather.h   ParamGather: the gather kind (exact / param_quant, chosen once); gatherer.cpp: stages
//                    1-2's gathers (which buckets, launched, waited for), on what the engine lends (GatherWork)
//     quant_gather.h/.cpp param_quant's int8 records (Note [Quantized parameter gather])
//   stepper.h/.cpp   Stepper: optimizer steps (one loop, Note [One fused step]), gradient norm and
//                    scaling, casts; lent the buckets and the shard per call, it keeps no state
//   fused_ops.h      AdamOp, SgdOp: the fused optimizers as one interface for that loop
//   atomic.cpp       tensor-atomic parameters: the owner's whole-tensor views, their balance (AtomicStats)
//   shard_view.h/.cpp ShardView: a bucket's slices of this rank's shard (gradient, master, low-precision copy)
//   groups.h         Groups: the param groups a call covers (Note [Groups as an argument])
//   comm.h/.cpp      Communicator: collectives on the process group, counters
//   check.h          the C core's statuses as exceptions (zx_check), ISA names, the plan's fragments
//   sequence.h/.cpp  the collective sequence check: divergent ranks named, not hung
//   bucket.h         Bucket: one bucket of the plan as tensors (its fixed shape, buffers, stage 3's
//                    full parameters); GatherGroup
//   owners of one piece of state each, used by the files above:
//     params.h         the parameters: their tensors, where each lies; cut parameters (Note [Cut parameters])
//     shard_buffers.h  ShardBuffers: this rank's gradient sums, master (master_split.h: as remainders)
//                      and optimizer states (optimizer_states.h), step_in_backward's landing
//     unit_store.h     UnitStore, stage 3: each unit's buckets and parameter views, offload's parameter shard,
//                      gathered bytes (gather_meter.h), frozen parameters (frozen_params.h), node parts (secondary.h);
//                      units.cpp and frozen.cpp: gathered (alone or coalesced), released, opened at fp32,
//                      committed, on what the engine lends per call (UnitWork)
//     step_book.h      StepBook: gradients seen, the groups a step covers, step counts, runs, the backward step
//                      (unused.cpp: Note [Unused parameters])
//   secondary.h/.cpp Secondary, stage 3: node-local secondary parts for backward gathers (node_size)
//   kernels.h, kernels_cpu.cpp, kernels_cuda.cpp
//                    the per-device kernel table (Note [Kernel table])
//   offload.h/.cpp   offload="cpu": host rings, copy stream, landing worker (Note [Optimizer offload])
//   backward_step.cpp Stepper::land: each bucket steps as its gradient lands (Note [Step in backward])
//   master_split.h/.cpp MasterSplit: the bf16 stage 0-2 master as a remainder (Note [Split master in the engine])
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/zx_core.h"
#include "engine/bucket.h"    // defines: Bucket, BucketShape, StateWindow, FullParams, GatherGroup
#include "engine/comm.h"      // defines: Communicator, CommCounter, ProcessGroupPtr
#include "engine/fill.h"      // defines: plan_state_windows (Note [State windows])
#include "engine/grad_reducer.h"   // defines: GradReducer (backward's reductions), ReduceKind
#include "engine/groups.h"    // defines: Groups (Note [Groups as an argument])
#include "engine/kernels.h"   // defines: Kernels, make_kernels
#include "engine/layout.h"    // defines: Layout, and (options.h) EngineOptions, Dtypes
#include "engine/offload.h"   // defines: Offload (offload="cpu")
#include "engine/shard_buffers.h"   // defines: ShardBuffers (gradient, master, split master, optimizer states)
#include "engine/shard_view.h"     // defines: ShardView (a bucket's slices of the shard)
#include "engine/stepper.h"        // defines: Stepper (Note [One fused step]); AdamOp, SgdOp, kStateSeed
#include "engine/params.h"        // defines: Params (the tensors; Note [Cut parameters])
#include "engine/param_gather.h"   // defines: ParamGather (the gather kind, stage 1-2 gathers in flight)
#include "engine/step_book.h"      // defines: StepBook, StepRun (Note [Unused parameters])
#include "engine/unit_store.h"     // defines: UnitStore (stage 3: also FrozenParams, GatherMeter, Secondary)
#include "engine/stats.h"          // defines: EngineStats, AtomicStats, OffloadStats (Note [Engine stats])

namespace zx {

// Note [Fragment views] (build.cpp): one piece of a parameter in this rank's shard, as
// Python asks for it (checkpoints, loads, edits, the generic step).
struct FragmentView {
    int64_t param;                     // engine parameter index (frozen: frozen index)
    int64_t param_offset;              // first element inside the flattened parameter
    int64_t bucket;                    // its bucket: index into param_shards() (frozen: -1)
    int64_t slice_offset;              // first element inside that bucket's shard slice (frozen: the frozen shard)
    int64_t numel;
    at::Tensor master;                 // (numel,) view: the fp32 master (frozen: the param_dtype shard)
};

class Engine : private ReducerHooks {
public:
    // units: stage 3 only, one unit id per parameter (0 = the root unit).
    Engine(std::vector<at::Tensor> params, std::vector<int64_t> groups, std::vector<int64_t> units,
           c10::optional<ProcessGroupPtr> pg, EngineOptions opts);
    ~Engine();

    // --- backward ---
    void mark_ready(int64_t i);        // param i's gradient is final for this backward
    void finalize_backward();          // end of backward: unused params, launch the rest
    // Note [Sharded gradients] (zero_ext/sharded_grad.py): stages 1-3 show each
    // parameter's gradient as a storage-less tensor that knows it is sharded, from the
    // end of a reducing backward until the next forward (hide) or zero_grad.
    void set_grad_wrappers(std::vector<at::Tensor> wrappers) { reducer_.grads().set(std::move(wrappers)); }
    void hide_sharded_grads();
    int64_t grad_generation() const { return reducer_.pass().generation(); }   // changes when the gradients do
    void wait_reductions();            // block until every launched reduction is done
    void set_require_sync(bool sync) { reducer_.pass().set_require_sync(sync); }
    bool require_sync() const { return reducer_.pass().require_sync(); }

    // --- optimizer ---
    // `groups` (Note [Groups as an argument]): the param groups a call covers, one wrapped
    // optimizer's (empty: all).
    // Fused AdamW/Adam step over this rank's shard (Note [One fused step]). hparams: one per
    // param group. ctl / steps (may be undefined): the step control and the per-group step
    // counts in the parameters' memory (Note [Step control], csrc/core/zx_step_control.h).
    void step_adam(const std::vector<zx_adam_hparams> &hparams, const std::vector<int64_t> &groups = {},
                   const at::Tensor &ctl = {}, const at::Tensor &steps = {});
    void step_sgd(const std::vector<zx_sgd_hparams> &hparams, const std::vector<int64_t> &groups = {},
                  const at::Tensor &ctl = {}, const at::Tensor &steps = {});
    // Generic path: this rank's parameter / gradient shard views, one per bucket.
    std::vector<at::Tensor> param_shards(const std::vector<int64_t> &groups = {});
    std::vector<at::Tensor> grad_shards(const std::vector<int64_t> &groups = {});
    std::vector<int64_t> bucket_groups(const std::vector<int64_t> &groups = {});
    // Where rank r's shard holds pieces of parameters (any r, from the plan):
    // (param index, offset in the flattened parameter, offset in the flat shard, numel).
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> fragments(int64_t r) const {
        return layout_.fragments(r);
    }
    // Note [Fragment views]: this rank's fragments of the groups' buckets, with views of the
    // master (joined first with a split master); frozen: of the stage-3 frozen shard.
    // masters=false: no master views (and no join): only where the pieces lie.
    std::vector<FragmentView> fragment_views(bool masters = true, const std::vector<int64_t> &groups = {});
    std::vector<FragmentView> frozen_fragment_views() const;
    // After the fp32 master shards (param_shards()) were overwritten, e.g. by a
    // checkpoint load: make the parameters every rank computes with equal them again.
    void publish_params();
    // Stages 0-2: parameters were edited in place (gathered_parameters): fold
    // the edits into the fp32 master (only changed elements, as commit_unit).
    void absorb_param_edits();
    void scale_grads(double factor, const std::vector<int64_t> &groups = {});   // grad shards *= factor
    // Local sum of squares over the gradient shard (times scale) and inf/nan
    // count, all-reduced across ranks in stages 1-2. Returns (sumsq, nonfinite).
    std::pair<double, int64_t> grad_sumsq(double scale);
    // The same scan into out2 (float32 [sumsq, nonfinite] on the parameters'
    // device, overwritten), all-reduced in stream order: nothing read back.
    void grad_sumsq_into(at::Tensor out2);
    // Write the low-precision copy of the fp32 master shard where the next
    // gather reads it (the fused steps do this themselves, in the same pass).
    void cast_masters(const std::vector<int64_t> &groups = {});
    // Note [Split master in the engine] (master_split.h): keep the master shard as the
    // bf16 parameters' remainder from now on (zeroify, when master_remainder applies).
    void enable_split_master();
    bool split_master() const { return shard_.split != nullptr; }
    // With a split master: make the fp32 master shard exist (authoritative) until the next step
    // or cast (e.g. before parameters are edited, so that absorb folds only the changed elements).
    void join_masters();
    // Where the master, the states and the gradient shard live: the parameters' device, or the host with offload.
    at::Device shard_device() const { return layout_.opts.offload ? at::Device(at::kCPU) : layout_.dev; }
    void all_gather_params(const std::vector<int64_t> &groups = {});   // launch: slices -> full buckets
    void wait_params();                // block until the parameter gather is done
    // Parameters are needed now (forward, reads): launch the gathers of mixed buckets
    // some of whose groups stepped (Note [Cut parameters]), then wait_params() unless
    // wait is false (Note [Gathers waited per module] in zero_ext/param_waits.py).
    void flush_params(bool wait = true);
    // Wait for the stage 1-2 parameter gathers of these buckets only (all of them when
    // some parameter is cut across buckets); bucket_of_params(): each parameter's bucket.
    void wait_param_buckets(const std::vector<int64_t> &buckets);
    const std::vector<int64_t> &bucket_of_params() const { return layout_.bucket_of; }
    void zero_grad(bool set_to_none, const std::vector<int64_t> &groups = {});
    // Note [Unused parameters] (unused.cpp): agree across ranks (one small
    // all-reduce) which parameters got a gradient, and advance their step counts.
    // Call once per optimizer step, before step_adam/step_sgd or a generic step.
    // advance=false: several wrapped optimizers; each advances its own parameters'
    // counts with advance_steps(groups), when it steps.
    void begin_step(bool advance = true);
    void advance_steps(const std::vector<int64_t> &groups = {});   // the stepped parameters' step counts
    std::vector<bool> stepped_params() const { return book_.stepped_params(); }   // per parameter: stepped by this step
    // Note [Unused parameters]: whether the next begin_step() agrees across ranks on
    // which parameters got a gradient; if not, every parameter must have one here:
    // locally_unused() lists those that have none (the caller raises, naming them).
    bool agrees_unused() const { return book_.agrees(); }
    std::vector<int64_t> locally_unused() const { return book_.locally_unused(); }
    bool grads_since_step() const { return book_.grads_since_step(); }
    std::vector<int64_t> param_steps();         // per parameter: optimizer steps taken
    void set_param_steps(const std::vector<int64_t> &steps);
    void broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src);

    // --- tensor-atomic parameters (atomic.cpp) ---
    // This rank's whole tensors of the groups: (param index, fp32 master view, gradient
    // view), shaped as the parameter, in layout order.
    std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> owned_tensors(const std::vector<int64_t> &groups = {});
    // Owner rank of each parameter (-1: element-granular).
    std::vector<int64_t> owners() const;
    AtomicStats atomic_stats() const;   // stats()["atomic"]
    // Parameters cut into pieces to fill atomic buckets (Note [Cut parameters]).
    std::vector<int64_t> cut_params() const;

    // --- stage 3: UnitStore's units and frozen parameters (unit_store.h says what each does) ---
    bool gather_unit(int64_t u, bool wait);   // true: it had been launched already (prefetched)
    void gather_units(const std::vector<int64_t> &units);
    void release_unit(int64_t u, bool keep = false);
    void commit_unit(int64_t u, int64_t src);   // src: the group rank whose edits every rank takes
    void open_unit_fp32(int64_t u);
    bool unit_gathered(int64_t u) const { return units_.unit_gathered(buckets_, u); }
    bool unit_requested(int64_t u) const { return units_.unit_requested(buckets_, u); }
    int64_t unit_numel(int64_t u) const { return units_.unit_numel(buckets_, u); }
    int64_t num_units() const { return units_.count(); }
    // Stage 3, node_size: this rank's node group (L ranks); call once, right after construction.
    void enable_hierarchy(ProcessGroupPtr node_pg);
    // Note [Stage 3 frozen parameters]; add_frozen: once, right after construction.
    void add_frozen(std::vector<at::Tensor> params, std::vector<int64_t> units,
                    std::vector<std::string> names = {});
    bool unit_has_frozen(int64_t u) const { return units_.frozen.of_unit(u) != nullptr; }
    void release_frozen(int64_t u);
    at::Tensor frozen_shard() const { return units_.frozen.shard(); }   // this rank's slices, param_dtype
    // As fragments(), over frozen_shard(): (frozen index, offset in it, offset in the shard, numel).
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> frozen_fragments(int64_t r) const;
    int64_t frozen_shard_bytes() const { return units_.frozen.shard_bytes(); }

    // --- state ---
    // Flat per-element optimizer state (exp_avg, ...), created zero-filled on demand,
    // over the state windows only (Note [State windows]): elements of tensor-atomic
    // parameters, whose optimizer keeps its own per-tensor state, have none.
    // exp_avg / exp_avg_sq are bfloat16 with state_dtype="bf16" (Note [bf16 optimizer states]).
    at::Tensor state(const std::string &name);
    // Per bucket: (first element of this rank's window inside its slice, elements,
    // offset of the window in the flat states).
    std::vector<std::tuple<int64_t, int64_t, int64_t>> state_windows() const;
    std::map<std::string, at::Tensor> &states() { return shard_.states.all(); }
    // Note [Engine stats] (engine/stats.h): bytes, buffers, collectives; the binding makes it a dict.
    EngineStats stats() const;
    std::optional<OffloadStats> offload_stats() const;   // offload="cpu": host bytes and copies (none without)

    // --- step in backward (engine.cpp, backward_step.cpp: Note [Step in backward]) ---
    // The fused step every bucket of the coming reducing backward takes as its gradient
    // lands: one set of hyperparameters per param group (their step counts are ignored:
    // backward_steps() + 1).
    void set_backward_step_adam(std::vector<zx_adam_hparams> hps);
    void set_backward_step_sgd(std::vector<zx_sgd_hparams> hps);
    int64_t backward_steps() const { return book_.backward.steps; }   // optimizer steps taken in backward
    // Note [Communication delay] (comm.cpp): every collective of this engine (node group
    // included) takes at least ms longer; serialize: each is waited for at its launch.
    void set_comm_delay(double ms, bool serialize);
    std::string describe_plan() const { return layout_.describe(); }
    int64_t rank() const { return layout_.rank; }
    int64_t world_size() const { return layout_.world; }
    int64_t partitions() const { return layout_.partitions; }
    double grad_divisor() const { return layout_.grad_divisor(); }   // what shard gradients must be divided by
    std::string isa_name() const { return zx_isa_name(kernels_.isa); }

    // --- collective sequence check (Note [Collective sequence check], sequence.h) ---
    // store: the process group's store, for watched waits (None: checkpoints only).
    // group: the digests' own gloo group (None: the engine's); every_phase: exchange at
    // every phase (Note [Exchanges on deviation]). Parameters are named by param_names.
    // id: this engine's among the process's engines, the same on every rank (zeroify counts them).
    void enable_sequence_check(c10::optional<StorePtr> store, double patience_s,
                               c10::optional<ProcessGroupPtr> group, bool every_phase, int64_t id);
    // A SeqPhase (forward, backward, clip, step; the phases of Python collectives, which
    // exchange at once), or kUnitNeedBase + unit.
    void sequence_mark(int64_t phase);
    int64_t sequence_exchanges() const { return comm_.seq.exchanges(); }
    // Exchange digests now: a rank about to raise for something every rank should
    // see alike (Note [Unused parameters]) first checks that the others are here too.
    void sequence_sync();

    // "parameter 'blocks.0.attn.weight'" (or "parameter 12" without names), for
    // messages (Note [Parameter names in messages]); frozen_pname: a frozen one.
    std::string pname(int64_t i) const { return layout_.pname(i); }
    std::string frozen_pname(int64_t i) const { return units_.frozen.name(i); }

private:
    // ReducerHooks: what backward's reductions call back (grad_reducer.h)
    void release_bucket(Bucket &bk) override { units_.release_bucket(unit_work(), bk); }   // stage 3
    void release_pass() override { units_.release_pass(unit_work()); }   // stage 3: after a backward
    at::Tensor master_slice(Bucket &bk);   // the fp32 master of bk's slice, a split master joined first
    void ensure_step_tables();         // book_ has read this rank's fragments from the plan
    // Note [Split master in the engine]: an fp32 master shard joined on demand (authoritative
    // while it exists), and settled back (rounded into the parameters, split, freed).
    void settle_masters();
    // This rank's shard seen bucket by bucket (shard_view.h), and the Stepper lent it and the
    // buckets for one call (stepper.h, Note [One fused step]); made per call, owning nothing.
    ShardView view() { return {layout_, shard_, off_.get()}; }
    Stepper stepper() { return {buckets_, view(), kernels_, book_, units_.param_shard}; }
    void before_step();                // what a fused step waits for: reductions, gathers, a split master settled
    // step_in_backward: bucket bk's fused step on its reduced gradient slice grad (sums)
    void step_landed(Bucket &bk, const at::Tensor &grad) override;
    // What GradReducer is lent for one call (grad_reducer.h), as the Stepper is.
    ReduceWork reduce_work() { return {buckets_, params_, comm_, kernels_, view(), book_, *this}; }
    // What ParamGather (stages 1-2) and UnitStore are lent for one call (param_gather.h, unit_store.h).
    GatherWork gather_work() { return {buckets_, params_, comm_, view()}; }
    UnitWork unit_work() { return {buckets_, params_, comm_, kernels_, gather_, stepper()}; }

    Params params_;                        // the parameters' tensors and where each lies (Note [Cut parameters])
    std::vector<Bucket> buckets_;
    Layout layout_;                        // fixed at construction: options, device, dtypes, the plan, this rank
    Communicator comm_;
    KernelTables kernels_;                 // Note [Kernel table]: the device's, and the host's with offload
    std::unique_ptr<Offload> off_;          // offload="cpu" (Note [Optimizer offload]), else null
    GradReducer reducer_;                  // backward's reductions: what .grad shows, the pass, the ring, in flight
    ShardBuffers shard_;                   // this rank's gradient sums, master (or remainders) and states
    UnitStore units_;                      // stage 3: units' buckets and views, frozen parameters, node parts
    StepBook book_;                        // gradients seen, steps, runs (Note [Unused parameters])
    ParamGather gather_;                   // the gather kind (param_quant's or exact); stages 1-2: gathers in flight
};

}  // namespace zx
