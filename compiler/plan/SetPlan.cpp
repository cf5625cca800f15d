//===- SetPlan.cpp - carve-set-plan: a plan on the module from options ----===//

#include "compiler/plan/Passes.h"

#include "dialects/carve/Contract.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESETPLAN
#include "compiler/plan/Passes.h.inc"
} // namespace carve

namespace {

struct SetPlanPass : carve::impl::CarveSetPlanBase<SetPlanPass> {
  using CarveSetPlanBase::CarveSetPlanBase;

  void runOnOperation() override {
    carve::PlanAttrs plan;
    plan.dp = dp;
    plan.tp = tp;
    plan.pp = pp;
    plan.ep = ep;
    plan.zero = zero;
    plan.zero3PrefetchLayers = zero3PrefetchLayers;
    plan.sequenceParallel = sequenceParallel;
    plan.syncBatchNorm = syncBatchNorm;
    plan.microBatches = microBatches;
    plan.virtualStages = virtualStages;
    plan.schedule = schedule;
    plan.precision = precision;
    plan.tf32 = tf32;
    plan.gradAccumulation = gradAccumulation;
    plan.target = target;
    plan.attention = attention;
    plan.convolution = convolution;
    plan.optimizerState = optimizerState;
    plan.recompute = recompute;
    plan.recomputeLayers.assign(recomputeLayers.begin(), recomputeLayers.end());
    plan.cuts.assign(cuts.begin(), cuts.end());
    for (const std::string &e : ops) {
      size_t eq = e.rfind('=');
      plan.ops.push_back({e.substr(0, eq), eq == std::string::npos ? "" : e.substr(eq + 1)});
    }
    carve::writePlan(getOperation(), plan);
    // Checked as every reader checks it.
    if (failed(carve::readPlan(getOperation())))
      signalPassFailure();
  }
};

} // namespace
