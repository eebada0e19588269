// digest.h — what the collective sequence check records and exchanges, as plain integers
// (Note [Collective sequence check], sequence.h). No torch here: the away rule
// (away_rule.h) reads digests, and its test compiles without torch.
#pragma once

#include <cstdint>

namespace zx {

enum SeqKind : int64_t {
    kSeqAllReduce = 1, kSeqReduceScatter = 2, kSeqAllGather = 3, kSeqBroadcast = 4,
    // A stage-3 unit needed by the unit hooks: recorded like a collective (no data), so that
    // a unit one rank skips shows in the digest before the collectives that follow it can
    // pair wrongly. Python passes it as sequence_mark(kUnitNeedBase + unit).
    kSeqUnitNeed = 5,
    // A mark exchanged at once (Note [Exchanges on deviation]): recorded like a collective
    // (no data), so that a rank waiting there shows where it is.
    kSeqMark = 6,
};
// Marked by the Python glue (zero_ext/model.py, optim.py use the same numbers).
enum SeqPhase : int64_t {
    kPhaseNone = 0, kPhaseForward = 1, kPhaseBackward = 2, kPhaseClip = 3, kPhaseStep = 4,
    kPhaseForwardNoGrad = 5,   // a forward without autograd: evaluation, generation
    // Python collectives (Engine::sequence_sync): always exchanged first
    kPhaseModelState = 6,      // model.state_dict() (stage 3 gathers the units)
    kPhaseOptimState = 7,      // optimizer.state_dict() / load_state_dict()
    kPhaseCheckpoint = 8,      // zero_ext.save / load / consolidated_state_dict
    kPhaseGradStats = 9,       // norms of sharded gradients (Note [Sharded gradients])
    kPhaseLast = kPhaseGradStats,
};
// The phases that only read (Note [Reading alone], away.h): a rank in one alone goes away
// whatever its pattern says; a servable forward (stage 3) only where it leaves its pattern.
inline bool reads_only(int64_t phase) { return phase >= kPhaseForwardNoGrad && phase <= kPhaseCheckpoint; }
// sequence_mark(kUnitNeedBase + unit): stage-3 unit `unit` is needed (Sequence::unit_need).
constexpr int64_t kUnitNeedBase = 16;

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
// An exchanged digest: the record (its fields in order), the frozen summary (4), the mark's flags (1).
constexpr int64_t kDigest = kRecordFields + 5;
constexpr int64_t kDigestPhase = 3, kDigestFlags = kDigest - 1;   // where a digest holds these
constexpr int64_t kFlagServable = 1, kFlagKnown = 2;   // the mark could be served; its pattern expected it

}  // namespace zx
