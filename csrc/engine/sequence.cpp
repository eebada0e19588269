// sequence.cpp — see sequence.h (Note [Collective sequence check]).
#include "engine/sequence.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "engine/comm.h"
#include "engine/params.h"   // defines: Params

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"   // Note [Collective entry points]

namespace zx {

namespace {

int64_t mix(int64_t h, int64_t v) {
    uint64_t x = (uint64_t)h ^ ((uint64_t)v + 0x9e3779b97f4a7c15ULL + ((uint64_t)h << 6) + ((uint64_t)h >> 2));
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    return (int64_t)(x ^ (x >> 29));
}

void put(const SeqRecord &r, int64_t *o) {
    const int64_t v[kRecordFields] = {r.seq, r.step, r.micro, r.phase, r.kind, r.bucket, r.unit, r.numel, r.hash};
    std::memcpy(o, v, sizeof(v));
}

SeqRecord get(const int64_t *v) {
    SeqRecord r;
    r.seq = v[0], r.step = v[1], r.micro = v[2], r.phase = v[3], r.kind = v[4];
    r.bucket = v[5], r.unit = v[6], r.numel = v[7], r.hash = v[8];
    return r;
}

// Ranks with equal keys, largest group first (the one holding the lowest rank on a tie).
std::vector<std::vector<int64_t>> groups_of(const std::vector<std::string> &keys) {
    std::map<std::string, std::vector<int64_t>> by;
    for (int64_t r = 0; r < (int64_t)keys.size(); r++) by[keys[r]].push_back(r);
    std::vector<std::vector<int64_t>> g;
    for (auto &kv : by) g.push_back(kv.second);
    std::sort(g.begin(), g.end(), [](const auto &a, const auto &b) {
        return a.size() != b.size() ? a.size() > b.size() : a[0] < b[0];
    });
    return g;
}

std::string ranks_text(const std::vector<int64_t> &rs) {
    std::ostringstream o;
    o << (rs.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < rs.size(); i++) o << (i ? ", " : "") << rs[i];
    return o.str();
}

const char *kHint =
    "\nA data-dependent branch made the ranks issue different collectives (a skipped or extra backward, "
    "a stage-3 unit run on some ranks only, step() called on some ranks only, or requires_grad changed on "
    "some ranks after zeroify()). Every rank raises this error instead of waiting for the process group's "
    "timeout. Make every rank run the same forward/backward/step sequence (for a branch that skips work, run "
    "it with zero-weighted inputs instead), then restart from the last checkpoint. "
    "(zeroify(check_sequence=False) turns this check off.)";

// The advice for a divergence that began in one of these phases on some ranks only.
const char *phase_hint(int64_t phase) {
    switch (phase) {
        case kPhaseForwardNoGrad:
            return "\nA forward without autograd (evaluation or generation) ran on some ranks only. In stage 3 "
                   "every forward gathers the parameters with collectives, so all ranks must run it: evaluate on "
                   "every rank (each on its own batches; all-reduce the loss), or gather the full parameters on "
                   "every rank first (`with zero_ext.gathered_parameters(model): ...`) and then evaluate on one. "
                   "Restart from the last checkpoint.";
        case kPhaseModelState:
            return "\nmodel.state_dict() gathers the sharded parameters with collectives (stage 3), so every rank "
                   "must call it: call it on every rank and save on rank 0, or checkpoint with "
                   "zero_ext.save(path, model, optimizer) on every rank.";
        case kPhaseOptimState:
            return "\noptimizer.state_dict() and load_state_dict() assemble or distribute the sharded optimizer "
                   "state with collectives, so every rank must call them: call state_dict() on every rank and "
                   "save on rank 0 (each rank then loads the file with load_state_dict()), or checkpoint with "
                   "zero_ext.save(path, model, optimizer) / zero_ext.load(...) on every rank.";
        case kPhaseCheckpoint:
            return "\nzero_ext.save, zero_ext.load and zero_ext.consolidated_state_dict are collective: call them "
                   "on every rank.";
        case kPhaseGradStats:
            return "\nA gradient of a zeroified model (stages 1-3) is sharded across the ranks, so its norm, sum "
                   "or max is a collective, as with FSDP2's DTensor gradients: compute it on every rank (then log "
                   "on rank 0), or log the total norm optimizer.clip_grad_norm_() returns.";
        default:
            return nullptr;
    }
}

// The advice for the records where the ranks differ: the phase one of them is in, if it
// has a hint of its own, else the general one.
std::string hint_for(const std::vector<const SeqRecord *> &at) {
    for (const SeqRecord *r : at)
        if (r && phase_hint(r->phase)) return phase_hint(r->phase);
    return kHint;
}


// What a record is, without when (step, micro-step, count): equal in every cycle that
// issues the same collective.
int64_t content(const SeqRecord &r) {
    int64_t h = 0;
    for (int64_t v : {r.phase, r.kind, r.bucket, r.unit, r.numel}) h = mix(h, v);
    return h;
}

}  // namespace

void Sequence::fail(const std::string &msg) {
    diverged_ = true;
    TORCH_CHECK(false, msg);
}

void Sequence::attach(c10::optional<ProcessGroupPtr> pg, int64_t rank, int64_t world) {
    pg_ = std::move(pg);
    rank_ = rank;
    world_ = world;
    pos_.ring.resize(kRing);
}

void Sequence::enable(StorePtr store, std::vector<std::string> names, double patience_s, bool every_phase,
                      int64_t id, StorePtr meet) {
    away_.enable(meet ? std::move(meet) : store, id, rank_, world_);
    waits_.store = std::move(store);
    names_ = std::move(names);
    waits_.patience_s = patience_s;
    sched_.every_phase = every_phase || !waits_.store;   // without a store, waits cannot be compared
    enabled_ = world_ > 1 && pg_.has_value();
    waits_.id = id;
}

void Pattern::finish_pass() {
    recent_[cur_.kind] = cur_.keys;
    if (cycle_.size() < kMaxPasses) cycle_.push_back(std::move(cur_));
    cur_ = Pass();
    pass_++;
}

bool Pattern::next(int64_t key, bool pass_start) {
    if (pass_start || !in_pass_) {
        if (in_pass_) finish_pass();
        in_pass_ = true;
        cur_.kind = key;
        cur_.keys.assign(1, key);
        const Pass *at = pass_ < learned_.size() ? &learned_[pass_] : nullptr;
        const bool hit = at && at->kind == key;
        auto it = recent_.find(key);
        ref_ = hit ? &at->keys : it != recent_.end() ? &it->second : at ? &at->keys : nullptr;
        return hit;
    }
    const size_t p = cur_.keys.size();
    if (p < kMaxKeys) cur_.keys.push_back(key);
    return ref_ && p < ref_->size() && (*ref_)[p] == key;
}

bool Pattern::peek(int64_t key, bool pass_start) const {
    if (pass_start || !in_pass_) {
        const size_t at = pass_ + (in_pass_ ? 1 : 0);   // next() finishes the running pass first
        return at < learned_.size() && learned_[at].kind == key;
    }
    const size_t p = cur_.keys.size();
    return ref_ && p < ref_->size() && (*ref_)[p] == key;
}

void Pattern::end_cycle() {
    if (in_pass_) finish_pass();
    learned_.swap(cycle_);
    cycle_.clear();
    in_pass_ = false;
    pass_ = 0;
    ref_ = nullptr;
}

bool Sequence::mark(int64_t phase, const FrozenSummary &frozen, bool now, bool servable) {
    if (phase == kPhaseStep) {
        pos_.step++;
        pos_.micro = 0;
    } else if (phase == kPhaseBackward) {
        pos_.micro++;
    }
    pos_.phase = phase;
    pos_.frozen = frozen;
    if (!enabled_) return false;
    sched_.pending = true;
    sched_.pending_now = now;
    sched_.servable = servable;
    // A step counts even without a collective (a rank that skips it differs there);
    // Python collectives follow `now`; a servable mark is settled before its reads
    // (Note [Reading alone]). Other marks wait for their first collective.
    if (phase == kPhaseStep || now || servable) commit();
    return away_.on();
}

void Sequence::commit() {
    if (!sched_.pending) return;
    sched_.pending = false;
    const bool servable = sched_.servable;
    sched_.servable = false;
    int64_t key = 0;
    for (int64_t v : {pos_.phase, pos_.frozen.count, pos_.frozen.hash, sched_.since_mark}) key = mix(key, v);
    const int64_t ph = pos_.phase;
    const bool pass_start = ph == kPhaseForward || ph == kPhaseForwardNoGrad || ph >= kPhaseModelState;
    const bool known = sched_.pattern.peek(key, pass_start);
    const bool learning = sched_.every_phase || !learned();
    sched_.flags = (servable ? kFlagServable : 0) | (known ? kFlagKnown : 0);
    // Note [Reading alone]: whether this mark goes away, stays away or comes back (away.h)
    const auto mark_digest = [&] { return digest(next_record(kSeqMark, 0)); };
    switch (away_.at_mark({ph, servable, known, learned()}, key, pos_.step, mark_digest)) {
        case AwayMove::kStay:   // reads alone: nothing of the mark is recorded
            return;
        case AwayMove::kRejoin:   // where the stayers exchanged: theirs is done, so no exchange
            record(next_record(kSeqMark, 0));
            sched_.armed = false;
            sched_.since_mark = 0;
            sched_.pattern.next(key, pass_start);
            return;
        default:   // a mark as any
            break;
    }
    // Exchanged now: a deviation, Python collectives, or a servable mark in the schedules
    // that exchange every phase. Before the pattern learns the mark: a rank that goes away
    // in the exchange leaves no trace.
    const bool now = sched_.pending_now || !known || (servable && learning);
    if (now && (!learning || sched_.pending_now || servable) && !sched_.recording) {
        const SeqRecord r = next_record(kSeqMark, 0);
        const SeqRecord last = pos_.last, slot = pos_.ring[r.seq % kRing];
        pos_.bucket = pos_.unit = -1;
        record(r);
        sched_.armed = false;
        if (auto stayers = exchange(r)) {   // this rank reads alone: the mark and its record are undone
            pos_.last = last;
            pos_.ring[r.seq % kRing] = slot;
            away_.leave(std::move(*stayers));
            return;
        }
    } else if (learning || now) {
        sched_.armed = true;          // exchanged before the phase's next collective (if it has one)
    }
    sched_.since_mark = 0;
    sched_.pattern.next(key, pass_start);
    if (ph == kPhaseStep) {
        sched_.pattern.end_cycle();
        sched_.cycles++;
    }
}

void Sequence::sync() {
    if (!enabled_) return;
    commit();
    sched_.armed = true;
    before(kSeqMark, 0);
}

void Sequence::unit_need(int64_t unit) {
    if (enabled_) commit();   // a pending mark first: it may be where a rank that was away is back
    if (away_.on()) return;   // served: nothing recorded (Note [Reading alone])
    subject(-1, unit);
    if (enabled_) {
        commit();
        const bool known =
            sched_.pattern.next(mix(mix(kUnitNeedBase + unit, sched_.since_mark), kSeqUnitNeed), false);
        sched_.since_mark = 0;
        // exchanged just below
        if (!known && !sched_.every_phase && learned()) sched_.armed = true;
    }
    before(kSeqUnitNeed, 0);
}

void Sequence::before(int64_t kind, int64_t numel) {
    if (enabled_ && kind != kSeqMark) {
        sched_.recording = true;   // a deviation found by the commit is exchanged with this record
        commit();
        sched_.recording = false;
    }
    const SeqRecord r = next_record(kind, numel);
    pos_.bucket = pos_.unit = -1;
    if (away_.on() && enabled_) {   // Note [Back from away]
        const AwayMove move = away_.at_collective(digest(r));
        if (move == AwayMove::kAlone) fail_alone(r);
        if (move == AwayMove::kRejoin) {   // where the stayers exchanged: theirs is done
            record(r);
            sched_.armed = false;
            return;
        }
    }
    record(r);
    if (sched_.armed && enabled_) {
        sched_.armed = false;
        exchange(r);
    }
}

SeqRecord Sequence::next_record(int64_t kind, int64_t numel) const {
    SeqRecord r;
    r.seq = pos_.last.seq + 1;
    r.step = pos_.step, r.micro = pos_.micro, r.phase = pos_.phase, r.kind = kind;
    r.bucket = pos_.bucket, r.unit = pos_.unit, r.numel = numel;
    int64_t h = pos_.last.hash;
    for (int64_t v : {r.step, r.micro, r.phase, r.kind, r.bucket, r.unit, r.numel}) h = mix(h, v);
    r.hash = h;
    return r;
}

void Sequence::record(const SeqRecord &r) {
    pos_.ring[r.seq % kRing] = r;
    pos_.last = r;
    if (r.kind != kSeqUnitNeed && r.kind != kSeqMark) sched_.since_mark = mix(sched_.since_mark, content(r));
}

std::string Sequence::describe(const SeqRecord &r, bool full) const {
    std::ostringstream o;
    o << "step " << (r.phase == kPhaseStep ? r.step : r.step + 1) << ", ";
    switch (r.phase) {
        case kPhaseForward: o << "forward"; break;
        case kPhaseForwardNoGrad: o << "forward without autograd (evaluation or generation)"; break;
        case kPhaseBackward: o << "backward pass " << r.micro; break;
        case kPhaseClip: o << "clip_grad_norm_"; break;
        case kPhaseStep: o << "step()"; break;
        case kPhaseModelState: o << "model.state_dict()"; break;
        case kPhaseOptimState: o << "optimizer.state_dict() or load_state_dict()"; break;
        case kPhaseCheckpoint: o << "zero_ext.save, load or consolidated_state_dict"; break;
        case kPhaseGradStats: o << "a norm of sharded gradients (p.grad.norm() and the like)"; break;
        default: o << "setup"; break;
    }
    if (r.phase != kPhaseBackward && r.phase != kPhaseStep)
        o << " after " << r.micro << " backward pass" << (r.micro == 1 ? "" : "es");
    static const char *kinds[] = {"?", "all-reduce", "reduce-scatter", "all-gather", "broadcast"};
    if (r.kind == kSeqUnitNeed) {
        o << ": unit " << r.unit << " runs";
        if (full) o << " (record #" << r.seq << ")";
        return o.str();
    }
    if (r.kind == kSeqMark) {
        o << " begins";
        if (full) o << " (record #" << r.seq << ")";
        return o.str();
    }
    o << ": " << kinds[(r.kind >= 1 && r.kind <= 4) ? r.kind : 0];
    if (r.unit >= 0) {
        o << " of unit " << r.unit << " (bucket " << r.bucket << ")";
    } else if (r.bucket >= 0) {
        o << " of bucket " << r.bucket;
    } else if (r.kind == kSeqAllReduce) {
        o << " of the gradient norm";
    }
    if (!full) return o.str();
    o << " (" << r.numel << " elements, record #" << r.seq << ")";
    return o.str();
}

std::string Sequence::diagnose(const std::vector<std::vector<SeqRecord>> &rings,
                               const std::vector<std::string> &whats) const {
    const int64_t n = (int64_t)rings.size();
    int64_t lo = 1, hi = 0;
    for (const auto &ring : rings) {
        if (!ring.empty()) {
            lo = std::max(lo, ring.front().seq);
            hi = std::max(hi, ring.back().seq);
        }
    }
    for (int64_t s = lo; s <= hi; s++) {
        std::vector<std::string> keys(n);
        std::vector<const SeqRecord *> at(n, nullptr);
        bool absent = false;
        for (int64_t r = 0; r < n; r++) {
            for (const auto &rec : rings[r])
                if (rec.seq == s) at[r] = &rec;
            keys[r] = at[r] ? std::to_string(at[r]->hash) : "none";
            absent = absent || !at[r];
        }
        auto groups = groups_of(keys);
        if (groups.size() == 1) continue;
        // Ranks that issued fewer collectives while the others agree on what they issued:
        // waiting for a collective that everyone issued is a slow rank, not a divergence.
        if (absent && groups.size() == 2 && keys[groups[0][0]] != "none" && keys[groups[1][0]] == "none") return "";
        if (absent && groups.size() == 2 && keys[groups[0][0]] == "none") return "";
        std::ostringstream o;
        std::vector<int64_t> odd;
        for (size_t g = 1; g < groups.size(); g++) odd.insert(odd.end(), groups[g].begin(), groups[g].end());
        std::sort(odd.begin(), odd.end());
        const SeqRecord *first_odd = at[odd[0]];
        o << "zero_ext: collective sequence diverged: " << ranks_text(odd) << " differ"
          << (odd.size() == 1 ? "s" : "") << " from " << ranks_text(groups[0]) << " at record #" << s;
        if (first_odd) o << " (" << describe(*first_odd, false) << ")";
        o << ":";
        for (const auto &g : groups) {
            o << "\n  " << ranks_text(g) << ": ";
            const SeqRecord *rec = at[g[0]];
            if (rec) {
                o << describe(*rec);
            } else {
                o << "has no record #" << s;
            }
            if (!whats.empty() && !whats[g[0]].empty()) o << "; waiting in " << whats[g[0]];
        }
        o << hint_for(at);
        return o.str();
    }
    return "";
}

std::vector<int64_t> Sequence::digest(const SeqRecord &r) const {
    std::vector<int64_t> d(kDigest);
    put(r, d.data());   // r.hash covers this record and every earlier one
    const FrozenSummary &f = pos_.frozen;
    d[9] = f.count, d[10] = f.first, d[11] = f.first_bucket, d[12] = f.hash;
    d[13] = sched_.flags;
    return d;
}

std::optional<std::vector<int64_t>> Sequence::exchange(const SeqRecord &next) {
    sched_.exchanges++;
    constexpr int64_t D = kDigest;
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    const std::vector<int64_t> dg = digest(next);
    at::Tensor mine = at::from_blob((void *)dg.data(), {D}, i64).clone();
    const int64_t *m = dg.data();
    at::Tensor all = at::empty({world_ * D}, i64);
    watch((*pg_)->_allgather_base(all, mine), "sequence check");
    const int64_t *a = all.data_ptr<int64_t>();
    bool same = true;
    for (int64_t r = 0; r < world_ && same; r++) same = std::memcmp(a + r * D, m, D * sizeof(int64_t)) == 0;
    if (same) return std::nullopt;
    // Note [Going away]: some ranks read alone while the others go on
    if (ExchangeVerdict v = exchange_verdict(a, world_); !v.diverged)
        return v.away[rank_] ? std::optional(std::move(v.stayers)) : std::nullopt;

    std::vector<FrozenSummary> fs(world_);
    for (int64_t r = 0; r < world_; r++) {
        const int64_t *f = a + r * D + kRecordFields;
        fs[r] = {f[0], f[1], f[2], f[3]};
    }
    const std::string frozen = frozen_message(fs, describe(next, false));
    if (!frozen.empty()) fail(frozen);
    // The records differ: every rank saw the same table, so all exchange their rings.
    at::Tensor ring = at::zeros({kRing * kRecordFields}, i64);
    int64_t k = 0;
    for (int64_t s = std::max<int64_t>(1, pos_.last.seq - kRing + 1); s <= pos_.last.seq; s++, k++)
        put(pos_.ring[s % kRing], ring.data_ptr<int64_t>() + k * kRecordFields);
    at::Tensor rings = at::empty({world_ * kRing * kRecordFields}, i64);
    watch((*pg_)->_allgather_base(rings, ring), "sequence check (records)");
    std::vector<std::vector<SeqRecord>> all_rings(world_);
    const int64_t *rp = rings.data_ptr<int64_t>();
    for (int64_t r = 0; r < world_; r++)
        for (int64_t j = 0; j < kRing; j++) {
            SeqRecord rec = get(rp + (r * kRing + j) * kRecordFields);
            if (rec.seq > 0) all_rings[r].push_back(rec);
        }
    std::string msg = diagnose(all_rings, {});
    if (msg.empty()) {
        // different numbers of collectives with agreeing records: name each rank's next one
        std::vector<std::string> keys(world_);
        std::vector<SeqRecord> nexts(world_);
        std::vector<const SeqRecord *> at(world_);
        for (int64_t r = 0; r < world_; r++) {
            nexts[r] = get(a + r * D);
            keys[r] = describe(nexts[r]);
            at[r] = &nexts[r];
        }
        auto groups = groups_of(keys);
        std::ostringstream o;
        o << "zero_ext: collective sequence diverged:";
        for (const auto &g : groups) o << "\n  " << ranks_text(g) << ": " << keys[g[0]];
        o << hint_for(at);
        msg = o.str();
    }
    fail(msg);
}

std::string Sequence::frozen_message(const std::vector<FrozenSummary> &fs, const std::string &where) const {
    std::vector<std::string> fkeys(fs.size());
    for (size_t r = 0; r < fs.size(); r++) fkeys[r] = std::to_string(fs[r].count) + "/" + std::to_string(fs[r].hash);
    auto fgroups = groups_of(fkeys);
    if (fgroups.size() <= 1) return "";
    std::ostringstream o;
    o << "zero_ext: the ranks train different parameters: requires_grad was changed on some ranks after "
         "zeroify(); at " << where << ":";
    for (const auto &g : fgroups) {
        const FrozenSummary &f = fs[g[0]];
        o << "\n  " << ranks_text(g) << ": " << f.count << " trainable parameter" << (f.count == 1 ? "" : "s")
          << " with requires_grad=False";
        if (f.count > 0) {
            const int64_t i = f.first;
            o << " (first: " << (i >= 0 && i < (int64_t)names_.size() ? "'" + names_[i] + "'" : std::to_string(i))
              << ", parameter " << i << " in bucket " << f.first_bucket << ")";
        }
    }
    o << kHint;
    return o.str();
}

std::string Sequence::key(int64_t r) const {
    return "zero_ext/sequence/" + std::to_string(waits_.id) + "/" + std::to_string(r);
}

std::vector<uint8_t> Sequence::blob(const char *what) const {
    const FrozenSummary &fz = pos_.frozen;
    std::vector<int64_t> v{waits_.published, 0, fz.count, fz.first, fz.first_bucket, fz.hash};
    for (int64_t s = std::max<int64_t>(1, pos_.last.seq - kRing + 1); s <= pos_.last.seq; s++) {
        int64_t rec[kRecordFields];
        put(pos_.ring[s % kRing], rec);
        v.insert(v.end(), rec, rec + kRecordFields);
        v[1]++;
    }
    std::vector<uint8_t> out(v.size() * sizeof(int64_t));
    std::memcpy(out.data(), v.data(), out.size());
    out.insert(out.end(), what, what + std::strlen(what));
    return out;
}

std::vector<std::vector<SeqRecord>> Sequence::read_all(std::vector<std::string> *whats, std::vector<int64_t> *ids,
                                                       std::vector<FrozenSummary> *frozen) {
    constexpr size_t H = 6;   // published, records, frozen summary (blob())
    std::vector<std::vector<SeqRecord>> rings(world_);
    whats->assign(world_, "");
    ids->assign(world_, 0);
    frozen->assign(world_, FrozenSummary());
    for (int64_t r = 0; r < world_; r++) {
        if (!waits_.store->check({key(r)})) return {};
        std::vector<uint8_t> b = waits_.store->get(key(r));
        if (b.size() < H * sizeof(int64_t)) return {};   // not waiting (any more)
        int64_t head[H];
        std::memcpy(head, b.data(), sizeof(head));
        const size_t recs = H * sizeof(int64_t) + head[1] * kRecordFields * sizeof(int64_t);
        if (b.size() < recs) return {};
        std::vector<int64_t> v(head[1] * kRecordFields);
        std::memcpy(v.data(), b.data() + H * sizeof(int64_t), v.size() * sizeof(int64_t));
        for (int64_t j = 0; j < head[1]; j++) rings[r].push_back(get(v.data() + j * kRecordFields));
        (*whats)[r] = std::string(b.begin() + recs, b.end());
        (*ids)[r] = head[0];
        (*frozen)[r] = {head[2], head[3], head[4], head[5]};
    }
    return rings;
}

void Sequence::watch(const WorkPtr &work, const char *what) {
    if (!enabled_ || !waits_.store) {
        Communicator::wait(work, what);
        return;
    }
    using clock = std::chrono::steady_clock;
    auto slice = std::chrono::milliseconds((int64_t)(waits_.patience_s * 1000));
    bool published = false, failed = false, deadline_set = false;
    std::string prev;
    std::vector<int64_t> prev_ids;
    clock::time_point fail_deadline;
    for (;;) {
        try {
            work->wait(slice);
            break;
        } catch (const std::exception &) {
            if (work->isCompleted()) failed = true;   // a real failure, not our timeout
        }
        std::string msg;
        try {
            if (!published) {
                waits_.published++;
                waits_.store->set(key(rank_), blob(what));
                published = true;
                slice = std::chrono::milliseconds(250);
            }
            if (failed && !deadline_set) {
                // give the others time to publish: a divergence explains the failure better
                fail_deadline = clock::now() + 2 * std::chrono::milliseconds((int64_t)(waits_.patience_s * 1000));
                deadline_set = true;
                waits_.store->set(key(rank_) + "/failed", std::vector<uint8_t>{1});   // alive, and failing
            }
            std::vector<std::string> whats;
            std::vector<int64_t> ids;
            std::vector<FrozenSummary> frozen;
            auto rings = read_all(&whats, &ids, &frozen);
            if (!rings.empty()) {
                msg = frozen_message(frozen, "step " + std::to_string(pos_.step + 1));
                if (msg.empty()) msg = diagnose(rings, whats);
            }
            // The same reading twice: a rank that merely moved on would have changed its key.
            if (!msg.empty() && msg == prev && ids == prev_ids) fail(msg);
            prev = msg;
            prev_ids = ids;
        } catch (const std::exception &e) {
            if (std::string(e.what()).rfind("zero_ext:", 0) == 0) throw;   // the diagnosis
            failed = failed || work->isCompleted();
            if (failed) break;    // the store is gone too: report the collective's failure
        }
        if (failed) {
            if (clock::now() > fail_deadline) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(250));
        }
    }
    std::string gone;
    if (published) {
        try {
            if (failed) gone = silent_ranks();
            waits_.store->set(key(rank_), std::vector<uint8_t>{});
        } catch (const std::exception &) {
        }
    }
    if (failed) diverged_ = true;   // collectives in flight will never complete either
    if (!gone.empty()) {   // the collective failed because those ranks left: say so
        try {
            Communicator::wait(work, what);
        } catch (const std::exception &e) {
            fail("zero_ext: " + gone + " stopped answering (left the job or crashed) while this rank waited in " +
                 what + ". What this rank saw: " + e.what());
        }
    }
    Communicator::wait(work, what);   // returns at once, or raises the collective's own failure
}

std::string Sequence::silent_ranks() const {
    std::vector<int64_t> silent;
    for (int64_t r = 0; r < world_; r++) {
        const bool failing = waits_.store->check({key(r) + "/failed"});
        const bool waiting = waits_.store->check({key(r)}) && !waits_.store->get(key(r)).empty();
        if (!failing && !waiting) silent.push_back(r);
    }
    return silent.empty() ? std::string() : ranks_text(silent);
}

void Sequence::fail_alone(const SeqRecord &attempt) {
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

// ---- the engine's side

// Digests travel on a group of their own (a second gloo group over the same ranks,
// made by zeroify), so that a rank in a digest never pairs with a data collective
// another rank issued (gloo aborts the process when a message exceeds the buffer
// posted for it). Without one, they use the engine's group.
FrozenSummary FrozenSummary::of(const Params &params, const std::vector<int64_t> &bucket_of) {
    FrozenSummary f;
    for (int64_t i = 0; i < (int64_t)params.size(); i++) {
        if (params[i].requires_grad()) continue;
        if (f.count++ == 0) {
            f.first = i;
            f.first_bucket = bucket_of[i];
        }
        f.hash = mix(f.hash, i);
    }
    return f;
}

}  // namespace zx
