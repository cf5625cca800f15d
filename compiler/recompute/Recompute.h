//===- Recompute.h - activation recomputation -----------------------------===//
//
// carve-recompute (Recompute.cpp; its rules are in Passes.td): forward ops
// run again in backward so that their results need not be kept.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_RECOMPUTE_RECOMPUTE_H
#define CARVE_COMPILER_RECOMPUTE_RECOMPUTE_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <string>
#include <vector>

namespace carve {

/// The layer names ("h.0", "layers.3", ...) of the model's forward ops in
/// `module` that `glob` matches; false with `error` when the glob is malformed.
bool layersMatching(mlir::ModuleOp module, const std::string &glob,
                    std::vector<std::string> &layers, std::string &error);

#define GEN_PASS_DECL
#include "compiler/recompute/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/recompute/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_RECOMPUTE_RECOMPUTE_H
