//===- CompilePipeline.cpp - the passes `carve compile` runs --------------===//

#include "compiler/driver/CompilePipeline.h"

#include "compiler/autodiff/Autodiff.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/frontend/Passes.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Passes.h"
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

namespace {
/// Adds passes to a pass manager and keeps their flags in order: the list
/// `--emit-mlir-after` checks against is the pipeline itself.
struct PassList {
  mlir::OpPassManager &pm;
  std::vector<std::string> flags;

  void add(std::unique_ptr<mlir::Pass> pass) {
    flags.push_back(pass->getArgument().str());
    pm.addPass(std::move(pass));
  }
  void addToFunctions(std::unique_ptr<mlir::Pass> pass) {
    flags.push_back(pass->getArgument().str());
    pm.addNestedPass<mlir::func::FuncOp>(std::move(pass));
  }
};
} // namespace

std::vector<std::string> buildCompilePipeline(mlir::OpPassManager &pm, const PlanAttrs &plan,
                                              const RuleSet &rules, const std::string &loss,
                                              bool fuse, const OptimizerConfig &optimizer,
                                              int64_t bucketBytes, int64_t epRank) {
  PassList passes{pm, {}};
  passes.add(createBindCustomOpsPass(rules));
  passes.addToFunctions(createCarveLowerConvolutions());
  if (plan.ep > 1) {
    CarveExpertParallelOptions ep;
    ep.epRank = epRank;
    passes.add(createCarveExpertParallel(ep));
  }
  CarveAutodiffOptions ad;
  ad.loss = loss;
  passes.add(createCarveAutodiff(ad));
  passes.add(createCheckOverridesPass(rules));
  if (partitions(plan))
    passes.add(createPartitionPass(rules.overrides));
  if (sixteenBit(plan))
    passes.add(createCarveRoundActivations());
  if (plan.pipelined())
    passes.add(createCarveSplitStages());
  // Both with and without fusion: fused and unfused programs stay equal.
  passes.add(createCarveConcatSliceGrads());
  if (fuse)
    passes.add(createCarveFuseElementwise());
  CarveFoldTransposesOptions fold;
  // The runtimes' matmul_gather_grad: two ops as one kernel, so not under
  // --no-fuse (every op its own kernel). Both targets.
  fold.scatterProducts = fuse;
  // And their matmul_gathered: a convolution's windows never whole in memory.
  fold.gatherOperands = fuse;
  passes.add(createCarveFoldTransposes(fold));
  if (plan.recompute != "none")
    passes.add(createCarveRecompute());
  if (plan.target == "cuda" && plan.recompute == "none")
    passes.add(createCarveSaveAttentionStats());
  if (sixteenBit(plan)) {
    passes.add(createCarvePackActivations());
    passes.add(createCarveStoreParams16());
    passes.add(createCarveStoreGrads16());
    passes.add(createCarveRoundOperands16());
  }
  CarveDataParallelOptions dp;
  dp.bucketBytes = bucketBytes;
  passes.add(createCarveDataParallel(dp));
  if (plan.target == "cuda")
    passes.add(createCarveFoldViews());
  passes.add(createCarvePlanMemory());
  passes.add(createCarveOptimizer(optimizer));
  passes.add(createCarveSelectKernels());
  return passes.flags;
}

} // namespace carve
