//===- fuzz_plan.cpp - libFuzzer target: the plan file parser -------------===//
//
// Bytes -> parsePlan -> applyPlanOptimizer: a plan file is user input, so any
// text must give a plan or a one-line error (compiler/plan/Plan.cpp).
//
//===----------------------------------------------------------------------===//

#include "compiler/plan/Plan.h"
#include "tests/fuzz/FuzzSupport.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::string text(reinterpret_cast<const char *>(data), size);
  carve::Plan plan;
  std::string error;
  if (!carve::parsePlan(text, "plan.json", plan, error)) {
    carve::fuzz::checkFailure("parsePlan", error);
    return 0;
  }
  carve::OptimizerConfig opt;
  if (!carve::applyPlanOptimizer(plan, opt, error))
    carve::fuzz::checkFailure("applyPlanOptimizer", error);
  else if (!carve::validateOptimizer(opt, error))
    carve::fuzz::checkFailure("validateOptimizer", error);
  (void)plan.worldSize();
  (void)plan.scheduleName();
  return 0;
}
