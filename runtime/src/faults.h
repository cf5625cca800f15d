//===- faults.h - test-only fault injection from the environment ----------===//
//
// Tests of failure handling make a rank fail on demand through environment
// variables (runtime/README.md#fault-injection, docs/failures.md):
//
//   CARVE_FAULT_RANK, CARVE_FAULT_STEP, CARVE_FAULT_SIGNAL   a rank raises a signal
//   CARVE_FAULT_NAN_STEP, CARVE_FAULT_NAN_TENSOR,            a NaN in a gradient
//   CARVE_FAULT_NAN_RANK                                     or the loss
//   CARVE_TEST_SAVE_DELAY_MS                                 a slow checkpoint save
//
// Every such hook is behind FaultInjection. A build configured with
// -DCARVE_TEST_HOOKS=OFF compiles them out: the variables are not read and
// every hook does nothing.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_FAULTS_H
#define CARVE_RT_SRC_FAULTS_H

#include "carve/rt/program.h"

#include <csignal>
#include <cstdint>
#include <string>

namespace carve::rt {

/// The failures the environment asks this run to inject.
class FaultInjection {
public:
  /// Reads and validates the CARVE_FAULT_* variables against the compiled
  /// plan; false with `error` naming the variable at fault.
  bool readEnvironment(std::string &error);

  /// At the start of step `step`: raises the requested signal if this is
  /// the rank and the step.
  void atStepStart(int worldRank, int64_t step) const;

  /// Once the gradients of step `ctx.step` are synchronized (before the
  /// norm): puts a NaN into the requested tensor if this rank holds it, the
  /// loss or the first element of this rank's part of a gradient (on a
  /// device, in the device arena).
  void poisonGradient(StepContext &ctx, const Program &p, int worldRank, int dpRank) const;

  /// Milliseconds to sleep at each stage of a save (CARVE_TEST_SAVE_DELAY_MS):
  /// widens the window in which a test kills a saving run.
  static int64_t saveDelayMs();

private:
  int64_t rank = -1, step = -1; // CARVE_FAULT_RANK / _STEP: this rank raises...
  int signal = SIGKILL;         // ...CARVE_FAULT_SIGNAL (KILL, STOP, SEGV) at step's start
  int64_t nanStep = -1;         // CARVE_FAULT_NAN_STEP: poison...
  std::string nanTensor;        // ...CARVE_FAULT_NAN_TENSOR ("loss" or a parameter's gradient)
  int64_t nanRank = -1;         // ...on CARVE_FAULT_NAN_RANK only (default: every holder)
};

} // namespace carve::rt

#endif // CARVE_RT_SRC_FAULTS_H
