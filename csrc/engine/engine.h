// engine.h — the torch-facing ZeRO engine (stages 0-3): a facade over the owners of its
// state (csrc/engine/README.md maps them, file by file). The C planner (core/zx_plan.c)
// decides every offset and the Layout holds the plan; GradReducer runs the backward's
// reductions, ParamGather stages 1-2's gathers, UnitStore stage 3's units, the Stepper the
// fused steps. Each of Engine's calls hands the work to one owner, lending it what it needs
// for the call (engine.cpp); the constructor builds them (build.h). Python glue (zero_ext/)
// creates one Engine per zeroify() call and calls into it from thin hooks (binding.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "engine/comm.h"            // defines: Communicator, ProcessGroupPtr, StorePtr
#include "engine/grad_reducer.h"    // defines: GradReducer, ReducerHooks, ReduceWork
#include "engine/kernels.h"         // defines: KernelTables
#include "engine/layout.h"          // defines: Layout, EngineOptions
#include "engine/offload.h"         // defines: Offload
#include "engine/param_gather.h"    // defines: ParamGather, GatherWork
#include "engine/params.h"          // defines: Params
#include "engine/shard_buffers.h"   // defines: ShardBuffers
#include "engine/stats.h"           // defines: EngineStats, AtomicStats
#include "engine/step_book.h"       // defines: StepBook
#include "engine/stepper.h"         // defines: Stepper, FragmentView, ShardView
#include "engine/unit_store.h"      // defines: UnitStore, UnitWork

namespace zx {

class Engine : private ReducerHooks {
public:
    // units: stage 3 only, one unit id per parameter (0 = the root unit).
    Engine(std::vector<at::Tensor> params, std::vector<int64_t> groups, std::vector<int64_t> units,
           c10::optional<ProcessGroupPtr> pg, EngineOptions opts);
    ~Engine();

    // What is fixed or only counted, read as it is: the plan (rank, world, fragments(r), ...),
    // the step book (Note [Unused parameters]), stage 3's units and frozen parameters.
    const Layout &layout() const { return layout_; }
    const StepBook &book() const { return book_; }
    const UnitStore &units() const { return units_; }

    // --- backward: GradReducer (reducer.cpp; Note [Sharded gradients] for the wrappers) ---
    void mark_ready(int64_t i, const at::Tensor &grad = {});   // param i's gradient is final for this backward
    void finalize_backward();          // end of backward: unused params, launch the rest
    void wait_reductions();            // block until every launched reduction is done
    void set_grad_wrappers(std::vector<at::Tensor> wrappers) { reducer_.grads().set(std::move(wrappers)); }
    void hide_sharded_grads();
    int64_t grad_generation() const { return reducer_.pass().generation(); }   // changes when the gradients do
    void set_require_sync(bool sync) { reducer_.pass().set_require_sync(sync); }
    bool require_sync() const { return reducer_.pass().require_sync(); }
    void zero_grad(bool set_to_none, const std::vector<int64_t> &groups = {});

    // --- optimizer: the Stepper (stepper.h), after the reductions, gathers and a split master ---
    // groups (Note [Groups as an argument]): the param groups a call covers (empty: all).
    // hparams: one per param group; ctl / steps (may be undefined): Note [Step control].
    void step_adam(const std::vector<zx_adam_hparams> &hparams, const std::vector<int64_t> &groups = {},
                   const at::Tensor &ctl = {}, const at::Tensor &steps = {});
    void step_sgd(const std::vector<zx_sgd_hparams> &hparams, const std::vector<int64_t> &groups = {},
                  const at::Tensor &ctl = {}, const at::Tensor &steps = {});
    // Note [Step in backward]: the fused step each bucket of the coming reducing backward takes.
    void set_backward_step_adam(std::vector<zx_adam_hparams> hps);
    void set_backward_step_sgd(std::vector<zx_sgd_hparams> hps);
    // The generic path: this rank's master / gradient shard views, one per bucket of the groups.
    std::vector<at::Tensor> param_shards(const std::vector<int64_t> &groups = {});
    std::vector<at::Tensor> grad_shards(const std::vector<int64_t> &groups = {});
    std::vector<int64_t> bucket_groups(const std::vector<int64_t> &groups = {});
    // Note [Fragment views]; masters=false: where the pieces lie only (no master joined).
    std::vector<FragmentView> fragment_views(bool masters = true, const std::vector<int64_t> &groups = {});
    void scale_grads(double factor, const std::vector<int64_t> &groups = {});   // grad shards *= factor
    // The gradient shard's sum of squares (times scale) and inf/nan count, over every rank:
    // returned, or into out2 (float32 [sumsq, nonfinite] on the device) in stream order.
    std::pair<double, int64_t> grad_sumsq(double scale);
    void grad_sumsq_into(at::Tensor out2);
    // The low-precision copy of the master, where the next gather reads it (fused steps do this).
    void cast_masters(const std::vector<int64_t> &groups = {});
    // Note [Split master in the engine]: keep the master as the bf16 parameters' remainder from
    // now on; join_masters(): the fp32 master exists (authoritative) until the next step or cast.
    void enable_split_master();
    bool split_master() const { return shard_.split != nullptr; }
    void join_masters();
    // Where the master, the states and the gradient shard live: the device, or the host (offload).
    at::Device shard_device() const { return layout_.opts.offload ? at::Device(at::kCPU) : layout_.dev; }
    // Note [Unused parameters] (unused.cpp): once per optimizer step, agree across ranks which
    // parameters got a gradient; advance=false: each wrapped optimizer calls advance_steps(groups).
    void begin_step(bool advance = true);
    void advance_steps(const std::vector<int64_t> &groups = {});
    void set_param_steps(const std::vector<int64_t> &steps);

