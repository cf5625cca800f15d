//===- CopiesByWriter.h - 16-bit copies written by another op's call ------===//
//
// carve-select-kernels' rules 3h and 4d for the writers whose copies are not
// the op's own result's (Passes.td): each marks the copies it takes (no
// call, carve.copy_by_writer) and the writer's 16-bit entry, and returns how
// many copies it took.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_LOWER_COPIESBYWRITER_H
#define CARVE_COMPILER_LOWER_COPIESBYWRITER_H

#include "mlir/IR/Operation.h"
#include "llvm/ADT/StringRef.h"

namespace carve {

/// cuDNN's attention gradient: the 16-bit copies of dq, dk and dv.
unsigned attentionGradCopies(mlir::Operation *g, llvm::StringRef precision);
/// A layer or RMS norm gradient: its input gradient's copy.
unsigned normGradInputCopy(mlir::Operation *g, llvm::StringRef precision);
/// cuDNN's convolution result's 16-bit copy.
unsigned convolutionCopy(mlir::Operation *c, llvm::StringRef precision);
/// An add a norm gradient computes (carve.fold = "accumulate"): its copy.
unsigned accumulatedAddCopy(mlir::Operation *add, llvm::StringRef precision);
/// A concat marked "assemble", an attention output's "producer" transpose.
unsigned copyWrittenElsewhere(mlir::Operation *op, llvm::StringRef precision);

} // namespace carve

#endif // CARVE_COMPILER_LOWER_COPIESBYWRITER_H
