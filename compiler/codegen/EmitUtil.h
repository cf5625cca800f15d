//===- EmitUtil.h - small helpers the op emitters share -------------------===//
//
// For EmitOps.cpp and EmitNeuralOps.cpp: shapes and literals as the
// generated C++ writes them, named flag arguments, and the runtime entry
// carve-select-kernels chose for an op.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_CODEGEN_EMITUTIL_H
#define CARVE_COMPILER_CODEGEN_EMITUTIL_H

#include "compiler/codegen/Generator.h"

#include "dialects/carve/Contract.h"

#include <string>

namespace carve::codegen {

/// `v`'s shape as a Dims literal: "{4, 8, 32}".
inline std::string shapeOf(mlir::Value v) { return dims(typeOf(v).getShape()); }

/// A literal of `like`'s element type (f32 gets the `f` suffix).
inline std::string scalar(double x, mlir::Value like) {
  return number(x, typeOf(like).getElementType().isF32());
}

/// A flag argument with the kernel's name for it: "/*transA=*/true".
inline std::string flag(const char *name, bool on) {
  return std::string("/*") + name + "=*/" + (on ? "true" : "false");
}

/// The runtime entry carve-select-kernels chose for `op` (empty: none chose).
inline llvm::StringRef kernelOf(mlir::Operation *op) {
  auto k = op->getAttrOfType<mlir::StringAttr>(kKernelAttr);
  return k ? k.getValue() : llvm::StringRef();
}

} // namespace carve::codegen

#endif // CARVE_COMPILER_CODEGEN_EMITUTIL_H