    // --- parameters every rank computes with (stages 1-2: ParamGather, gatherer.cpp) ---
    // After the master shards were overwritten (a checkpoint load): the parameters equal them again.
    void publish_params();
    // Stages 0-2: parameters were edited in place: fold the edits (the changed elements) into the master.
    void absorb_param_edits();
    void all_gather_params(const std::vector<int64_t> &groups = {});   // launch: slices -> full buckets
    void wait_params();
    // Launch the gathers of mixed buckets some of whose groups stepped (Note [Cut parameters]),
    // then wait unless wait is false (Note [Gathers waited per module], zero_ext/param_waits.py).
    void flush_params(bool wait = true);
    void wait_param_buckets(const std::vector<int64_t> &buckets);   // these buckets' gathers only
    void broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src);

    // --- tensor-atomic parameters (atomic.cpp) ---
    // This rank's whole tensors of the groups: (param index, fp32 master view, gradient view).
    std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> owned_tensors(const std::vector<int64_t> &groups = {});
    std::vector<int64_t> cut_params() const;   // Note [Cut parameters]
    AtomicStats atomic_stats() const;

    // --- stage 3: UnitStore (unit_store.h says what each does; units.cpp, frozen.cpp) ---
    bool gather_unit(int64_t u, bool wait);   // true: it had been launched already (prefetched)
    void gather_units(const std::vector<int64_t> &units);
    void release_unit(int64_t u, bool keep = false);
    void commit_unit(int64_t u, int64_t src);   // src: the group rank whose edits every rank takes
    void open_unit_fp32(int64_t u);
    std::vector<at::Tensor> unit_part(int64_t u);   // Note [Reading alone]: what this rank serves of u
    void install_unit(int64_t u, const std::vector<std::vector<at::Tensor>> &parts);   // u from served parts
    bool unit_gathered(int64_t u) const { return units_.unit_gathered(buckets_, u); }
    bool unit_requested(int64_t u) const { return units_.unit_requested(buckets_, u); }
    int64_t unit_numel(int64_t u) const { return units_.unit_numel(buckets_, u); }
    // Note [Hierarchical partitioning]: this rank's node group; once, right after construction.
    void enable_hierarchy(ProcessGroupPtr node_pg);
    // Note [Stage 3 frozen parameters]: once, right after construction.
    void add_frozen(std::vector<at::Tensor> params, std::vector<int64_t> units, std::vector<std::string> names = {});
    void release_frozen(int64_t u);
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> frozen_fragments(int64_t r) const;

    // --- state and reports ---
    // Note [State windows]: the flat per-element optimizer state `name`, made zero-filled on demand.
    at::Tensor state(const std::string &name);
    // Per bucket: (its window's first element in its slice, elements, offset in the flat states).
    std::vector<std::tuple<int64_t, int64_t, int64_t>> state_windows() const;
    std::map<std::string, at::Tensor> &states() { return shard_.states.all(); }
    EngineStats stats() const;   // Note [Engine stats]
    std::string isa_name() const { return zx_isa_name(kernels_.isa); }
    // Note [Communication delay] (comm.cpp): every collective (node group too) takes ms longer.
    void set_comm_delay(double ms, bool serialize);

    // --- Note [Collective sequence check] (sequence.h) ---
    void enable_sequence_check(c10::optional<StorePtr> store, double patience_s,
                               c10::optional<ProcessGroupPtr> group, bool every_phase, int64_t id,
                               c10::optional<StorePtr> meet = c10::nullopt);
    // A SeqPhase, or kUnitNeedBase + unit; servable: Note [Reading alone]. Whether this rank is away.
    bool sequence_mark(int64_t phase, bool servable = false);
    bool sequence_away() const { return comm_.seq.away(); }
    bool sequence_diverged() const { return comm_.seq.diverged(); }
    int64_t sequence_exchanges() const { return comm_.seq.exchanges(); }
    void sequence_sync();                // exchange digests now (before a rank raises)

private:
    // ReducerHooks: what backward's reductions call back (grad_reducer.h)
    void release_bucket(Bucket &bk) override { units_.release_bucket(unit_work(), bk); }   // stage 3
    void release_pass() override { units_.release_pass(unit_work()); }   // stage 3: after a backward
    void step_landed(Bucket &bk, const at::Tensor &grad) override;   // step_in_backward
    at::Tensor master_slice(Bucket &bk);   // the fp32 master of bk's slice, a split master joined first
    void ensure_step_tables();         // book_ has read this rank's fragments from the plan
    void settle_masters();             // a joined split master rounded into the parameters, split, freed
    void before_step();                // what a fused step waits for

    // What each owner is lent for one call, made per call and owning nothing: this rank's
    // shard seen bucket by bucket (shard_view.h), the Stepper (stepper.h), GradReducer's,
    // ParamGather's and UnitStore's work (grad_reducer.h, param_gather.h, unit_store.h).
    ShardView view() { return {layout_, shard_, off_.get()}; }
    Stepper stepper() { return {buckets_, view(), kernels_, book_, units_.param_shard}; }
    ReduceWork reduce_work() { return {buckets_, params_, comm_, kernels_, view(), book_, *this}; }
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
