/* test_unit_schedule.cpp — stage 3's UnitSchedule (csrc/engine/unit_schedule.h: Note [Stage 3
 * unit sequence]) row by row: a pass's needs in, the units gathered ahead and the units kept
 * after their forward out; replay_peak, estimate_memory's step; buffer_bytes, its buffers and
 * communication. No torch, so it builds here beside the C core's tests.
 * tests/test_unit_schedule.py checks the binding likewise.
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

void buffers() {
    // A row: the plan (unit, padded per bucket; frozen (unit, numel)), the options, the bytes.
    struct Row {
        int line;
        std::vector<int64_t> unit, padded;
        std::vector<std::pair<int64_t, int64_t>> frozen;
        EstimateInputs in;   // stage world ps rs ring depth coalesce accum piece slice alltoall meta narrow
        EstimateBuffers want;  // slots ring root unit prefetch peak frozen comm
    };
    const std::vector<int64_t> u000{0, 0, 0}, p3{64, 128, 32}, u012{0, 1, 2}, p170{10, 100, 60};
    const std::vector<Row> rows = {
        // stage 2, N = 4: two slots of the largest bucket's gradient + a slice; 3 reduce-scatters
        {__LINE__, u000, p3, {}, {2, 4, 2, 2, 2, 0, 0, 3, 1, 1, false, false}, {2, 640, 0, 0, 0, 0, 0, 1792}},
        // the all-to-all receives the whole bucket
        {__LINE__, u000, p3, {}, {2, 4, 2, 2, 2, 0, 0, 3, 1, 1, true, false}, {2, 1024, 0, 0, 0, 0, 0, 1792}},
        // bf16 parameters, fp32 reduce: the all-to-all's slot in 16 bits on a narrow wire, else 32
        {__LINE__, u000, p3, {}, {2, 4, 2, 4, 2, 0, 0, 3, 1, 1, true, false, true}, {2, 1024, 0, 0, 0, 0, 0, 3136}},
        {__LINE__, u000, p3, {}, {2, 4, 2, 4, 2, 0, 0, 3, 1, 1, true, false, false}, {2, 2048, 0, 0, 0, 0, 0, 3136}},
        {__LINE__, u000, p3, {}, {2, 4, 2, 4, 2, 0, 0, 3, 1, 1, false, false, true}, {2, 1024 + 256, 0, 0, 0, 0, 0, 3136}},
        {__LINE__, u000, p3, {}, {2, 1, 2, 2, 8, 0, 0, 3, 1, 1, false, false}, {1, 256, 0, 0, 0, 0, 0, 0}},
        {__LINE__, u000, p3, {}, {1, 1, 2, 2, 2, 0, 0, 1, 1, 1, false, false}, {0, 0, 0, 0, 0, 0, 0, 0}},
        {__LINE__, u000, p3, {}, {1, 2, 2, 4, 9, 0, 0, 1, 1, 1, false, false}, {3, 768, 0, 0, 0, 0, 0, 1344}},
        {__LINE__, u000, p3, {}, {0, 2, 2, 2, 2, 0, 0, 1, 1, 1, false, false}, {0, 0, 0, 0, 0, 0, 0, 896}},
        // stage 3: frozen pieces padded to 4, each unit's to 2 x 4; units 18, 108, 60 elements
        {__LINE__, u012, p170, {{1, 5}, {0, 3}}, {3, 2, 4, 4, 2, 0, 0, 1, 4, 4, false, false},
         {2, 1200, 72, 432, 0, 504, 32, 680 + 2 * 168 * 4 + 18 * 4}},
        // a meta build in bf16: the root and the largest unit whole in fp32
        {__LINE__, u012, p170, {{1, 5}, {0, 3}}, {3, 2, 2, 4, 2, 0, 0, 1, 4, 4, false, true},
         {2, 1200, 36, 216, 0, 504, 16, 680 + 2 * 168 * 2 + 18 * 2}},
    };
    for (const Row &r : rows) {
        const EstimateBuffers b = buffer_bytes(r.unit, r.padded, r.frozen, r.in), &w = r.want;
        CHECK(b.ring_slots == w.ring_slots && b.grad_ring == w.grad_ring, "row at line %d: ring %lld x, %lld bytes",
              r.line, (long long)b.ring_slots, (long long)b.grad_ring);
        CHECK(b.gathered_root == w.gathered_root && b.gathered_unit == w.gathered_unit && b.prefetch == w.prefetch &&
                  b.peak_gathered == w.peak_gathered,
              "row at line %d: root %lld unit %lld prefetch %lld peak %lld", r.line, (long long)b.gathered_root,
              (long long)b.gathered_unit, (long long)b.prefetch, (long long)b.peak_gathered);
        CHECK(b.frozen_sharded == w.frozen_sharded && b.comm == w.comm, "row at line %d: frozen %lld comm %lld",
              r.line, (long long)b.frozen_sharded, (long long)b.comm);
    }
    bool threw = false;
    try {
        buffer_bytes({0}, {1, 2}, {}, {});
    } catch (const std::invalid_argument &) {
        threw = true;
    }
    CHECK(threw, "a unit per bucket missing: an exception");
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
    buffers();
    errors();
    printf("test_unit_schedule: %ld checks passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
