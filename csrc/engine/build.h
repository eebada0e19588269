// build.h — how an Engine is built (build.cpp), step by step; Engine's constructor
// (engine.cpp) calls these in order, lending each the owners it fills:
//   plan_engine          every input checked (a message that names the fix), then the Layout
//   make_kernel_tables   the kernels of the parameters' device (and of the host, offload)
//   GradReducer::configure, ParamGather::configure   the reduce kind and the gather kind, once
//   build_buckets        the buckets as tensors; parameters (and stage 0-1 gradients) as views;
//                        the fp32 master; stage 3 keeps only this rank's slices
//   make_offload, upload_unit_shard   offload="cpu": the host rings, and stage 3's device copy
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "engine/kernels.h"         // defines: KernelTables
#include "engine/layout.h"          // defines: Layout, EngineOptions
#include "engine/offload.h"         // defines: Offload
#include "engine/params.h"          // defines: Params
#include "engine/sharded_grads.h"   // defines: ShardedGrads
#include "engine/unit_store.h"      // defines: UnitStore, UnitWork

namespace zx {

// The Layout of these parameters (groups: one per parameter; units: stage 3's, one per
// parameter) for this rank of world, once every input is checked.
Layout plan_engine(const Params &params, const std::vector<int64_t> &groups, const std::vector<int64_t> &units,
                   const EngineOptions &opts, int64_t rank, int64_t world);
KernelTables make_kernel_tables(const Layout &layout);
// Fills w.buckets, the master (w.shard()), the state windows' size, grads' views (stages 0-1)
// and, stage 3, the units' buckets and parameter views; parameters become views into buckets.
void build_buckets(UnitWork w, UnitStore &units, ShardedGrads &grads);
std::unique_ptr<Offload> make_offload(const Layout &layout, int64_t num_buckets);
void upload_unit_shard(UnitWork w, UnitStore &units);   // stage 3 with offload: what unit gathers read

}  // namespace zx
