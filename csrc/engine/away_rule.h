// away_rule.h — the away rule: who reads alone, who goes on, who raises, and when an away
// rank is back. Pure functions of a mark's facts and of the ranks' digests (digest.h): no
// torch and no state, so csrc/core/tests/test_away_rule.cpp checks them row by row. Away
// (away.h) holds the state and applies them.
//
// Note [Going away]
//   Terms. A "servable" mark is one Note [Reading alone] (away.h) lets be served. A mark is
//   "known" when the rank's pattern expects it (Note [Learned pattern], sequence.h).
//   The pattern is "learned" after kLearnCycles cycles; before, every rank exchanges at
//   its servable marks.
//   With a store: a servable mark that is not known, that only reads, or any while the
//   pattern is not learned, first meets the others in the process group's store
//   (meets_in_store, Away::together). If every rank arrives at the same mark within
//   kAwayJoinS, all go on (all evaluate: the exchange, the collectives). Otherwise the
//   first to give up writes "away", and each rank arriving there reads it. Such a rank
//   goes away when alone_at: its phase only reads, or the pattern is learned. A forward
//   with autograd before that goes to the exchange, which has no deadline: a rank merely
//   late to its first training forward is never taken for one that reads alone.
//   Without a store the ranks meet in the digest exchange (exchange_verdict). Where the
//   digests differ, "readers" (servable, only reads) and "leavers" (servable, not known)
//   go away, provided the others, the "stayers", agree among themselves. Where every rank
//   is a reader or a leaver (as while the pattern is learned), the readers go away and the
//   leavers stay. No rank to send away, or stayers that disagree: a divergence.
//
// Note [Back from away]
//   After a store meeting, a rank is back at the first mark that cannot be served or that
//   its pattern expects (away_at_mark). The pattern is the others' (the excursion left
//   none of it): where it expects no exchange, they make none either, and an exchange (a
//   deviation, or every phase) meets the one they wait in. A rank that now trains alone
//   waits in that exchange and is named as any divergence.
//   After an exchange, the rank keeps the stayers' digest. It is back at the record that
//   equals it but for the flags (same_place): the stayers' exchange there is done, so the
//   record goes in without one (kRejoin). When every rank went away, it is back at a known
//   mark or at its first collective, where the ranks meet in the exchange as usual. At a
//   mark that is not servable the rank stays away until that mark's first collective.
//   A collective that is none of these (not routed to the servers) is one this rank
//   cannot make alone (kAlone): it publishes its records with the attempted one, as a
//   watched wait does, and every rank raises the same divergence (Sequence::fail_alone).
//   The others are never blamed for a long absence: an away rank publishes nothing, so
//   their comparison never completes and they keep waiting.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/digest.h"

namespace zx {

// How long a rank that left its pattern in a servable phase waits in the store for the
// others to arrive at the same deviation before it reads alone (Note [Going away]).
constexpr double kAwayJoinS = 0.25;

// What a rank knows of a mark it commits.
struct MarkFacts {
    int64_t phase = kPhaseNone;
    bool servable = false;   // the glue marked it servable (Note [Reading alone])
    bool known = false;      // the rank's pattern expects it
    bool learned = false;    // the pattern is learned
};

// What a rank does at a mark or a collective (Note [Back from away]). Sequence applies it.
enum class AwayMove {
    kOn,        // not away: as any
    kBack,      // back: as any (it meets the others' exchange, or they make none)
    kRejoin,    // back where the stayers exchanged: recorded without an exchange (theirs is done)
    kStay,      // away (still, or from now on): nothing of it is recorded
    kPending,   // still away, a mark as any: its first collective decides
    kAlone,     // a collective this rank cannot make alone: every rank raises
};

// Whether a rank that met no one at this servable mark reads alone (Note [Going away]).
bool alone_at(const MarkFacts &m);
// Whether this servable mark meets the other ranks in the store first.
bool meets_in_store(const MarkFacts &m);
// Two digests at the same place of the sequence: equal but for the marks' flags (a rank
// coming back may have another view of its pattern than the stayers had).
bool same_place(const std::vector<int64_t> &a, const std::vector<int64_t> &b);

// How a rank left: in a store meeting, or in an exchange with the stayers' digest (empty:
// every rank went away).
struct Absence {
    bool by_exchange = false;
    std::vector<int64_t> stayers;
};
// An away rank at mark m, whose record would be `digest`: kStay, kBack, kRejoin or kPending.
AwayMove away_at_mark(const MarkFacts &m, const Absence &a, const std::vector<int64_t> &digest);
// An away rank at a collective whose record would be `digest`: kBack, kRejoin or kAlone.
AwayMove away_at_collective(const Absence &a, const std::vector<int64_t> &digest);

// A digest exchange whose rows (world x kDigest) differ: every rank reads the same verdict.
struct ExchangeVerdict {
    bool diverged = false;           // raise: stayers that disagree, or no rank to send away
    std::vector<bool> away;          // per rank: it reads alone from here
    std::vector<int64_t> stayers;    // the digest of the ranks that go on; empty: none does
};
ExchangeVerdict exchange_verdict(const int64_t *rows, int64_t world);

}  // namespace zx
