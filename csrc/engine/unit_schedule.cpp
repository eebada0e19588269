// unit_schedule.cpp — see unit_schedule.h (Note [Stage 3 unit sequence]).
#include "engine/unit_schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace zx {

UnitSchedule::UnitSchedule(std::vector<int64_t> numel, int64_t depth, int64_t coalesce_numel)
    : numel_(std::move(numel)), depth_(depth), budget_(depth > 0 ? coalesce_numel : 0) {
    if (numel_.empty() || depth < 0 || std::any_of(numel_.begin(), numel_.end(), [](int64_t n) { return n < 0; }))
        throw std::invalid_argument("zero_ext: internal: UnitSchedule needs one element count (>= 0) per unit, the "
                                    "root's first, and prefetch_depth >= 0");
}

void UnitSchedule::check_unit(int64_t k) const {
    if (k < 0 || k >= (int64_t)numel_.size())
        throw std::out_of_range("zero_ext: internal: unit " + std::to_string(k) + " is not one of the " +
                                std::to_string(numel_.size()) + " units the schedule was built with");
}

void UnitSchedule::begin_pass(bool grad_enabled) {
    // A pass with autograd whose backward never came (an evaluation) is not learned: it would
    // predict no backward (Note [Reading alone]: a rank evaluating alone keeps the others' one).
    if (recording_ && !recorded_.empty() &&
        (!grad_pass_ || std::any_of(recorded_.begin(), recorded_.end(), [](const UnitNeed &n) { return n.backward; })))
        learned_[grad_pass_] = recorded_;
    grad_pass_ = grad_enabled;
    if (learned_[grad_pass_]) {
        order_ = *learned_[grad_pass_];
    } else {   // registration order, and (with autograd) its reverse for backward
        order_.clear();
        for (int64_t k = 1; k < (int64_t)numel_.size(); k++) order_.push_back({k, false});
        for (int64_t k = (int64_t)numel_.size() - 1; grad_pass_ && k >= 1; k--) order_.push_back({k, true});
    }
    recorded_.clear();
    cursor_ = 0;
    recording_ = true;
}

void UnitSchedule::need(int64_t k, bool in_backward) {
    check_unit(k);
    const UnitNeed n{k, in_backward};
    // one backward need per unit in a row (a hook fires for each of its outputs); forward
    // needs all count (a module called twice is needed twice)
    if (recording_ && !(in_backward && !recorded_.empty() && recorded_.back() == n)) recorded_.push_back(n);
    for (size_t i = cursor_; i < order_.size(); i++)
        if (order_[i].unit == k) {   // else not predicted from here on: the cursor stays
            cursor_ = i + 1;
            break;
        }
    fetches++;
}

std::vector<int64_t> UnitSchedule::window(int64_t k, bool phase, int64_t budget) const {
    std::vector<int64_t> out;
    int64_t total = 0;
    for (size_t i = cursor_; i < order_.size(); i++) {
        const auto [u, in_backward] = order_[i];
        if (in_backward && !phase) break;   // a forward's window ends where backward begins
        if (u == k || std::find(out.begin(), out.end(), u) != out.end()) continue;
        if ((int64_t)out.size() >= depth_ && (in_backward != phase || total + numel_[u] > budget)) break;
        out.push_back(u);
        total += numel_[u];
    }
    return out;
}

UnitFetch UnitSchedule::ahead(int64_t k, bool in_backward, const std::function<bool(int64_t)> &requested) const {
    const std::vector<int64_t> w = window(k, in_backward, budget_);
    UnitFetch f;
    for (int64_t u : w)
        if (!requested(u)) f.launch.push_back(u);
    const auto missing = [&](int64_t u) { return std::find(f.launch.begin(), f.launch.end(), u) != f.launch.end(); };
    const size_t first = std::min(w.size(), (size_t)depth_);
    if (f.launch.empty() || (2 * f.launch.size() < w.size() && std::none_of(w.begin(), w.begin() + first, missing)))
        return {};
    int64_t total = 0;
    for (int64_t u : f.launch) total += numel_[u];
    f.together = f.launch.size() > 1 && total <= budget_;
    return f;
}

void UnitSchedule::end_forward(bool grad_enabled, bool backward_follows) {
    if (grad_enabled && !learned_[grad_pass_]) {
        // first pass of its kind: backward is guessed as this forward reversed. Its gathers
        // start in backward (a forward's window ends there), so an evaluation with autograd
        // makes the same collectives as training.
        order_ = recorded_;
        for (auto it = recorded_.rbegin(); it != recorded_.rend(); ++it) order_.push_back({it->unit, true});
        cursor_ = recorded_.size();
    }
    if (!backward_follows) recording_ = false;
}

bool UnitSchedule::kept_after_forward(int64_t k) const {
    const std::vector<int64_t> w = window(-1, false, 0);
    if (std::find(w.begin(), w.end(), k) != w.end()) return true;
    return depth_ > 0 && cursor_ < order_.size() && order_[cursor_] == UnitNeed{k, true};
}

