// frozen_params.h — the state of stage 3's frozen parameters (Note [Stage 3 frozen
// parameters], frozen.cpp): the parameters, their full views and names, one bucket per
// unit that has any, and this rank's slices of those buckets. Layout only: the engine
// gathers, releases and commits the buckets (frozen.cpp, units.cpp) through it.
#pragma once

#include <torch/types.h>

#include <string>
#include <tuple>
#include <vector>

#include "engine/bucket.h"          // defines: Bucket
#include "engine/fragment_view.h"   // defines: FragmentView

namespace zx {

class FrozenParams {
public:
    // Groups params by unit (units[i] of params[i], each below unit_count), in the order
    // given, one bucket per unit, each parameter at a multiple of piece_align elements, each
    // bucket padded to a multiple of quantum and cut into parts slices; allocates this rank's
    // slices (zeros, `options`). Once per engine.
    void plan(std::vector<at::Tensor> params, const std::vector<int64_t> &units, std::vector<std::string> names,
              int64_t unit_count, int64_t parts, int64_t quantum, int64_t piece_align,
              const at::TensorOptions &options);

    bool empty() const { return params_.empty(); }
    int64_t size() const { return (int64_t)params_.size(); }
    std::string name(int64_t i) const { return name_in(names_, i); }   // "frozen parameter 'x'" (or its index)
    static std::string name_in(const std::vector<std::string> &names, int64_t i);

    std::vector<Bucket> &buckets() { return buckets_; }
    const std::vector<Bucket> &buckets() const { return buckets_; }
    Bucket *of_unit(int64_t u);                 // unit u's bucket, or null
    const Bucket *of_unit(int64_t u) const;
    int64_t index(const Bucket &bk) const { return of_unit_[bk.unit]; }   // among buckets()

    at::Tensor &param(int64_t i) { return params_[i]; }
    // Bucket bk's parameters read their elements of flat (the bucket's gathered storage,
    // or an fp32 staging copy of it); point_home: at their own views of bk.flat_param.
    void point_at(const Bucket &bk, const at::Tensor &flat);
    void point_home(const Bucket &bk);
    void set_home(int64_t i, at::Tensor view) { views_[i] = std::move(view); }
    int64_t offset(int64_t i) const { return offset_[i]; }

    at::Tensor shard() const { return shard_; }   // this rank's slices, param_dtype
    at::Tensor slice(const Bucket &bk) const { return shard_.narrow(0, bk.shard_offset, bk.slice_numel); }
    int64_t shard_bytes() const { return shard_.defined() ? (int64_t)shard_.nbytes() : 0; }
    // As Layout::fragments(r): (frozen index, offset in it, offset in the shard, numel).
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> fragments(int64_t r) const;
    std::vector<FragmentView> fragment_views(int64_t r) const;   // the same, over views of shard()

private:
    std::vector<at::Tensor> params_, views_;   // the parameters; their views of their bucket
    std::vector<std::string> names_;           // for messages (empty: by index)
    std::vector<int64_t> offset_;              // each one's offset in its bucket
    std::vector<int64_t> of_unit_;             // unit -> its bucket, or -1
    std::vector<Bucket> buckets_;
    at::Tensor shard_;                         // (sum of the slices,) param_dtype
};

}  // namespace zx
