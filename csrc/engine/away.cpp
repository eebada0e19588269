// away.cpp — the sequence check's side of reading alone (Note [Reading alone], away.h):
// whether a rank that left its pattern in a servable phase is alone there, when it is back
// where the others wait, and the message when it tries what only every rank can do.
#include "engine/away.h"

#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "engine/sequence.h"   // defines: Sequence

namespace zx {

namespace {

// Two digests at the same place of the sequence: equal but for the marks' flags (a rank
// coming back may have another view of its pattern than the stayers had).
bool same_place(const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), (kDigest - 1) * sizeof(int64_t)) == 0;
}

}  // namespace

bool Sequence::settle_away(int64_t key, bool pass_start, bool servable) {
    const bool known = sched_.pattern.peek(key, pass_start);
    if (!away_.by_exchange) {
        // Away after a store meeting: back at a mark that is not servable or that the
        // pattern expects. The pattern is the others' (the excursion left none of it), so
        // where it expects no exchange, neither do they, and an exchange (a deviation, or
        // every phase) meets theirs; a rank that now trains alone waits in that exchange
        // and is named as any divergence.
        if (servable && !known && alone_at(pos_.phase)) return true;   // still reading alone
        away_.on = false;
        return false;
    }
    if (!servable) return false;   // rejoin_at() decides at its first collective
    sched_.flags = kFlagServable | (known ? kFlagKnown : 0);
    const SeqRecord r = next_record(kSeqMark, 0);
    if (!away_.stayers.empty() ? !same_place(digest(r), away_.stayers) : !known) return true;   // still away
    // Back: where the stayers exchanged (their exchange of this mark is done, so the
    // record goes in without one), or, when every rank went away, at a mark the pattern
    // expects, where they meet in the exchange as usual.
    const bool exchanged = !away_.stayers.empty();
    away_.on = away_.by_exchange = false;
    away_.stayers.clear();
    if (!exchanged) return false;
    record(r);
    sched_.armed = false;
    sched_.since_mark = 0;
    sched_.pattern.next(key, pass_start);
    return true;
}

bool Sequence::rejoin_at(const SeqRecord &r) {
    if (away_.by_exchange && away_.stayers.empty()) {   // every rank went away: they meet in the exchange
        away_.on = away_.by_exchange = false;
        return false;
    }
    if (away_.by_exchange && same_place(digest(r), away_.stayers)) {   // where the stayers exchanged
        away_.on = away_.by_exchange = false;
        away_.stayers.clear();
        record(r);
        sched_.armed = false;
        return true;
    }
    fail_alone(r);   // a collective without a mark while away: not routed to the servers
}

bool Sequence::together(int64_t key) {
    const StorePtr &store = away_.store;
    if (away_.step != pos_.step) {
        away_.step = pos_.step;
        away_.meetings = 0;
    }
    // every rank that deviates here counts its meetings at this step alike
    const std::string base = "zero_ext/away/" + std::to_string(waits_.id) + "/" + std::to_string(pos_.step) + "/" +
                             std::to_string(away_.meetings++);
    const std::string mine = std::to_string(key), decided = base + "/d";
    const auto as_bytes = [](const std::string &t) { return std::vector<uint8_t>(t.begin(), t.end()); };
    store->set(base + "/" + std::to_string(rank_), as_bytes(mine));
    if (store->add(base + "/n", 1) == world_) {   // the last to arrive: are all at the same mark?
        bool same = true;
        for (int64_t q = 0; q < world_ && same; q++) {
            const auto v = store->get(base + "/" + std::to_string(q));
            same = std::string(v.begin(), v.end()) == mine;
        }
        store->compareSet(decided, {}, as_bytes(same ? "T" : "A"));
    } else {
        using clock = std::chrono::steady_clock;
        const auto until = clock::now() + std::chrono::milliseconds((int64_t)(kAwayJoinS * 1000));
        auto nap = std::chrono::milliseconds(1);
        while (!store->check({decided}) && clock::now() < until) {
            std::this_thread::sleep_for(nap);
            nap = std::min(nap * 2, std::chrono::milliseconds(20));
        }
        store->compareSet(decided, {}, as_bytes("A"));   // the first to give up decides
    }
    const auto v = store->get(decided);
    return std::string(v.begin(), v.end()) == "T";
}

int Sequence::away_verdict(const int64_t *a) {
    // A rank that only reads may go away, and one in a forward with autograd that left its
    // pattern, unless only readers would stay: then these train (a pattern still learned).
    const auto reads = [&](int64_t q) {
        const int64_t *d = a + q * kDigest;
        return (d[kDigest - 1] & kFlagServable) && reads_only(d[3]);
    };
    const auto leaves = [&](int64_t q) {
        const int64_t *d = a + q * kDigest;
        return (d[kDigest - 1] & kFlagServable) && !(d[kDigest - 1] & kFlagKnown);
    };
    int64_t readers = 0, leavers = 0;
    for (int64_t q = 0; q < world_; q++) {
        readers += reads(q);
        leavers += !reads(q) && leaves(q);
    }
    const bool leavers_stay = readers > 0 && readers + leavers == world_;
    const auto candidate = [&](int64_t q) { return reads(q) || (leaves(q) && !leavers_stay); };
    int64_t stayer = -1, candidates = 0;
    for (int64_t q = 0; q < world_; q++) {
        if (candidate(q)) {
            candidates++;
        } else if (stayer < 0) {
            stayer = q;
        } else if (std::memcmp(a + q * kDigest, a + stayer * kDigest, kDigest * sizeof(int64_t)) != 0) {
            return -1;   // the ranks that go on disagree: a divergence
        }
    }
    if (candidates == 0) return -1;
    if (!candidate(rank_)) return 0;
    if (stayer >= 0)
        away_.stayers.assign(a + stayer * kDigest, a + (stayer + 1) * kDigest);
    else
        away_.stayers.clear();
    return 1;
}

void Sequence::fail_alone(const SeqRecord &attempt) {
    away_.on = false;
    record(attempt);   // published: the first record where this rank and the others differ
    if (waits_.store) {
        // As a watched wait: publish, and diagnose once every rank has (the others publish
        // after their patience in the collective they wait in), so every rank says the same.
        using clock = std::chrono::steady_clock;
        const auto until = clock::now() + std::chrono::milliseconds((int64_t)((4 * waits_.patience_s + 5) * 1000));
        std::string prev;
        std::vector<int64_t> prev_ids;
        try {
            waits_.published++;
            waits_.store->set(key(rank_), blob("what it began alone"));
            while (clock::now() < until) {
                std::vector<std::string> whats;
                std::vector<int64_t> ids;
                std::vector<FrozenSummary> frozen;
                auto rings = read_all(&whats, &ids, &frozen);
                const std::string msg = rings.empty() ? std::string() : diagnose(rings, whats);
                if (!msg.empty() && msg == prev && ids == prev_ids) fail(msg);
                prev = msg;
                prev_ids = ids;
                std::this_thread::sleep_for(std::chrono::milliseconds(250));
            }
        } catch (const std::exception &e) {
            if (std::string(e.what()).rfind("zero_ext:", 0) == 0) throw;
        }
    }
    std::ostringstream o;
    o << "zero_ext: collective sequence diverged: rank " << rank_ << " read alone (served by the other ranks) and "
      << "then began " << describe(attempt) << ", which every rank must run; the other ranks wait in their next "
      << "collective.\nA rank may evaluate, generate or call state_dict() alone, but not train alone: run "
         "backward() and step() on every rank, then restart from the last checkpoint.";
    fail(o.str());
}

}  // namespace zx
