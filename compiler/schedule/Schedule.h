//===- Schedule.h - pipeline schedules as per-rank instruction lists ------===//
//
// A pipeline schedule says, for each pipeline rank, in which order it runs the
// forward and backward passes of its stages over the micro-batches of one
// step. The generated per-rank code follows these lists literally; a receive
// blocks until the neighbouring stage has sent, so a list is correct when it
// never waits on something that has to wait on it (Timeline.h checks that).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PIPELINE_SCHEDULE_H
#define CARVE_COMPILER_PIPELINE_SCHEDULE_H

#include <string>
#include <vector>

namespace carve::pipeline {

enum class ScheduleKind { GPipe, OneFOneB, Interleaved };

/// "gpipe", "1f1b", "interleaved". On an unknown name returns false and sets
/// `error` to e.g. "unknown pipeline schedule 'foo' (known: gpipe, 1f1b,
/// interleaved)".
bool parseScheduleKind(const std::string &name, ScheduleKind &kind, std::string &error);

/// "gpipe", "1f1b", "interleaved".
const char *scheduleName(ScheduleKind kind);

/// One step of one pipeline rank's program.
struct Instr {
  enum Kind { Forward, Backward } kind;
  /// 0 .. m-1.
  int microBatch;
  /// 0 .. v-1: the rank's model chunk; its stage is chunk * p + rank.
  int chunk;
  /// The activation slot of this chunk on this rank that holds this
  /// micro-batch from its Forward to the end of its Backward (the smallest
  /// free slot when the Forward starts).
  int slot;
};

/// The instruction lists of all pipeline ranks. Stage s = chunk * p + rank:
/// Forward(mb, s) needs Forward(mb, s-1) (s > 0); Backward(mb, s) needs
/// Forward(mb, s) and Backward(mb, s+1) (s < p*v - 1). On every chunk the
/// forwards and the backwards each visit micro-batches 0 .. m-1 in order, so
/// gradient accumulation starts at micro-batch 0 and ends at micro-batch m-1,
/// and a transfer's messages may share tags over micro-batches (equal tags
/// match in the order posted).
struct Schedule {
  ScheduleKind kind;
  /// Pipeline ranks, micro-batches, chunks per rank.
  int p = 1, m = 1, v = 1;
  /// ranks[r]: rank r's instructions in execution order.
  std::vector<std::vector<Instr>> ranks;
  /// slots[r][c]: the activation slots chunk c of rank r needs.
  std::vector<std::vector<int>> slots;

  int stageOf(int rank, int chunk) const { return chunk * p + rank; }
  int numStages() const { return p * v; }

  /// The largest number of micro-batches (all chunks together) whose Forward
  /// has run and whose Backward has not yet finished, on rank `rank`, over
  /// the whole instruction list.
  int maxInFlight(int rank) const;
};

/// Builds the per-rank lists for `p` ranks, `m` micro-batches and `v` chunks
/// per rank. On failure returns false with one line in `error`: p, m or v
/// below 1; v != 1 with gpipe or 1f1b; interleaved with m not a multiple of p.
bool buildSchedule(ScheduleKind kind, int p, int m, int v, Schedule &out, std::string &error);

} // namespace carve::pipeline

#endif // CARVE_COMPILER_PIPELINE_SCHEDULE_H
