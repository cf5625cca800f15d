//===- OnnxImporter.h - ONNX model -> carve dialect -----------------------===//
//
// Reads an ONNX model (protobuf, optionally with external data files) and
// builds `func.func @forward` in the carve dialect: graph inputs, parameters
// and buffers become named function arguments; shape arithmetic is evaluated
// at import so every tensor has a static shape.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_ONNXIMPORTER_H
#define CARVE_COMPILER_FRONTEND_ONNXIMPORTER_H

#include "compiler/rules/CustomOp.h"

#include "dialects/carve/Contract.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"
#include "llvm/ADT/StringMap.h"

#include <string>
#include <vector>

namespace carve {

/// What the user told the importer on the command line.
struct ImportOptions {
  /// Values for symbolic dimensions (`--set-dim NAME=VALUE`).
  llvm::StringMap<int64_t> dims;
  /// Glob patterns of parameters that are not trained (`--frozen GLOB`).
  std::vector<std::string> frozen;
  /// Run the carve-raise pass after import (on by default).
  bool raise = true;
  /// If positive, the leading (batch) dimension of every graph input, whether
  /// the model has it static or symbolic: how a data-parallel rank imports its
  /// share of the global batch.
  int64_t batch = 0;
  /// The model's own batch (with `batch`): a model exported with a static
  /// batch hard-codes it in constants (Reshape and Expand shapes, folded
  /// tensors); the importer tracks the batch through the graph and rescales
  /// them where it lands (BatchTracking.cpp, docs/plan.md).
  int64_t globalBatch = 0;
  /// If set, receives the initial value of every parameter and buffer that
  /// became a function argument (in argument order).
  struct InitialValue {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;
  };
  std::vector<InitialValue> *initialValues = nullptr;
  /// Ops of custom domains (`--rules`): a node whose domain and type match a
  /// rule becomes `carve.custom`; a node of another domain without one is an error.
  std::vector<CustomOpRule> customOps;
  /// If set, receives one line per thing the user should know about the
  /// import that is not an error (printed as `carve: note: ...`).
  std::vector<std::string> *notes = nullptr;
};

/// Parses one `NAME=VALUE` of `--set-dim` into `opts`; on a malformed entry
/// returns false and sets `error`.
bool parseSetDim(llvm::StringRef entry, ImportOptions &opts, std::string &error);

/// Imports the model at `path`. On failure returns a null module and sets
/// `error` to one line naming the cause (and the node, where there is one).
mlir::OwningOpRef<mlir::ModuleOp> importOnnxFile(mlir::MLIRContext &context,
                                                 llvm::StringRef path,
                                                 const ImportOptions &opts,
                                                 std::string &error);

/// Imports a model already held in memory; `baseDir` resolves external data.
mlir::OwningOpRef<mlir::ModuleOp> importOnnxBytes(mlir::MLIRContext &context,
                                                  llvm::StringRef bytes,
                                                  llvm::StringRef displayName,
                                                  llvm::StringRef baseDir,
                                                  const ImportOptions &opts,
                                                  std::string &error);

/// What `carve ckpt merge --model` reads of a model: its metadata entries and
/// the initializers it asks for (converted to float, external data read),
/// checked as the import checks them. False with `error` (one line naming the
/// file) when the file is not a readable ONNX model or an initializer is
/// missing or malformed.
struct OnnxStateFacts {
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<std::string> initializerNames;       // every initializer, in file order
  std::vector<ImportOptions::InitialValue> values; // those asked for, in that order
  /// Initializers that are exactly another's transpose (a tied weight that
  /// constant folding copied), which carve trains as one: (copy, original).
  std::vector<std::pair<std::string, std::string>> transposedTies;
};
bool readOnnxStateFacts(mlir::MLIRContext &context, llvm::StringRef path,
                        const std::vector<std::string> &wanted, OnnxStateFacts &out,
                        std::string &error);

/// The ONNX op types the importer accepts (default domain), sorted.
std::vector<std::string> supportedOnnxOps();


} // namespace carve

#endif // CARVE_COMPILER_FRONTEND_ONNXIMPORTER_H
