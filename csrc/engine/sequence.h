// sequence.h — the collective sequence check: every rank records the collectives
// the engine issues (which step, which backward pass, which bucket or unit), and
// ranks whose sequences differ are named on every rank instead of hanging.
//
// Note [Collective sequence check]
//   A data-dependent branch makes the ranks issue different collectives: one rank skips
//   a backward, runs one more micro-step, skips a stage-3 unit, calls step() alone, or
//   freezes a parameter the others train. gloo then waits for the process group's
//   timeout (30 minutes), or pairs the wrong collectives silently. Two mechanisms catch
//   it: checkpoints (here) and watched waits (Note [Watched waits]).
//   Checkpoints. The Python glue marks phases (forward, backward, clip, step). Before
//   the first collective after a mark, every rank all-gathers a digest of kDigest (14)
//   integers (digest.h): its record of that collective and a summary of which trainable
//   parameters no longer require grad. A record holds the optimizer step, the backward
//   passes since the last step, the phase, kind, bucket, unit, numel, the collective
//   count and a running hash of all earlier records.
//   Digests travel on a gloo group of their own (zeroify makes it). So ranks in
//   different phases meet in this small all-gather, never in a mismatched data
//   collective (gloo aborts a process that receives more bytes than it posted).
//   Skipped backwards, extra micro-steps, a step() on some ranks only and a changed
//   requires_grad are caught there, before any data is exchanged wrongly. Stage 3 also
//   records each unit the hooks need (no data; Engine::sequence_mark with a unit code),
//   so a unit skipped in forward is caught at the start of backward.
//   On by default, on every backend. Where the exchange runs: Note [Exchanges on
//   deviation].
//
// Note [Watched waits]
//   A divergence inside a phase (a stage-3 unit skipped by one rank) makes two ranks
//   issue different collectives, which hang. Every engine wait gives up after
//   `patience` seconds. The rank then writes its last records to the process group's
//   store and reads everyone else's. Once every rank has published and the records
//   disagree, every rank raises the same message naming the first collective where
//   they differ. The same reading must come twice, so a rank that merely moved on is not
//   blamed. Ranks whose records agree are slow, not divergent: they keep waiting (the
//   process group's own timeout still applies).
//   The message names, per group of ranks that agree, the step, the backward pass, and
//   the collective with its bucket (and stage-3 unit). The largest group (rank 0's on a
//   tie) is the reference; the others are the divergent ranks.
//
// Note [Exchanges on deviation]
//   A digest all-gather at every phase is a barrier per phase: on a small model on CPU
//   it cost 25-65% of a step (ranks wait for the slowest at each one, and a gloo
//   all-gather is not free). Where waits can be watched (gloo, "cuda:gloo": the host
//   blocks in a wait, so a wait can time out and consult the store), the exchange runs
//   only where a rank leaves the pattern it has learned (Note [Learned pattern]).
//   A mark that does not match (rank 0 alone evaluates, one rank runs an extra
//   micro-step or skips a unit or a step, requires_grad changed) exchanges at once,
//   before the rank's next collective. If every rank deviated alike (all evaluate),
//   they meet in that exchange and go on. If one rank did, it waits there while the
//   others block in their next collective, which that rank never issued: nothing pairs
//   wrongly, both waits run out of patience, and Note [Watched waits] names the ranks.
//   Phases that run Python collectives (state_dict(), checkpoints) always exchange
//   first (sync()), so a rank calling one alone is named, not paired with the others'
//   training collectives. Where waits cannot be watched (NCCL: a wait only orders
//   streams), every phase exchanges, as in the first cycles; there the host runs ahead
//   of the device, so the exchange's latency is hidden.
//
// Note [Learned pattern]
//   A cycle is the marks from one step() to the next, cut into passes (a pass begins at
//   a forward). Each mark has a key: the phase (a forward without autograd is a phase
//   of its own), the frozen summary, and what the collectives issued since the previous
//   mark were (not when: no step count). Stage 3's unit needs are marks too. A mark
//   counts only once a collective follows it (a step at once): a phase that
//   communicates nothing, such as a forward in stages 0-2, may run on one rank alone,
//   as under DDP.
//   The first kLearnCycles cycles exchange at every phase, so the ranks agree on them.
//   From then on (Pattern) the k-th pass of a cycle is expected when its first key is
//   the one the last cycle's k-th pass had. Its marks are compared with the same
//   positions of that pass, or of the most recent pass of its kind when it was not
//   expected (after all ranks begin to evaluate 100 batches, each batch's pass begins
//   with an exchange and its unit needs match the last batch's).
//   Every rank that runs the same program holds the same pattern and makes the same
//   decisions, so a mark that matches needs no exchange; of two ranks that differ at a
//   mark, at most one can match.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/away.h"     // defines: Away, StorePtr
#include "engine/digest.h"   // defines: SeqKind, SeqPhase, SeqRecord, kDigest (no torch)

