//===- nan_guard.h - --on-nan: the check between gradients and optimizer --===//
//
// Every rank flags a non-finite loss or gradient norm (the norm sums every
// gradient element's square, so it is non-finite exactly when some gradient
// element is, or overflows); an all-reduce over the world makes every rank
// take the same decision, and on a non-finite step a second one finds the
// first tensor at fault: the loss, else the first gradient in model order
// (docs/failures.md#nan-and-infinite-values).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_NAN_GUARD_H
#define CARVE_RT_SRC_NAN_GUARD_H

#include "faults.h"

#include "carve/rt/comm.h"
#include "carve/rt/mesh.h"
#include "carve/rt/program.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carve::rt {

/// The synchronized gradient elements of `s` that dp rank `dpRank` holds: its
/// ZeRO-2/3 chunk (the last ones may be short or empty), else the whole
/// (tp-local) tensor.
int64_t heldGradientCount(const Program &p, const TensorSpec &s, int dpRank);

/// The step hooks of train: the fault injection's poison once the gradients
/// are ready, then the check that decides whether the update may go on.
class NanGuard : public StepHooks {
public:
  /// `hostArena` is the host copy of a device arena (unused on the CPU).
  NanGuard(Communicator &world, const Program &p, const Mesh &m, const FaultInjection &f,
           char *hostArena);

  /// Forgets the previous step's outcome.
  void beginStep();

  void gradientsReady(StepContext &ctx) override;
  bool updateAllowed(StepContext &ctx, double gradNorm) override;
  bool everyRank(bool ok) override;

  /// For a program whose step does not call the hooks: the loss after the
  /// update (which cannot be skipped any more).
  void checkAfterStep(StepContext &ctx) { check(ctx, true); }

  bool asked = false;     // the step called updateAllowed
  bool nonFinite = false; // this step had a non-finite loss or gradient
  std::string culprit;    // "loss" or the first gradient's parameter name
  std::string weightHint; // the first non-finite parameter (weights), if any

private:
  bool check(StepContext &ctx, bool normFinite);
  int64_t positionOf(const char *name) const;

  Communicator &world;
  const Program &program;
  const Mesh &mesh;
  const FaultInjection &faults;
  char *host; // the host copy of a device arena (unused on the CPU)
  std::vector<std::string> order;
};

/// "non-finite gradient of 'fc1.weight' (the first in model order; loss 2.3)"
/// or "the loss is nan (first non-finite parameter: 'fc1.weight')".
std::string describeNonFinite(const NanGuard &g, const StepContext &ctx);

} // namespace carve::rt

#endif // CARVE_RT_SRC_NAN_GUARD_H
