/* test_away_rule.cpp — the engine's away rule (csrc/engine/away_rule.h: Note [Going away],
 * Note [Back from away]) row by row: each rank's digest in, the verdict out (who reads
 * alone, who goes on, who raises), and an away rank's move at a mark or a collective.
 * The rule has no torch, so it builds here beside the C core's tests.
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "engine/away_rule.h"

#include <string>
#include <vector>

#include "check.h"

using namespace zx;

namespace {

// A rank's digest: where it is (`place` stands for the record: its count and running hash)
// and the mark's phase and flags. Equal places and phases give equal records.
struct Row {
    int64_t phase;
    int64_t flags;
    int64_t place;
};
constexpr int64_t S = kFlagServable, K = kFlagKnown;

std::vector<int64_t> digest_of(const Row &r) {
    std::vector<int64_t> d(kDigest, 0);
    d[0] = r.place;                 // seq
    d[1] = 7;                       // step
    d[kDigestPhase] = r.phase;
    d[4] = kSeqMark;
    d[8] = r.place * 1000003;       // hash
    d[kDigestFlags] = r.flags;
    return d;
}

// "A" a rank that reads alone from here, "." one that goes on; "!" a divergence.
std::string verdict_text(const ExchangeVerdict &v) {
    if (v.diverged) return "!";
    std::string s;
    for (bool a : v.away) s += a ? 'A' : '.';
    return s;
}

struct ExchangeCase {
    const char *name;
    std::vector<Row> rows;
    const char *expect;    // verdict_text
    int64_t stayer;        // the rank whose digest the away ranks keep; -1: none goes on
};

void exchange_table() {
    const int64_t F = kPhaseForward, NG = kPhaseForwardNoGrad, B = kPhaseBackward, MS = kPhaseModelState,
                  OS = kPhaseOptimState, CK = kPhaseCheckpoint, ST = kPhaseStep;
    const ExchangeCase cases[] = {
        {"rank 0 evaluates alone, the others train (stage 3 forwards they expect)",
         {{NG, S, 1}, {F, S | K, 2}, {F, S | K, 2}}, "A..", 1},
        {"rank 2 saves alone (model.state_dict), the others' forward is not servable (stage 1-2)",
         {{F, K, 2}, {F, K, 2}, {MS, S, 1}}, "..A", 0},
        {"two readers in different phases, the third trains",
         {{OS, S, 1}, {CK, S, 3}, {B, 0, 2}}, "AA.", 2},
        {"the ranks that go on disagree: a divergence, not an absence",
         {{NG, S, 1}, {F, S | K, 2}, {F, S | K, 4}}, "!", -1},
        {"digests differ and no mark is servable: a divergence (a skipped backward)",
         {{B, 0, 1}, {F, 0, 2}}, "!", -1},
        {"a reads-only phase the glue did not mark servable reads nothing alone",
         {{NG, 0, 1}, {F, K, 2}}, "!", -1},
        {"a servable forward the pattern expects is no leaver: a divergence",
         {{F, S | K, 1}, {B, 0, 2}}, "!", -1},
        {"learned: a forward with autograd that left its pattern goes away (rank 0's evaluation)",
         {{F, S, 1}, {F, S | K, 2}, {F, S | K, 2}}, "A..", 1},
        {"learned: the same place, but its pattern did not expect it (flags differ): it goes away",
         {{F, S, 2}, {F, S | K, 2}}, "A.", 1},
        {"being learned: only readers and leavers; the leavers train, the reader goes away",
         {{NG, S, 1}, {F, S, 2}, {F, S, 2}}, "A..", 1},
        {"being learned: leavers at different places stay and disagree: a divergence",
         {{NG, S, 1}, {F, S, 2}, {F, S, 3}}, "!", -1},
        {"every rank reads, at different places: all read alone, none goes on",
         {{MS, S, 1}, {NG, S, 2}, {OS, S, 3}}, "AAA", -1},
        {"leavers only, no reader: all go away, none goes on",
         {{F, S, 1}, {F, S, 2}}, "AA", -1},
        {"a step on one rank and a servable read on another",
         {{ST, 0, 5}, {NG, S, 4}, {ST, 0, 5}, {ST, 0, 5}}, ".A..", 0},
    };
    for (const ExchangeCase &c : cases) {
        std::vector<int64_t> rows;
        for (const Row &r : c.rows) {
            const auto d = digest_of(r);
            rows.insert(rows.end(), d.begin(), d.end());
        }
        const ExchangeVerdict v = exchange_verdict(rows.data(), (int64_t)c.rows.size());
        const std::string got = verdict_text(v);
        CHECK(got == c.expect, "%s: verdict %s, expected %s", c.name, got.c_str(), c.expect);
        const std::vector<int64_t> want = c.stayer >= 0 ? digest_of(c.rows[c.stayer]) : std::vector<int64_t>();
        CHECK(v.stayers == want, "%s: the stayers' digest (%zu integers) is not rank %lld's", c.name,
              v.stayers.size(), (long long)c.stayer);
        if (!v.diverged) CHECK((int64_t)v.away.size() == (int64_t)c.rows.size(), "%s: one verdict per rank", c.name);
    }
}

struct MarkCase {
    MarkFacts m;
    bool alone, meets;
};

// A servable mark: does it meet the others in the store first, and does it read alone when
// it met no one there?
void mark_table() {
    const MarkCase cases[] = {
        // phase, servable, known, learned -> alone_at, meets_in_store
        {{kPhaseForwardNoGrad, true, true, true}, true, true},      // a read meets even where expected
        {{kPhaseForwardNoGrad, true, false, false}, true, true},
        {{kPhaseModelState, true, true, false}, true, true},
        {{kPhaseCheckpoint, true, false, true}, true, true},
        {{kPhaseForward, true, true, true}, true, false},           // the training forward: nothing changes
        {{kPhaseForward, true, false, true}, true, true},           // learned, left its pattern: alone
        {{kPhaseForward, true, true, false}, false, true},          // being learned: meets, then the exchange
        {{kPhaseForward, true, false, false}, false, true},         // a late rank is not taken for a reader
        {{kPhaseForward, false, false, true}, true, false},         // not servable: never meets
        {{kPhaseGradStats, true, false, false}, false, true},       // not a read: alone only once learned
        {{kPhaseBackward, true, true, true}, true, false},
    };
    for (const MarkCase &c : cases) {
        CHECK(alone_at(c.m) == c.alone, "alone_at(phase %lld, known %d, learned %d) != %d", (long long)c.m.phase,
              c.m.known, c.m.learned, c.alone);
        CHECK(meets_in_store(c.m) == c.meets, "meets_in_store(phase %lld, servable %d, known %d, learned %d) != %d",
              (long long)c.m.phase, c.m.servable, c.m.known, c.m.learned, c.meets);
    }
}

const char *move_name(AwayMove m) {
    switch (m) {
        case AwayMove::kOn: return "on";
        case AwayMove::kBack: return "back";
        case AwayMove::kRejoin: return "rejoin";
        case AwayMove::kStay: return "stay";
        case AwayMove::kPending: return "pending";
        case AwayMove::kAlone: return "alone";
    }
    return "?";
}

// How the rank left: 's' a store meeting; 'e' an exchange where stayers went on; 'E' an
// exchange where every rank went away. Where it is: the same place as the stayers or not.
struct BackCase {
    char left;
    MarkFacts m;        // at a mark; phase kPhaseNone: at a collective
    bool stayers_place;
    AwayMove expect;
};

void back_table() {
    const int64_t F = kPhaseForward, NG = kPhaseForwardNoGrad, B = kPhaseBackward, MS = kPhaseModelState,
                  N = kPhaseNone;
    const BackCase cases[] = {
        // after a store meeting
        {'s', {NG, true, false, true}, false, AwayMove::kStay},      // still reading
        {'s', {MS, true, false, false}, false, AwayMove::kStay},     // reads alone whether learned or not
        {'s', {NG, true, true, true}, false, AwayMove::kBack},       // its pattern expects it
        {'s', {B, false, false, true}, false, AwayMove::kBack},      // not servable: back, meets their exchange
        {'s', {F, true, false, true}, false, AwayMove::kStay},       // a forward that left its pattern, learned
        {'s', {F, true, false, false}, false, AwayMove::kBack},      // being learned: not alone there
        {'s', {N, false, false, false}, true, AwayMove::kAlone},     // a collective while away
        // after an exchange that stayers went on from
        {'e', {NG, true, false, true}, false, AwayMove::kStay},
        {'e', {NG, true, true, true}, false, AwayMove::kStay},       // known, but not where they are
        {'e', {F, true, true, true}, true, AwayMove::kRejoin},       // where the stayers exchanged
        {'e', {F, true, false, true}, true, AwayMove::kRejoin},      // its flags may differ from theirs
        {'e', {B, false, false, true}, false, AwayMove::kPending},   // not servable: its collective decides
        {'e', {N, false, false, false}, true, AwayMove::kRejoin},
        {'e', {N, false, false, false}, false, AwayMove::kAlone},    // a collective the stayers never made
        // after an exchange where every rank went away
        {'E', {NG, true, false, false}, false, AwayMove::kStay},
        {'E', {F, true, true, true}, false, AwayMove::kBack},        // a known mark: they meet in the exchange
        {'E', {B, false, false, false}, false, AwayMove::kPending},
        {'E', {N, false, false, false}, false, AwayMove::kBack},     // the first collective: as usual
    };
    const std::vector<int64_t> there = digest_of({kPhaseForward, S | K, 9});
    for (const BackCase &c : cases) {
        Absence a;
        a.by_exchange = c.left != 's';
        if (c.left == 'e') a.stayers = there;
        // where this rank is: the stayers' record (its own flags), or another
        std::vector<int64_t> here = digest_of({c.m.phase == kPhaseNone ? kPhaseForward : c.m.phase,
                                               (c.m.servable ? S : 0) | (c.m.known ? K : 0),
                                               c.stayers_place ? 9 : 10});
        if (c.stayers_place) here[kDigestPhase] = there[kDigestPhase];
        const AwayMove got = c.m.phase == kPhaseNone ? away_at_collective(a, here) : away_at_mark(c.m, a, here);
        CHECK(got == c.expect, "left by '%c', at %s phase %lld (servable %d, known %d, learned %d): %s, expected %s",
              c.left, c.m.phase == kPhaseNone ? "a collective," : "a mark of", (long long)c.m.phase, c.m.servable,
              c.m.known, c.m.learned, move_name(got), move_name(c.expect));
    }
}

void same_place_ignores_only_flags() {
    auto a = digest_of({kPhaseForward, S, 3}), b = digest_of({kPhaseForward, S | K, 3});
    CHECK(same_place(a, b), "digests that differ in their flags only are at the same place");
    for (int64_t i = 0; i < kDigestFlags; i++) {
        auto c = a;
        c[i] += 1;
        CHECK(!same_place(a, c), "digests that differ in integer %lld are not at the same place", (long long)i);
    }
    CHECK(!same_place(a, {}), "no digest (every rank went away) is at no place");
}

}  // namespace

int main() {
    exchange_table();
    mark_table();
    back_table();
    same_place_ignores_only_flags();
    printf("test_away_rule: %ld checks passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
