//===- Fusion.h - elementwise fusion groups on the IR ---------------------===//
//
// carve-fuse-elementwise (FuseElementwise.cpp) marks the members of each
// fused kernel with `carve.fusion_group`; the emitter reads the groups back
// with fusionGroups. carve-fold-transposes (FoldTransposes.cpp) marks the
// transposes a matmul's flags absorb with `carve.fold`.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FUSION_FUSION_H
#define CARVE_COMPILER_FUSION_FUSION_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "llvm/ADT/DenseSet.h"

#include "dialects/carve/CarveOps.h"

#include <vector>

namespace carve {

/// The runtime's Unary enum entry for a unary function name ("gelu_tanh" for
/// GELU with the tanh approximation), or null when the runtime has none.
const char *unaryKernel(llvm::StringRef fn);
/// The Unary function name of a unary op (gelu with approximate = "tanh" is
/// "gelu_tanh").
std::string unaryName(mlir::Operation *op);
/// True for an f32 elementwise op that a fused kernel can compute: add, sub,
/// mul, div, maximum, minimum, a unary op of the Unary enum, or its gradient.
bool isFusible(mlir::Operation *op);

/// True for a transpose that swaps exactly the last two dimensions (the
/// ones a GEMM's transpose flag covers).
bool swapsLastTwo(TransposeOp t);
/// The op's carve.fold mark (carve-fold-transposes): kFoldOperand,
/// kFoldProduct, or "" when it is not folded.
llvm::StringRef foldOf(mlir::Operation *op);

/// One fused kernel: its ops, its inputs and outputs.
struct FusionGroup {
  mlir::Operation *root = nullptr;
  std::vector<mlir::Operation *> ops; // members in program order, the root last
  std::vector<mlir::Value> inputs;    // read from memory, in first-use order
  std::vector<mlir::Value> outputs;   // the root's result, then intermediates read later
};

/// The groups carve-fuse-elementwise recorded on `fn`, in program order;
/// `interior` receives the member results nothing outside a group reads
/// (they are never stored).
std::vector<FusionGroup> fusionGroups(mlir::func::FuncOp fn, llvm::DenseSet<mlir::Value> &interior);

#define GEN_PASS_DECL
#include "compiler/fusion/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/fusion/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_FUSION_FUSION_H