namespace zx {

class Params;   // params.h

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Which trainable parameters no longer require grad (Note [Collective sequence check]).
struct FrozenSummary {
    int64_t count = 0, first = -1, first_bucket = -1, hash = 0;

    // the parameters' (bucket_of: each one's bucket) that do not require grad now
    static FrozenSummary of(const Params &params, const std::vector<int64_t> &bucket_of);
};

// Note [Learned pattern]: the keys of the marks of the last cycle, by pass,
// and of the most recent pass of each kind (its first key). Whether a mark is
// expected is a function of this state, which every rank running the same program
// holds alike, and at most one key is expected at each mark: so two ranks that
// differ at a mark cannot both go on without an exchange.
class Pattern {
public:
    // Records mark `key` (the first of a pass when pass_start); whether it is expected.
    bool next(int64_t key, bool pass_start);
    // Whether next(key, pass_start) would find it expected, recording nothing.
    bool peek(int64_t key, bool pass_start) const;
    void end_cycle();   // step(): this cycle is the pattern of the next

private:
    struct Pass {
        int64_t kind = 0;
        std::vector<int64_t> keys;
    };
    void finish_pass();
    std::vector<Pass> learned_, cycle_;   // the last cycle's passes, this one's (bounded)
    std::map<int64_t, std::vector<int64_t>> recent_;
    Pass cur_;                            // the pass running
    bool in_pass_ = false;
    size_t pass_ = 0;                     // its index in the cycle
    const std::vector<int64_t> *ref_ = nullptr;   // the pass it is compared with
    static constexpr size_t kMaxPasses = 4096, kMaxKeys = 1 << 16;
};

class Sequence {
public:
    void attach(c10::optional<ProcessGroupPtr> pg, int64_t rank, int64_t world);
    // Turns the check on. store: the process group's store (null: checkpoints only);
    // names: the engine's parameters, for messages; patience_s: how long a wait
    // runs before the ranks compare positions.
    // every_phase: exchange at every phase (waits cannot be watched, e.g. NCCL). id: this
    // engine's among the process's, the same on every rank (it keys the store's records).
    // meet: the group's store, also where waits cannot be watched (NCCL): ranks that leave
    // their pattern in a servable phase meet there (Note [Reading alone]); null: they meet
    // in the digest exchange.
    void enable(StorePtr store, std::vector<std::string> names, double patience_s, bool every_phase, int64_t id,
                StorePtr meet = StorePtr());
    int64_t exchanges() const { return sched_.exchanges; }
    bool enabled() const { return enabled_; }
    // A divergence was reported, or a watched collective failed: collectives in flight
    // will never complete.
    bool diverged() const { return diverged_; }

