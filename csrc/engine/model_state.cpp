// model_state.cpp — see model_state.h.
#include "engine/model_state.h"

#include <algorithm>
#include <stdexcept>

namespace zx {

ModelState model_state_bytes(const std::vector<int64_t> &bucket_group, const std::vector<int64_t> &bucket_padded,
                             const std::vector<int64_t> &bucket_shard, const ModelStateInputs &in) {
    const size_t nb = bucket_padded.size();
    if (nb < 1 || bucket_group.size() != nb || bucket_shard.size() != nb || in.states_per_group.empty() ||
        in.stage < 0 || in.stage > 3 || in.world < 1 || in.param_bytes < 1 || in.reduce_bytes < 1)
        throw std::invalid_argument("zero_ext: internal: model_state_bytes needs one group, padded and shard count "
                                    "per bucket (at least one), states for at least one group, a stage 0-3 and "
                                    "a world >= 1");
    const int64_t s = in.stage, n = in.world, ps = in.param_bytes, rs = in.reduce_bytes;
    const int64_t parts = s == 0 ? 1 : n, last_group = (int64_t)in.states_per_group.size() - 1;
    int64_t padded = 0, shard = 0, max_padded = 0, max_shard = 0, tie_bytes = 0, unfused_states = 0;
    for (size_t b = 0; b < nb; b++) {
        if (bucket_group[b] < 0 || bucket_padded[b] < 0 || bucket_shard[b] < 0)
            throw std::invalid_argument("zero_ext: internal: model_state_bytes needs groups and counts >= 0");
        padded += bucket_padded[b], shard += bucket_shard[b];
        max_padded = std::max(max_padded, bucket_padded[b]), max_shard = std::max(max_shard, bucket_shard[b]);
        tie_bytes += (bucket_shard[b] + 7) / 8;   // each bucket's tie bits from a whole byte
        // a torch optimizer over each bucket's slice, fp32, by param group
        unfused_states += 4 * bucket_shard[b] * in.states_per_group[std::min(bucket_group[b], last_group)];
    }
    ModelState m;
    // the fused engine keeps each state over the whole shard (every group)
    m.optimizer_states = in.fused ? in.state_bytes * shard *
                                        *std::max_element(in.states_per_group.begin(), in.states_per_group.end())
                                  : unfused_states;
    const bool low = ps < 4;   // bf16/fp16 parameters
    // stage 3: the fp32 shard is the parameter; a low param_dtype exists only gathered
    m.parameters = s < 3 ? padded * ps : low ? 0 : shard * 4;
    m.gradients = s <= 1 ? padded * rs : shard * rs;
    // param_quant: stages 1-2 gather dequantized values, so the fp32 master is a shard of its own
    m.master_weights = low || (in.param_quant && s >= 1 && s <= 2 && parts > 1) ? shard * 4 : 0;
    if (in.offload) {
        // Note [Optimizer offload] (offload.h): master, states and gradient shard on the host,
        // and two pinned rings of two slots (a gradient slice down, a parameter slice up)
        const int64_t slice = max_padded / parts, down = in.alltoall && n > 1 ? max_padded : slice;
        m.offloaded = true;
        m.host_master = shard * 4, m.host_states = m.optimizer_states, m.host_gradients = shard * rs;
        m.pinned_ring = 2 * (std::max<int64_t>(down, 1) * rs + std::max<int64_t>(slice, 1) * ps);
        m.gradients = s <= 1 ? padded * rs : 0;   // stage 1 keeps its buckets on the device
        m.master_weights = m.optimizer_states = 0;
        if (s == 3) m.parameters = shard * ps;    // the shard in param_dtype for the unit gathers
    }
    if (in.master_remainder) {
        // Note [Split master in the engine] (master_split.h): a 16-bit remainder and a tie bit
        // per element; on a GPU one fp32 chunk of scratch, except for Adam with fp32 states,
        // stepped in one pass (Note [Fused split-master step])
        m.master_weights = shard * 2 + tie_bytes;
        const bool one_pass = in.adam && in.state_bytes == 4;
        if (in.on_gpu && !one_pass)
            m.split_scratch = 4 * std::max<int64_t>(8, std::min<int64_t>(1 << 24, (max_shard + 7) / 8 * 8));
    }
    if (in.step_in_backward && s >= 2) {
        // Note [Step in backward] (backward_step.cpp): no gradient shard; with the all-to-all
        // reduce-scatter one slice-sized buffer where the slices are summed
        m.gradients = 0;
        if ((in.alltoall || in.grad_quant) && n > 1) m.grad_landing = max_padded / parts * rs;
    }
    return m;
}

int64_t smallest_world(int64_t world, int64_t max_world, const std::function<bool(int64_t)> &fits) {
    const int64_t most = int64_t(1) << 61;   // hi * 2 stays below 2^63
    if (world < 1 || world > most || max_world > most)
        throw std::invalid_argument("zero_ext: internal: smallest_world needs world sizes in [1, 2^61]");
    int64_t lo = world, hi = world * 2;
    while (hi <= max_world && !fits(hi)) lo = hi, hi *= 2;
    if (hi > max_world) return 0;
    while (hi - lo > 1) {   // fits(lo) is false, fits(hi) true
        const int64_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? hi : lo) = mid;
    }
    return hi;
}

}  // namespace zx
