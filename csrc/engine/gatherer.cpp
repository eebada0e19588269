// gatherer.cpp — parameters every rank computes with, stages 0-2: which buckets are
// all-gathered after a step and which are still owed one (ParamGather::due, pending); the
// engine launches, flushes and waits for them, folds edits back into the master and
// publishes a checkpoint's masters (engine.cpp). Stage 3's units: units.cpp.
#include "engine/param_gather.h"

#include <algorithm>

namespace zx {

std::vector<int64_t> ParamGather::due(std::vector<Bucket> &buckets, const Groups &groups) {
    std::vector<int64_t> out;
    for (int64_t b = (int64_t)buckets.size() - 1; b >= 0; b--) {
        Bucket &bk = buckets[b];
        if (bk.mixed) {
            // Note [Cut parameters]: gathered once every group inside has stepped.
            bool all = true;
            for (size_t k = 0; k < bk.groups.size(); k++) {
                if (groups.has(bk.groups[k])) bk.stepped[k] = 1;
                all = all && bk.stepped[k];
            }
            if (!all) continue;
            std::fill(bk.stepped.begin(), bk.stepped.end(), 0);
        } else if (!groups.has(bk.group)) {
            continue;
        }
        out.push_back(b);
    }
    return out;
}

std::vector<int64_t> ParamGather::pending(std::vector<Bucket> &buckets) {
    std::vector<int64_t> out;
    for (int64_t b = 0; b < (int64_t)buckets.size(); b++) {
        std::vector<char> &st = buckets[b].stepped;
        if (std::find(st.begin(), st.end(), 1) == st.end()) continue;
        std::fill(st.begin(), st.end(), 0);
        out.push_back(b);
    }
    return out;
}

}  // namespace zx
