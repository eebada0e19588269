// away.h — a rank that reads alone: the sequence check's side of the shard server
// (zero_ext/shard_server.py serves; away.cpp decides when a rank is away and when it is back).
//
// Note [Reading alone]
//   DDP scripts read on rank 0 alone: `if rank == 0: torch.save({"model": ...,
//   "optimizer": optimizer.state_dict()})`, an evaluation or generation loop, a
//   save_pretrained. Under ZeRO these read pieces other ranks hold. They are only reads,
//   and the state cannot change while one rank is away: no rank finishes a reduction,
//   a gather or a step of the next iteration without it. So the other ranks' shard
//   servers (threads on a gloo group of their own, zero_ext/shard_server.py) answer the
//   reader "as of step k" once their own step k is done, while their main threads block
//   in their next collective until the reader comes back. What the reader gets is what
//   the collective path computes from the same pieces, bit for bit.
//   Which marks may be served: the phases that only read (reads_only: a forward without
//   autograd, model.state_dict(), optimizer.state_dict(), consolidated_state_dict) and,
//   in stage 3, a forward with autograd (an evaluation that never calls backward looks
//   like a training forward until it ends). The Python glue marks them servable
//   (Engine::sequence_mark), which settles them at once, before any collective:
//   - A servable mark the rank's pattern expects runs as before (the training forward:
//     nothing changes on the step path). One it does not expect, one that only reads, and
//     any while the pattern is learned meet the other ranks in the process group's store
//     (together()): if every rank arrives at the same mark within kAwayJoinS, they go on
//     as before (all ranks evaluate: the exchange, the collectives); otherwise the first
//     to give up writes "away", and every rank arriving there reads it and goes away;
//     except, while the pattern is learned (every rank exchanges at its servable marks
//     then), a forward with autograd: it goes to the exchange, which decides without a
//     deadline. So a rank that is merely late to its first training forward (under load,
//     by more than kAwayJoinS) is never taken for one that reads alone.
//   - Without a store the ranks meet in the digest exchange (every phase): where digests
//     differ, the ranks in a servable phase that read only, or that left their pattern,
//     go away, provided the others (the stayers) agree among themselves (where every rank
//     reads or left its pattern, as while it is learned, the readers go away and the
//     forwards with autograd stay); they keep the
//     stayers' digest and rejoin at the record that equals it (the stayers' exchange of
//     that mark already happened; rejoin_at), and any other collective fails.
//   While away nothing is recorded: no record, no pattern key, no exchange, so the
//   excursion leaves no trace and the rank's pattern stays the others'. It is back at the
//   first mark that cannot be served or that its pattern expects: where the pattern
//   expects no exchange the others make none either, and an exchange (a deviation, or
//   every phase) meets the one the others wait in; a rank that now trains alone waits in
//   that exchange and is named as any divergence. A collective without a mark while away
//   (not routed to the servers) fails at once (fail_alone): the rank publishes its records
//   with the attempted one, as a watched wait does, and every rank raises the same
//   divergence message. The others are never blamed for a long absence: their watched
//   waits publish after the patience, and a rank that is away publishes nothing, so the
//   comparison never completes and they keep waiting.
//   A grad-enabled evaluation that rank 0 runs alone is not away at first (its forward is
//   expected): it makes the others' training-forward collectives one for one, the gathers
//   that start a backward included (zero_ext/model.py), and is not learned as a pass;
//   rank 0's real training forward then deviates and is served, and its backward meets
//   theirs.
//   On NCCL the same holds, with nothing of the engine's group involved: the ranks meet in
//   the group's store (the TCPStore torchrun or init_process_group made), the servers'
//   gloo group carries host copies that a server makes on a CUDA stream of its own after
//   the event its rank recorded at the end of the step (so no copy waits behind an NCCL
//   collective that waits for the reader), and the every-phase exchange resumes when the
//   reader is back, meeting the exchange the others wait in. Tested on gloo in both
//   schedules and on "cuda:gloo" (make gpu-check); not yet on NCCL.
#pragma once

namespace zx {

// How long a rank that left its pattern in a servable phase waits in the store for the
// others to arrive at the same deviation before it reads alone (Note [Reading alone]).
constexpr double kAwayJoinS = 0.25;

}  // namespace zx
