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
// Keys (integers unless noted; * = required):
//   both   layers*, hidden*, heads*, seq*, vocab*, batch (1),
//          block_size (seq: rows of wpe / the rope tables, >= seq),
//          dropout (0; a number in [0, 1), see below)
//   gpt    ffn (4 * hidden), tied (1: lm_head shares wte.weight, as
//          GPTConfig.tie_weights), gelu_tanh (0)
//   llama  kv_heads (heads; fewer is grouped-query attention), ffn (Llama's
//          FeedForward size: 8 * hidden / 3 rounded up to a multiple of 256;
//          note LlamaConfig's own default is a fixed 64), norm_eps (1e-5),
//          rope_theta (10000) -- both numbers
// hidden must be a multiple of heads and heads of kv_heads; Llama's head size
// must be even. gpt ffn other than 4 * hidden has no PyTorch counterpart
// (GPTMLP fixes it).
//
// dropout = P > 0 is an annotation for planning (the compiled programs do not
// drop): the module gets `carve.dropout = P : f64`, and so does every
// `carve.attention` (attention-probability dropout) and every op whose result
// PyTorch would pass through hidden dropout: the embedding (gpt: the wte + wpe
// add; llama: the token gather), and each block's attention and MLP output
// projections (gpt: the c_proj bias adds; llama: the wo and w2 matmuls).
// Nothing else changes.
//
// The model carries types only. `opts.initialValues` asks for weights as
// models/reference.py's `_init_transformer` draws them in distribution
// (N(0, 0.02) for Linear and Embedding weights, zero biases, unit norm
// weights) from a fixed-seed generator of carve's own; over 2^31 elements is
// an error. Builtin models are always in raised form (`opts.raise` is not
// consulted) and have no symbolic dimensions.
//
// Errors name the key but not the spec: like importOnnxFile's, they are
// meant to be prefixed with the model by the caller (the CLI does).
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
