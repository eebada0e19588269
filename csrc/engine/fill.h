// fill.h — this rank's state windows, planned once at construction (fill.cpp, Note [State
// windows]); the cut parameters' copies are Params::copy_cut (params.h).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/bucket.h"   // defines: Bucket
#include "engine/layout.h"   // defines: Layout

namespace zx {

// Sets every bucket's StateWindow; returns the elements of the flat states (the windows' total).
int64_t plan_state_windows(const Layout &layout, std::vector<Bucket> &buckets);

}  // namespace zx
