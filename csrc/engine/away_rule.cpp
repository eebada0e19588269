// away_rule.cpp — see away_rule.h (Note [Going away], Note [Back from away]).
#include "engine/away_rule.h"

#include <cstring>

namespace zx {

bool alone_at(const MarkFacts &m) { return reads_only(m.phase) || m.learned; }

bool meets_in_store(const MarkFacts &m) { return m.servable && (!m.known || !m.learned || reads_only(m.phase)); }

bool same_place(const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
    return a.size() == b.size() && a.size() == (size_t)kDigest &&
           std::memcmp(a.data(), b.data(), kDigestFlags * sizeof(int64_t)) == 0;
}

AwayMove away_at_mark(const MarkFacts &m, const Absence &a, const std::vector<int64_t> &digest) {
    if (!a.by_exchange) return m.servable && !m.known && alone_at(m) ? AwayMove::kStay : AwayMove::kBack;
    if (!m.servable) return AwayMove::kPending;
    if (!a.stayers.empty()) return same_place(digest, a.stayers) ? AwayMove::kRejoin : AwayMove::kStay;
    return m.known ? AwayMove::kBack : AwayMove::kStay;   // every rank went away: they meet in the exchange
}

AwayMove away_at_collective(const Absence &a, const std::vector<int64_t> &digest) {
    if (a.by_exchange && a.stayers.empty()) return AwayMove::kBack;
    if (a.by_exchange && same_place(digest, a.stayers)) return AwayMove::kRejoin;
    return AwayMove::kAlone;   // not routed to the servers
}

ExchangeVerdict exchange_verdict(const int64_t *rows, int64_t world) {
    const auto flags = [&](int64_t q) { return rows[q * kDigest + kDigestFlags]; };
    const auto reads = [&](int64_t q) {
        return (flags(q) & kFlagServable) && reads_only(rows[q * kDigest + kDigestPhase]);
    };
    const auto leaves = [&](int64_t q) { return (flags(q) & kFlagServable) && !(flags(q) & kFlagKnown); };
    int64_t readers = 0, leavers = 0;
    for (int64_t q = 0; q < world; q++) {
        readers += reads(q);
        leavers += !reads(q) && leaves(q);
    }
    // only readers and leavers: the leavers train (a pattern still learned)
    const bool leavers_stay = readers > 0 && readers + leavers == world;
    ExchangeVerdict v;
    v.away.assign(world, false);
    int64_t stayer = -1, candidates = 0;
    for (int64_t q = 0; q < world; q++) {
        if (reads(q) || (leaves(q) && !leavers_stay)) {
            v.away[q] = true;
            candidates++;
        } else if (stayer < 0) {
            stayer = q;
        } else if (std::memcmp(rows + q * kDigest, rows + stayer * kDigest, kDigest * sizeof(int64_t)) != 0) {
            v.diverged = true;   // the ranks that go on disagree
        }
    }
    if (candidates == 0) v.diverged = true;
    if (v.diverged) {
        v.away.assign(world, false);
        return v;
    }
    if (stayer >= 0) v.stayers.assign(rows + stayer * kDigest, rows + (stayer + 1) * kDigest);
    return v;
}

}  // namespace zx
