//===- Builtin.h - model generators for planning without weights ----------===//
//
// `builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200` and
// `builtin:llama:...` build `func.func @forward` exactly as the ONNX importer
// (after carve-raise) builds it for the same model written in PyTorch
// (models/reference.py): the same ops in the same order, the same node names
// (locations such as "/h.3/attn/c_attn/MatMul"), the same parameter names and
// argument attributes. So builtin and imported models share one code path in
// the planner and the compiler. docs/planner.md lists the keys.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_BUILTIN_H
#define CARVE_COMPILER_FRONTEND_BUILTIN_H

#include "compiler/frontend/OnnxImporter.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OwningOpRef.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <map>
#include <string>

namespace carve {

/// A parsed builtin spec: the family ("gpt", "llama") and every key with its
/// value after defaults are applied.
struct BuiltinSpec {
  std::string family;
  std::map<std::string, double> values; // layers, hidden, heads, seq, vocab, batch, ...
  int64_t get(const std::string &key) const { return (int64_t)values.at(key); }
};

/// True if `model` names a builtin model ("builtin:...").
bool isBuiltinModel(llvm::StringRef model);

/// Parses "builtin:FAMILY:k=v,..." (the "builtin:" prefix is required). On an
/// unknown family or key, a malformed or impossible value (heads not dividing
/// hidden, ...) returns false with one line in `error`.
bool parseBuiltinSpec(llvm::StringRef model, BuiltinSpec &spec, std::string &error);

/// Builds the model. `opts.batch` (if positive) overrides the spec's batch;
/// `opts.frozen` applies as for ONNX; `opts.initialValues` (if set) receives
/// deterministic initial weights (docs/planner.md). Null module and `error` on failure.
mlir::OwningOpRef<mlir::ModuleOp> buildBuiltinModel(mlir::MLIRContext &context,
                                                    const BuiltinSpec &spec,
                                                    const ImportOptions &opts,
                                                    std::string &error);

/// One entry point for the CLI: a builtin spec or an ONNX file.
mlir::OwningOpRef<mlir::ModuleOp> loadModel(mlir::MLIRContext &context, llvm::StringRef model,
                                            const ImportOptions &opts, std::string &error);

} // namespace carve

#endif // CARVE_COMPILER_FRONTEND_BUILTIN_H
