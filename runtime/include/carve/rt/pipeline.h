//===- pipeline.h - what pipelined programs need from the runtime ---------===//
//
// A pipelined program's step runs its rank's instruction list (forward or
// backward of one micro-batch on one stage) in order; sends stay in flight
// until the slot that holds their tensor is taken again. `train --trace FILE`
// records every instruction's start and end on every rank (Tracer) and writes
// them as a Chrome trace (the same format as `carve compile --timeline`).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_PIPELINE_H
#define CARVE_RT_PIPELINE_H

#include "carve/rt/comm.h"
#include "carve/rt/program.h"

#include <chrono>
#include <string>
#include <vector>

namespace carve::rt {

/// Completes every handle and empties the list.
inline void waitAll(Communicator &comm, std::vector<CommHandle> &handles) {
  for (CommHandle &h : handles)
    comm.wait(h);
  handles.clear();
}

/// The measured schedule of this rank.
class Tracer {
public:
  struct Event {
    char kind;      // 'F' forward, 'B' backward, 'O' the rest of the step (sync, optimizer)
    int microBatch; // -1 for 'O'
    int stage;
    int64_t step;
    double begin, end; // seconds since the tracer started
  };
  Tracer() : start_(std::chrono::steady_clock::now()) {}
  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void add(const Event &e) { events_.push_back(e); }
  const std::vector<Event> &events() const { return events_; }
  /// Shifts every time by `seconds` (aligns ranks on a common origin).
  void shift(double seconds) {
    for (Event &e : events_)
      e.begin += seconds, e.end += seconds;
  }

private:
  std::chrono::steady_clock::time_point start_;
  std::vector<Event> events_;
};

/// Records one instruction while in scope, when the step is traced.
class TraceSpan {
public:
  TraceSpan(StepContext &ctx, char kind, int microBatch, int stage)
      : ctx_(ctx), kind_(kind), microBatch_(microBatch), stage_(stage),
        begin_(ctx.tracer ? ctx.tracer->now() : 0) {}
  ~TraceSpan() {
    if (ctx_.tracer)
      ctx_.tracer->add({kind_, microBatch_, stage_, ctx_.step, begin_, ctx_.tracer->now()});
  }
  TraceSpan(const TraceSpan &) = delete;
  TraceSpan &operator=(const TraceSpan &) = delete;

private:
  StepContext &ctx_;
  char kind_;
  int microBatch_, stage_;
  double begin_;
};

/// Chrome trace-event JSON of every rank's events (`perRank[r]` from world
/// rank r), one track per rank, times in microseconds.
std::string chromeTrace(const std::vector<std::vector<Tracer::Event>> &perRank,
                        const std::string &title);

} // namespace carve::rt

#endif // CARVE_RT_PIPELINE_H
