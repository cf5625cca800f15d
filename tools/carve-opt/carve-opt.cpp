//===- carve-opt.cpp - mlir-opt with carve's dialects and passes ----------===//
//
// Parses carve IR, runs any registered pass pipeline and prints the result;
// the driver behind the lit tests of every carve pass.
//
//===----------------------------------------------------------------------===//

#include "compiler/autodiff/Autodiff.h"
#include "compiler/frontend/Passes.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/optimizer/Optimizer.h"
#include "compiler/precision/Precision.h"
#include "compiler/recompute/Recompute.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Passes.h"
#include "compiler/memory/MemoryPlan.h"
#include "compiler/partition/Passes.h"
#include "compiler/stages/Passes.h"
#include "compiler/plan/Passes.h"
#include "compiler/rules/Rules.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<carve::CarveDialect, dist::DistDialect, mlir::func::FuncDialect>();
  mlir::registerCanonicalizerPass();
  mlir::registerCSEPass();
  mlir::registerSymbolDCEPass();
  carve::registerFrontendPasses();
  carve::registerAutodiffPasses();
  carve::registerPartitionPasses();
  carve::registerStagesPasses();
  carve::registerFusionPasses();
  carve::registerDataParallelPasses();
  carve::registerOptimizerPasses();
  carve::registerRecomputePasses();
  carve::registerPrecisionPasses();
  carve::registerMemoryPasses();
  carve::registerLowerPasses();
  carve::registerPlanPasses();
  carve::registerRulesPasses();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "carve optimizer driver\n", registry));
}
