//===- Summary.h - a human-readable summary of an imported model ----------===//

#ifndef CARVE_TOOLS_CARVE_SUMMARY_H
#define CARVE_TOOLS_CARVE_SUMMARY_H

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/raw_ostream.h"

namespace carve {

/// Prints inputs, outputs, parameters (with shapes and totals), buffers and an
/// op histogram of `@forward`.
void printSummary(mlir::ModuleOp module, llvm::raw_ostream &os);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_SUMMARY_H
