//===- ExpertParallel.h - the routed experts of a model -------------------===//
//
// carve-expert-parallel's analysis (ExpertParallel.cpp), for the planner:
// the routed mixture-of-experts layers of @forward and what an exchange of
// their rows moves. docs/moe.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PARTITION_EXPERTPARALLEL_H
#define CARVE_COMPILER_PARTITION_EXPERTPARALLEL_H

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carve {

/// One routed mixture-of-experts layer.
struct ExpertLayerInfo {
  std::string node;                  // the first expert's gather (a model node)
  int64_t experts = 0;               // E
  int64_t inElems = 0, outElems = 0; // one expert's rows in and result out, at @forward's batch
  std::vector<std::string> params;   // every expert's parameter names
};

/// The routed layers of `forward`, in program order; false with `error` (a
/// node and the cause) when an expert is not one carve-expert-parallel can
/// split.
bool findExpertLayers(mlir::func::FuncOp forward, std::vector<ExpertLayerInfo> &layers,
                      std::string &error);

} // namespace carve

#endif // CARVE_COMPILER_PARTITION_EXPERTPARALLEL_H
