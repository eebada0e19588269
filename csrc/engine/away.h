// away.h — a rank that reads alone: the sequence check's side of the shard server
// (zero_ext/alone/ serves). Away holds whether this rank is away and how it left;
// the rule it applies is away_rule.h's; Sequence (sequence.h) holds an Away and applies
// its moves.
//
// Note [Reading alone]
//   DDP scripts read on rank 0 alone: a torch.save of the model and optimizer state, an
//   evaluation or generation loop, a save_pretrained. Under ZeRO these read pieces other
//   ranks hold. A rank that does so "reads alone"; while it does, it is "away".
//   They are only reads, and the state cannot change while a rank is away: no rank
//   finishes a reduction, a gather or a step of the next iteration without it. So the
//   other ranks' shard servers (threads on a gloo group of their own,
//   zero_ext/alone/serving.py) answer the reader "as of step k" once their own step k is
//   done. Their main threads block in their next collective until the reader is back.
//   What the reader gets is what the collective path computes from the same pieces, bit
//   for bit.
//   Servable marks: the phases that only read (reads_only in digest.h: a forward without
//   autograd, model.state_dict(), optimizer.state_dict(), consolidated_state_dict) and,
//   in stage 3, a forward with autograd (an evaluation that never calls backward looks
//   like a training forward until it ends). The Python glue marks them servable
//   (Engine::sequence_mark), which settles them at once, before any collective.
//   While away nothing is recorded: no record, no pattern key, no exchange. The excursion
//   leaves no trace, and the rank's pattern stays the others'. Who goes away: Note
//   [Going away]; when it is back: Note [Back from away] (both in away_rule.h).
//   A grad-enabled evaluation rank 0 runs alone is not away at first (its forward is
//   expected). It makes the others' training-forward collectives one for one, the gathers
//   that start a backward included (zero_ext/model.py), and is not learned as a pass.
//   Rank 0's real training forward then deviates and is served; its backward meets theirs.
//
// Note [Reading alone on NCCL]
//   The same holds, with nothing of the engine's group involved. The ranks meet in the
//   group's store (the TCPStore torchrun or init_process_group made). The servers' gloo
//   group carries host copies. A server makes them on a CUDA stream of its own, after the
//   event its rank recorded at the end of the step, so no copy waits behind an NCCL
//   collective that waits for the reader. The every-phase exchange resumes when the
//   reader is back, meeting the exchange the others wait in. Tested on gloo in both
//   schedules and on "cuda:gloo" (make gpu-check); not yet on NCCL.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/away_rule.h"

namespace zx {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// Whether this rank is away, how it left, and where the ranks meet (Note [Reading alone]).
class Away {
public:
    // meet: where the ranks meet at a servable mark (null: in the digest exchange); id: the
    // engine's id, the same on every rank (it keys the store's meetings).
    void enable(StorePtr meet, int64_t id, int64_t rank, int64_t world);
    bool on() const { return on_; }
    // A mark this rank commits at step `step`, with its pattern key. mark_digest: what the
    // mark's record would send (asked only while away). kOn, kStay, kBack, kRejoin or kPending.
    AwayMove at_mark(const MarkFacts &m, int64_t key, int64_t step,
                     const std::function<std::vector<int64_t>()> &mark_digest);
    // Away, at a collective whose record would send `digest`: kBack, kRejoin or kAlone.
    AwayMove at_collective(const std::vector<int64_t> &digest);
    // An exchange sent this rank away; stayers: the digest of the ranks that go on (empty:
    // every rank went away). Nothing of the exchanged mark stays recorded (Sequence).
    void leave(std::vector<int64_t> stayers);

private:
    bool together(int64_t key, int64_t step);   // are all ranks at this deviation? (Note [Going away])
    void back();

    bool on_ = false;
    Absence absence_;
    StorePtr store_;
    int64_t id_ = 0, rank_ = 0, world_ = 1;
    int64_t step_ = -1, meetings_ = 0;   // store meetings at this step
};

}  // namespace zx