    void subject(int64_t bucket, int64_t unit) { pos_.bucket = bucket; pos_.unit = unit; }
    // A phase begins. The exchange runs before the next collective, or at once when
    // `now` or on a deviation (Note [Exchanges on deviation]). servable: the phase only
    // reads what other ranks hold, so a rank in it alone may be served (Note [Reading
    // alone], away.h): it is settled at once. Returns whether this rank is away.
    bool mark(int64_t phase, const FrozenSummary &frozen, bool now = false, bool servable = false);
    // This rank reads alone: its reads go to the other ranks' shard servers, and its
    // sequence records nothing until it is back where the others wait (away.h).
    bool away() const { return away_.on(); }
    // Stage 3: unit `unit` is needed (recorded, no data; exchanged on a deviation).
    void unit_need(int64_t unit);
    // Exchange digests now (every rank that runs the same program calls it here).
    void sync();
    // Called by the Communicator before each collective: records it and, after a
    // mark, runs the checkpoint exchange first.
    void before(int64_t kind, int64_t numel);
    // A wait that compares positions through the store when it runs long.
    void watch(const WorkPtr &work, const char *what);

private:
    [[noreturn]] void fail(const std::string &msg);
    // Exchanges digests with `next`; a mismatch where some ranks are in servable phases sends
    // them away instead of failing (exchange_verdict, Note [Going away]). Returns, when this
    // rank goes away, the digest of the ranks that go on (empty: none does).
    std::optional<std::vector<int64_t>> exchange(const SeqRecord &next);
    // A collective this rank cannot make alone (Note [Back from away]): raises on every rank.
    [[noreturn]] void fail_alone(const SeqRecord &attempt);
    std::vector<int64_t> digest(const SeqRecord &r) const;   // what exchange() sends for r
    SeqRecord next_record(int64_t kind, int64_t numel) const;   // the record a collective would get
    void record(const SeqRecord &r);
    std::vector<uint8_t> blob(const char *what) const;
    // Every rank's published records, or empty when not all have published.
    std::vector<std::vector<SeqRecord>> read_all(std::vector<std::string> *whats, std::vector<int64_t> *ids,
                                                 std::vector<FrozenSummary> *frozen);
    // The message when the ranks' frozen summaries differ, else "".
    std::string frozen_message(const std::vector<FrozenSummary> &fs, const std::string &where) const;
    std::string diagnose(const std::vector<std::vector<SeqRecord>> &rings, const std::vector<std::string> &whats) const;
    std::string describe(const SeqRecord &r, bool full = true) const;
    std::string key(int64_t r) const;
    std::string silent_ranks() const;   // "rank 0": ranks neither waiting nor failing in a watched wait

    c10::optional<ProcessGroupPtr> pg_;
    std::vector<std::string> names_;
    int64_t rank_ = 0, world_ = 1;
    bool enabled_ = false, diverged_ = false;
    // Where this rank is: what the next record holds, the last record and the last kRing
    // records (by seq % kRing).
    struct Position {
        int64_t step = 0, micro = 0, phase = kPhaseNone, bucket = -1, unit = -1;
        FrozenSummary frozen;
        SeqRecord last;
        std::vector<SeqRecord> ring;
    } pos_;
    static constexpr int64_t kRing = 128;
    // When digests are exchanged (Note [Exchanges on deviation]): a mark enters the pattern
    // at the first collective after it (a phase without collectives, such as a stage 0-2
    // forward, leaves no trace, so rank 0 alone may evaluate there), a step at once.
    void commit();
    struct Schedule {
        bool pending = false, pending_now = false, recording = false;
        bool servable = false;            // the pending mark's phase may be served (mark())
        int64_t flags = 0;                // the last committed mark's kFlag* (exchanged digests)
        bool every_phase = true;
        bool armed = false;               // exchange before the next collective
        int64_t exchanges = 0;
        int64_t since_mark = 0;           // hash of the collectives since the last mark
        int64_t cycles = 0;               // cycles completed (step() marks)
        Pattern pattern;
    } sched_;
    static constexpr int64_t kLearnCycles = 2;
    bool learned() const { return sched_.cycles >= kLearnCycles; }
    // Note [Watched waits]: the store the records are
    // published to, this engine's id in its keys, records published, patience.
    struct Waits {
        StorePtr store;
        int64_t id = 0, published = 0;
        double patience_s = 3.0;
    } waits_;
    Away away_;   // whether this rank reads alone (Note [Reading alone], away.h)
};

}  // namespace zx
