//===- CompilePipeline.cpp - the passes `carve compile` runs --------------===//

#include "compiler/driver/CompilePipeline.h"

#include "compiler/autodiff/Autodiff.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/frontend/Passes.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/memory/MemoryPlan.h"
#include "compiler/optimizer/Optimizer.h"
#include "compiler/partition/Passes.h"
#include "compiler/precision/Precision.h"
#include "compiler/recompute/Recompute.h"
#include "compiler/stages/Passes.h"

namespace carve {

namespace {
bool partitions(const PlanAttrs &plan) { return plan.tp > 1 || plan.zero > 0; }
bool sixteenBit(const PlanAttrs &plan) { return plan.precision != "fp32"; }
} // namespace

void buildCompilePipeline(mlir::OpPassManager &pm, const PlanAttrs &plan, const RuleSet &rules,
                          const std::string &loss, bool fuse, const OptimizerConfig &optimizer,
                          int64_t bucketBytes, int64_t epRank) {
  pm.addPass(createBindCustomOpsPass(rules));
  pm.addNestedPass<mlir::func::FuncOp>(createCarveLowerConvolutions());
  if (plan.ep > 1) {
    CarveExpertParallelOptions ep;
    ep.epRank = epRank;
    pm.addPass(createCarveExpertParallel(ep));
  }
  CarveAutodiffOptions ad;
  ad.loss = loss;
  pm.addPass(createCarveAutodiff(ad));
  pm.addPass(createCheckOverridesPass(rules));
  if (partitions(plan))
    pm.addPass(createPartitionPass(rules.overrides));
  if (sixteenBit(plan))
    pm.addPass(createCarveRoundActivations());
  if (plan.pipelined())
    pm.addPass(createCarveSplitStages());
  if (fuse)
    pm.addPass(createCarveFuseElementwise());
  CarveFoldTransposesOptions fold;
  // The runtimes' matmul_gather_grad: two ops as one kernel, so not under
  // --no-fuse (every op its own kernel). Both targets.
  fold.scatterProducts = fuse;
  // And their matmul_gathered: a convolution's windows never whole in memory.
  fold.gatherOperands = fuse;
  pm.addPass(createCarveFoldTransposes(fold));
  if (plan.recompute != "none")
    pm.addPass(createCarveRecompute());
  if (sixteenBit(plan)) {
    pm.addPass(createCarvePackActivations());
    pm.addPass(createCarveStoreParams16());
    pm.addPass(createCarveStoreGrads16());
  }
  CarveDataParallelOptions dp;
  dp.bucketBytes = bucketBytes;
  pm.addPass(createCarveDataParallel(dp));
  pm.addPass(createCarvePlanMemory());
  pm.addPass(createCarveOptimizer(optimizer));
}

std::vector<std::string> compilePipelinePasses(const PlanAttrs &plan, bool fuse) {
  std::vector<std::string> passes = {"carve-bind-custom-ops", "carve-lower-convolutions"};
  if (plan.ep > 1)
    passes.push_back("carve-expert-parallel");
  for (const char *p : {"carve-autodiff", "carve-check-overrides"})
    passes.push_back(p);
  if (partitions(plan))
    passes.push_back("carve-partition");
  if (sixteenBit(plan))
    passes.push_back("carve-round-activations");
  if (plan.pipelined())
    passes.push_back("carve-split-stages");
  if (fuse)
    passes.push_back("carve-fuse-elementwise");
  passes.push_back("carve-fold-transposes");
  if (plan.recompute != "none")
    passes.push_back("carve-recompute");
  if (sixteenBit(plan)) {
    passes.push_back("carve-pack-activations");
    passes.push_back("carve-store-params16");
  }
  passes.push_back("carve-data-parallel");
  passes.push_back("carve-plan-memory");
  passes.push_back("carve-optimizer");
  return passes;
}

} // namespace carve
