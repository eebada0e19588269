/* test_unit_schedule.cpp — stage 3's UnitSchedule (csrc/engine/unit_schedule.h: Note [Stage 3
 * unit sequence]) row by row: a pass's needs in, the units gathered ahead and the units kept
 * after their forward out; and replay_peak, estimate_memory's step. No torch, so it builds
 * here beside the C core's tests. tests/test_unit_schedule.py checks the binding likewise.
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "engine/unit_schedule.h"

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"

using namespace zx;

namespace {

// "F3" unit 3's forward, "B3" its backward; the fetch written "+1,2" (together) or "1,2".
struct Step {
    const char *need;
    const char *fetch;
};

std::string text(const UnitFetch &f) {
    std::string s = f.together ? "+" : "";
    for (size_t i = 0; i < f.launch.size(); i++) s += (i ? "," : "") + std::to_string(f.launch[i]);
    return s;
}

// Runs the needs; each fetch is marked requested, released again after its unit's forward
// unless kept (kept_after_forward) and after its backward.
void run(UnitSchedule &s, std::set<int64_t> &req, const std::vector<Step> &steps, int line) {
    const auto requested = [&req](int64_t u) { return req.count(u) > 0; };
    for (const Step &st : steps) {
        const bool backward = st.need[0] == 'B';
        const int64_t k = std::stoll(st.need + 1);
        if (k != 0) s.need(k, backward);
        const UnitFetch f = s.ahead(k, backward, requested);
        CHECK(text(f) == st.fetch, "row at line %d, need %s: fetched '%s', expected '%s'", line, st.need,
              text(f).c_str(), st.fetch);
        req.insert(f.launch.begin(), f.launch.end());
        if (k == 0) continue;   // the root stays gathered
        req.insert(k);
        if (backward || !s.kept_after_forward(k)) req.erase(k);
    }
}

void registration_order() {
    // depth 1, no coalescing: one unit ahead; a forward's window stops at backward; the last
    // unit is kept across the loss, its backward first
    UnitSchedule s({10, 100, 100, 100}, 1, 0);
    std::set<int64_t> req;
    s.begin_pass(true);
    run(s, req, {{"F0", "1"}, {"F1", "2"}, {"F2", "3"}, {"F3", ""}}, __LINE__);
    CHECK(s.kept_after_forward(3) && !s.kept_after_forward(2), "the last unit is kept for its backward");
    s.end_forward(true, true);
    run(s, req, {{"B3", "2"}, {"B2", "1"}, {"B1", ""}}, __LINE__);
    CHECK(s.fetches == 6 && req.empty(), "6 needs, every unit released: %lld", (long long)s.fetches);
}

void coalesced() {
    // small units within coalesce_numel go together, once half the window is missing
    UnitSchedule s({10, 5, 5, 5, 5, 1000}, 1, 16);
    std::set<int64_t> req;
    s.begin_pass(false);
    run(s, req, {{"F0", "+1,2,3"}, {"F1", ""}, {"F2", "4"}, {"F3", ""}, {"F4", "5"}, {"F5", ""}}, __LINE__);
    UnitSchedule none({10, 5, 5, 5}, 0, 16);   // prefetch_depth 0: nothing ahead, nothing kept
    std::set<int64_t> r2;
    none.begin_pass(true);
    run(none, r2, {{"F0", ""}, {"F1", ""}, {"F2", ""}, {"F3", ""}}, __LINE__);
    CHECK(r2.empty(), "depth 0 keeps no unit across the loss");
}

void learned_order() {
    // a first pass out of registration order (F1's cursor lands on the guess's B1: nothing
    // ahead) guesses its backward as its forward reversed; the next pass is predicted from
    // its record (one backward need per unit in a row)
    UnitSchedule s({1, 1, 1, 1}, 1, 0);
    std::set<int64_t> req;
    s.begin_pass(true);
    run(s, req, {{"F0", "1"}, {"F3", ""}, {"F1", ""}, {"F2", ""}}, __LINE__);
    s.end_forward(true, true);
    run(s, req, {{"B2", "1"}, {"B2", ""}, {"B1", ""}, {"B3", ""}}, __LINE__);
    req.clear();
    s.begin_pass(true);
    run(s, req, {{"F0", "3"}, {"F3", "1"}, {"F1", "2"}, {"F2", ""}}, __LINE__);
    s.end_forward(true, true);
    run(s, req, {{"B2", "1"}, {"B1", "3"}, {"B3", ""}}, __LINE__);
}

void unlearned_passes() {
    // a pass with autograd whose backward never came is not learned; nor a compiled one
    UnitSchedule s({1, 1, 1, 1}, 1, 0);
    std::set<int64_t> req;
    s.begin_pass(true);
    run(s, req, {{"F0", "1"}, {"F3", ""}, {"F1", ""}, {"F2", ""}}, __LINE__);
    s.end_forward(true, true);   // the loss is dropped
    req.clear();
    s.begin_pass(true);
    run(s, req, {{"F0", "1"}}, __LINE__);   // registration order again
    s.stop_recording();
    req.clear();
    s.begin_pass(false);
    run(s, req, {{"F0", "1"}, {"F2", "3"}, {"F3", ""}}, __LINE__);   // the cursor resynchronizes on 2
}

void replay() {
    // depth 1: root excluded; at most two units of 100 whole (the computing one and the next)
    CHECK(replay_peak({10, 100, 100, 100}, 2, 1, 0, 2) == 400, "replay depth 1: %lld",
          (long long)replay_peak({10, 100, 100, 100}, 2, 1, 0, 2));
    CHECK(replay_peak({10, 100, 100, 100}, 2, 0, 0, 2) == 200, "replay depth 0");
    // three small units coalesced over 2 ranks: 15 elements whole + the staging pair (15 + 7)
    CHECK(replay_peak({10, 5, 5, 5}, 4, 1, 16, 2) == (15 + 15 + 7) * 4, "replay coalesced: %lld",
          (long long)replay_peak({10, 5, 5, 5}, 4, 1, 16, 2));
    CHECK(replay_peak({10}, 4, 1, 16, 2) == 0, "the root alone");
}

void errors() {
    bool threw = false;
    try {
        UnitSchedule bad({}, 1, 0);
    } catch (const std::invalid_argument &) {
        threw = true;
    }
    CHECK(threw, "no units: an exception, not an abort");
    UnitSchedule s({1, 1}, 1, 0);
    threw = false;
    try {
        s.need(2, false);
    } catch (const std::out_of_range &) {
        threw = true;
    }
    CHECK(threw, "a unit out of range: an exception");
}

}  // namespace

int main() {
    registration_order();
    coalesced();
    learned_order();
    unlearned_passes();
    replay();
    errors();
    printf("test_unit_schedule: %ld checks passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