int64_t replay_peak(const std::vector<int64_t> &numel, int64_t elem_bytes, int64_t depth, int64_t coalesce_numel,
                    int64_t world) {
    UnitSchedule s(numel, depth, coalesce_numel);
    const int64_t n = (int64_t)numel.size();
    std::vector<bool> held(n, false);
    std::vector<std::pair<std::vector<int64_t>, int64_t>> staged;   // gathers in flight: members, bytes
    int64_t peak = 0;
    const auto note = [&] {
        int64_t now = 0;
        for (int64_t u = 1; u < n; u++) now += held[u] ? numel[u] * elem_bytes : 0;
        for (const auto &g : staged) now += g.second;
        peak = std::max(peak, now);
    };
    const auto waited = [&](int64_t u) {   // its gather completes: the staging is freed
        std::erase_if(staged, [u](const auto &g) { return std::find(g.first.begin(), g.first.end(), u) != g.first.end(); });
    };
    const auto prefetch = [&](int64_t k, bool phase) {
        const UnitFetch f = s.ahead(k, phase, [&](int64_t u) { return (bool)held[u]; });
        int64_t sum = 0;
        for (int64_t u : f.launch) held[u] = true, sum += numel[u];
        if (f.together && world > 1) staged.push_back({f.launch, (sum + sum / world) * elem_bytes});
        note();
    };
    const auto run = [&](int64_t k, bool backward) {
        s.need(k, backward);
        held[k] = true;
        note();
        waited(k);
        prefetch(k, backward);
        if (backward || !s.kept_after_forward(k)) {
            waited(k);
            held[k] = false;
        }
    };
    s.begin_pass(true);   // registration order, backward its reverse
    prefetch(0, false);   // the root's forward
    for (int64_t k = 1; k < n; k++) run(k, false);
    s.end_forward(true, true);
    for (int64_t k = n - 1; k >= 1; k--) run(k, true);
    return peak;
}

EstimateBuffers buffer_bytes(const std::vector<int64_t> &bucket_unit, const std::vector<int64_t> &bucket_padded,
                         const std::vector<std::pair<int64_t, int64_t>> &frozen, const EstimateInputs &in) {
    const int64_t nb = (int64_t)bucket_padded.size();
    if (nb < 1 || (int64_t)bucket_unit.size() != nb || in.stage < 0 || in.stage > 3 || in.world < 1 ||
        in.piece_align < 1 || in.slice_align < 1 || in.param_bytes < 1 || in.reduce_bytes < 1)
        throw std::invalid_argument("zero_ext: internal: buffer_bytes needs one unit and one padded count per "
                                    "bucket (at least one), a stage 0-3, a world >= 1 and alignments >= 1");
    const int64_t s = in.stage, n = in.world, ps = in.param_bytes, rs = in.reduce_bytes;
    const int64_t parts = s == 0 ? 1 : n;
    int64_t padded = 0, max_padded = 0;
    for (int64_t p : bucket_padded) padded += p, max_padded = std::max(max_padded, p);
    EstimateBuffers out;
    // The ring (Engine::acquire_slot): stage 1 needs it for the reduce-scatter output only with
    // N > 1; stages 2-3 stage every gradient in it, one slot at N = 1 (reduced at once). A slot:
    // stages 2-3 a bucket's gradient, and with N > 1 the receive buffer, the whole bucket for the
    // all-to-all reduce-scatter, a slice for the native one.
    if (s >= 2 || (s == 1 && n > 1))
        out.ring_slots = n == 1 ? 1 : std::min(std::max<int64_t>(1, in.grad_ring_buckets), nb);
    // With 16-bit parameters the all-to-all's slot holds 16-bit gradients (Note [Narrow gradient wire]).
    const int64_t ws = in.narrow_wire && in.alltoall && s >= 2 && n > 1 ? std::min(rs, ps) : rs;
    const int64_t slot =
        (s >= 2 ? max_padded * ws : 0) + (n > 1 ? (in.alltoall ? max_padded : max_padded / parts) * ws : 0);
    out.grad_ring = out.ring_slots * slot;
    // Stage 3's frozen parameters: one bucket per unit, each parameter at an aligned start,
    // padded to parts * the slice alignment (frozen.cpp, Note [Aligned pieces]).
    std::map<int64_t, int64_t> frozen_padded, unit_numel;
    for (const auto &[u, k] : frozen) frozen_padded[u] += (k + in.piece_align - 1) / in.piece_align * in.piece_align;
    const int64_t quantum = parts * in.slice_align;
    int64_t frozen_total = 0;
    for (auto &[u, k] : frozen_padded) k = std::max<int64_t>(1, (k + quantum - 1) / quantum) * quantum, frozen_total += k;
    out.frozen_sharded = frozen_total / parts * ps;
    unit_numel = frozen_padded;
    for (int64_t b = 0; b < nb; b++) unit_numel[bucket_unit[b]] += bucket_padded[b];
    const int64_t root_numel = unit_numel.count(0) ? unit_numel[0] : 0;
    if (s == 3) {
        // Whole units: the root, the largest unit, the prefetch beyond it; a meta build
        // (materialize.py) has the root and one unit whole at a time, in fp32.
        std::vector<int64_t> numel{root_numel};
        int64_t largest = 0;
        for (const auto &[u, k] : unit_numel)
            if (u != 0) numel.push_back(k), largest = std::max(largest, k);
        const int64_t best = replay_peak(numel, ps, in.depth, in.coalesce_numel, n);
        out.gathered_root = root_numel * ps;
        out.gathered_unit = largest * ps;
        out.prefetch = best - out.gathered_unit;
        out.peak_gathered = out.gathered_root + best;
        if (in.on_meta) out.peak_gathered = std::max(out.peak_gathered, (out.gathered_root + out.gathered_unit) * (4 / ps));
    }
    if (n == 1) return out;   // the engine issues no collective
    if (s == 0) out.comm = 2 * padded * rs;
    else if (s <= 2) out.comm = (s == 2 ? in.accum : 1) * padded * rs + padded * ps;
    else out.comm = in.accum * (padded * rs + 2 * (padded + frozen_total - root_numel) * ps + root_numel * ps);
    return out;
}

}  // namespace zx
