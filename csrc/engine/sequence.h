// sequence.h — the collective sequence check: every rank records the collectives
// the engine issues (which step, which backward pass, which bucket or unit), and
// ranks whose sequences differ are named on every rank instead of hanging.
//
// Note [Collective sequence check]
//   A data-dependent branch (one rank skipping a backward, running one more
//   micro-step, skipping a stage-3 unit, calling step() alone, or freezing a
//   parameter the others train) makes the ranks issue different collectives;
//   gloo then waits for the process group's timeout (30 minutes), or pairs the
//   wrong collectives silently. Two mechanisms catch it:
//   1. Checkpoints. The Python glue marks phases (forward, backward, clip,
//      step). Before the first collective after a mark, every rank all-gathers
//      a 13-integer digest: its record of that collective (optimizer step,
//      backward passes since the last step, phase, kind, bucket, unit, numel,
//      collective count and a running hash of all its earlier records) and a
//      summary of which trainable parameters no longer require grad. Digests
//      travel on a gloo group of their own (zeroify makes it), so ranks in
//      different phases meet in this small all-gather and never in a mismatched
//      data collective (gloo aborts a process that receives more bytes than it
//      posted). Skipped backwards, extra micro-steps, a step() on some ranks
//      only and a changed requires_grad are caught there, before any data is
//      exchanged wrongly. Stage 3 also records each unit the hooks need (no
//      data; Engine::sequence_mark with a unit code), so a unit skipped in
//      forward is caught at the start of backward. One all-gather per phase.
//   2. Watched waits. A divergence inside a phase (a stage-3 unit skipped by
//      one rank) makes two ranks issue different collectives, which hang. Every
//      engine wait gives up after `patience` seconds; the rank then writes its
//      last records to the process group's store and reads everyone else's.
//      Once every rank has published and the records disagree (the same
//      reading twice, so that a rank that merely moved on is not blamed), every
//      rank raises the same message naming the first collective where they
//      differ. Ranks whose records agree are slow, not divergent: they keep
//      waiting (the process group's own timeout still applies).
//   The message names, per group of ranks that agree, the step, the backward
//   pass, and the collective with its bucket (and stage-3 unit); the largest
//   group (rank 0's on a tie) is taken as the reference and the others as the
//   divergent ranks. It runs on gloo; off for other backends.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <string>
#include <vector>

namespace zx {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

enum SeqKind : int64_t { kSeqAllReduce = 1, kSeqReduceScatter = 2, kSeqAllGather = 3, kSeqBroadcast = 4 };
// Marked by the Python glue (zero_ext/model.py, optim.py use the same numbers).
enum SeqPhase : int64_t { kPhaseNone = 0, kPhaseForward = 1, kPhaseBackward = 2, kPhaseClip = 3, kPhaseStep = 4 };

struct SeqRecord {
    int64_t seq = 0;      // 1-based count of collectives issued
    int64_t step = 0;     // step() calls begun
    int64_t micro = 0;    // backward passes begun since the last step()
    int64_t phase = kPhaseNone;
    int64_t kind = 0;
    int64_t bucket = -1;
    int64_t unit = -1;    // stage 3
    int64_t numel = 0;
    int64_t hash = 0;     // running hash of this and every earlier record
};
constexpr int64_t kRecordFields = 9;

// Which trainable parameters no longer require grad (Note [Collective sequence check]).
struct FrozenSummary {
    int64_t count = 0, first = -1, first_bucket = -1, hash = 0;
};

class Sequence {
public:
    void attach(c10::optional<ProcessGroupPtr> pg, int64_t rank, int64_t world);
    // Turns the check on. store: the process group's store (null: checkpoints only);
    // names: the engine's parameters, for messages; patience_s: how long a wait
    // runs before the ranks compare positions.
    void enable(StorePtr store, std::vector<std::string> names, double patience_s);
    bool enabled() const { return enabled_; }
    // A divergence was reported: collectives in flight will never complete.
    bool diverged() const { return diverged_; }

    void subject(int64_t bucket, int64_t unit) { bucket_ = bucket; unit_ = unit; }
    void mark(int64_t phase, const FrozenSummary &frozen);
    // Called by the Communicator before each collective: records it and, after a
    // mark, runs the checkpoint exchange first.
    void before(int64_t kind, int64_t numel);
    // A wait that compares positions through the store when it runs long.
    void watch(const WorkPtr &work, const char *what);

private:
    [[noreturn]] void fail(const std::string &msg);
    void exchange(const SeqRecord &next);
    std::vector<uint8_t> blob(const char *what) const;
    // Every rank's published records, or empty when not all have published.
    std::vector<std::vector<SeqRecord>> read_all(std::vector<std::string> *whats, std::vector<int64_t> *ids);
    std::string diagnose(const std::vector<std::vector<SeqRecord>> &rings, const std::vector<std::string> &whats) const;
    std::string describe(const SeqRecord &r, bool full = true) const;
    std::string key(int64_t r) const;

    c10::optional<ProcessGroupPtr> pg_;
    StorePtr store_;
    std::vector<std::string> names_;
    int64_t rank_ = 0, world_ = 1;
    bool enabled_ = false, armed_ = false, diverged_ = false;
    double patience_s_ = 3.0;
    int64_t id_ = 0, published_ = 0;
    int64_t step_ = 0, micro_ = 0, phase_ = kPhaseNone, bucket_ = -1, unit_ = -1;
    FrozenSummary frozen_;
    SeqRecord last_;
    std::vector<SeqRecord> ring_;   // the last kRing records, by seq % kRing
    static constexpr int64_t kRing = 128;
};

}  // namespace zx
