// groups.h — Groups: the param groups one engine call covers (Note [Groups as an argument]).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zx {

// Note [Groups as an argument]
//   Several torch optimizers wrapped together (a list given to zeroify, or Muon beside
//   AdamW) each step, scale, cast, gather and zero only their own param groups. Every
//   engine call a wrapped optimizer makes for its groups names them (groups=part.groups
//   in zero_ext/optim.py); an empty list, the default, covers every group. The engine
//   keeps no "active groups" between calls: nothing needs resetting after a call that
//   raised, and a call from elsewhere (a checkpoint load, a hook) always covers all.
class Groups {
public:
    Groups() = default;   // every group
    explicit Groups(const std::vector<int64_t> &groups) {
        if (groups.empty()) return;
        int64_t most = 0;
        for (int64_t g : groups) {
            TORCH_CHECK(g >= 0, "zero_ext: internal: param group ", g, " is negative");
            most = std::max(most, g);
        }
        in_.assign((size_t)most + 1, 0);
        for (int64_t g : groups) in_[(size_t)g] = 1;
    }
    bool all() const { return in_.empty(); }
    bool has(int64_t g) const { return in_.empty() || (g < (int64_t)in_.size() && in_[(size_t)g]); }

private:
    std::vector<char> in_;   // per param group: covered (empty: every group)
};

}  // namespace zx
