//===- Timeline.h - timing a pipeline schedule, and drawing it ------------===//
//
// Runs the per-rank lists of a Schedule under its dependency rules with a cost
// per stage, which both proves a schedule free of deadlock and measures its
// bubble, and renders the result as a Chrome trace and as an SVG picture.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PIPELINE_TIMELINE_H
#define CARVE_COMPILER_PIPELINE_TIMELINE_H

#include "compiler/schedule/Schedule.h"

#include <string>
#include <vector>

namespace carve::pipeline {

/// Seconds for one micro-batch on a stage.
struct StageCost {
  double forward = 1, backward = 2;
};

/// One instruction placed in time.
struct TimedInstr {
  int rank;
  Instr instr;
  int stage;
  double start, end;
};

struct Timeline {
  /// Every instruction of every rank: rank 0's in list order, then rank 1's...
  std::vector<TimedInstr> items;
  /// The end of the last instruction.
  double makespan = 0;
  /// The largest busy time of any rank (the sum of its durations).
  double compute = 0;
  /// (makespan - compute) / compute; 0 when nothing costs anything.
  double bubble = 0;
  /// Per rank, as Schedule::maxInFlight.
  std::vector<int> peakInFlight;
};

/// Simulates the lists: a rank starts its next instruction as soon as it is
/// free and the instructions it depends on have finished, plus `sendLatency`
/// seconds (0 allowed) for a dependency that ran on another rank. `costs` has
/// one entry per stage (p*v). Returns false with one line in `error` on
/// malformed input, or "pipeline schedule deadlocks: rank R waits for ..."
/// when no rank can progress.
bool simulate(const Schedule &s, const std::vector<StageCost> &costs, double sendLatency,
              Timeline &out, std::string &error);

/// Chrome trace-event JSON (Perfetto, chrome://tracing): one complete ("X")
/// event per instruction named "F3" / "B3" ("F3.c1" for chunk 1 when v > 1),
/// microseconds, thread = rank; thread names list each rank's stages;
/// "metadata" holds title, schedule, p, m, v, bubble and makespan.
std::string chromeTraceJson(const Schedule &s, const Timeline &t, const std::string &title);

/// A self-contained SVG picture: a row per rank, a box per instruction
/// (forwards and backwards in two colours, lighter for later chunks) with its
/// micro-batch number, idle time blank, a time axis and a title line with the
/// schedule, p, m, v and the bubble.
std::string timelineSvg(const Schedule &s, const Timeline &t, const std::string &title);

} // namespace carve::pipeline

#endif // CARVE_COMPILER_PIPELINE_TIMELINE_H
