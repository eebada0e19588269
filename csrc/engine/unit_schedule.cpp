// unit_schedule.cpp — see unit_schedule.h (Note [Stage 3 unit sequence]).
#include "engine/unit_schedule.h"

#include <algorithm>
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

}  // namespace zx
