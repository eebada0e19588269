// away.cpp — see away.h (Note [Reading alone]): the away rule (away_rule.h) applied to this
// rank's state, and the store meeting of Note [Going away].
#include "engine/away.h"

#include <chrono>
#include <string>
#include <thread>

namespace zx {

void Away::enable(StorePtr meet, int64_t id, int64_t rank, int64_t world) {
    store_ = std::move(meet);
    id_ = id;
    rank_ = rank;
    world_ = world;
}

void Away::back() {
    on_ = false;
    absence_ = Absence();
}

AwayMove Away::at_mark(const MarkFacts &m, int64_t key, int64_t step,
                       const std::function<std::vector<int64_t>()> &mark_digest) {
    AwayMove move = AwayMove::kOn;
    if (on_) {
        move = away_at_mark(m, absence_, mark_digest());
        if (move == AwayMove::kBack || move == AwayMove::kRejoin) back();
        if (move == AwayMove::kStay || move == AwayMove::kRejoin) return move;
    }
    // still away here only while pending (a mark that is not servable): no meeting
    if (store_ && meets_in_store(m) && !together(key, step) && alone_at(m)) {
        on_ = true;   // by a store meeting: absence_ is as back() left it
        return AwayMove::kStay;
    }
    return move;
}

AwayMove Away::at_collective(const std::vector<int64_t> &digest) {
    const AwayMove move = away_at_collective(absence_, digest);
    back();   // back, or it raises (kAlone: Sequence::fail_alone)
    return move;
}

void Away::leave(std::vector<int64_t> stayers) {
    on_ = true;
    absence_.by_exchange = true;
    absence_.stayers = std::move(stayers);
}

bool Away::together(int64_t key, int64_t step) {
    if (step_ != step) {
        step_ = step;
        meetings_ = 0;
    }
    // every rank that deviates here counts its meetings at this step alike
    const std::string base = "zero_ext/away/" + std::to_string(id_) + "/" + std::to_string(step) + "/" +
                             std::to_string(meetings_++);
    const std::string mine = std::to_string(key), decided = base + "/d";
    const auto as_bytes = [](const std::string &t) { return std::vector<uint8_t>(t.begin(), t.end()); };
    store_->set(base + "/" + std::to_string(rank_), as_bytes(mine));
    if (store_->add(base + "/n", 1) == world_) {   // the last to arrive: are all at the same mark?
        bool same = true;
        for (int64_t q = 0; q < world_ && same; q++) {
            const auto v = store_->get(base + "/" + std::to_string(q));
            same = std::string(v.begin(), v.end()) == mine;
        }
        store_->compareSet(decided, {}, as_bytes(same ? "T" : "A"));
    } else {
        using clock = std::chrono::steady_clock;
        const auto until = clock::now() + std::chrono::milliseconds((int64_t)(kAwayJoinS * 1000));
        auto nap = std::chrono::milliseconds(1);
        while (!store_->check({decided}) && clock::now() < until) {
            std::this_thread::sleep_for(nap);
            nap = std::min(nap * 2, std::chrono::milliseconds(20));
        }
        store_->compareSet(decided, {}, as_bytes("A"));   // the first to give up decides
    }
    const auto v = store_->get(decided);
    return std::string(v.begin(), v.end()) == "T";
}

}  // namespace zx
