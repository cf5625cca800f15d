//===- CustomOp.h - a user-defined op as a rules file describes it --------===//
//
// What the importer needs to turn a node of a custom ONNX domain into
// `carve.custom`: its partition annotation (and the one derived for its
// gradient), the ranks that annotation gives its operands and results, the
// output shapes as expressions of the input dimensions, and the names of the
// user's CPU kernels (and CUDA kernels, when it has them). Rules.h loads these from a rules file (--rules);
// docs/custom-ops.md describes the format.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_RULES_CUSTOMOP_H
#define CARVE_COMPILER_RULES_CUSTOMOP_H

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carve {

/// One result of a custom op.
struct CustomOutput {
  /// One expression per dimension, e.g. "in0[0]", "in1[-1] * 2".
  std::vector<std::string> shape;
  /// "inK" (the element type of input K) or an element type: "f32", "f64",
  /// "i64", "i32", "bool".
  std::string dtype = "in0";
};

/// One target's kernels of a custom op (`"cpu": {...}` or `"cuda": {...}`).
struct CustomKernels {
  /// `extern "C"` kernel names; `backward` is empty for an op without a gradient.
  std::string forward, backward;
  /// The kernels' sources (C++ for the CPU, CUDA for the GPU), absolute paths.
  std::vector<std::string> sources;

  bool empty() const { return forward.empty(); }
};

struct CustomOpRule {
  std::string domain, type;
  /// The forward annotation and the one its gradient op uses (derived by
  /// backwardAnnotation in Rules.h).
  std::string annotation, backwardAnnotation;
  /// The rank of every operand and result, as the annotation gives them.
  std::vector<int> operandRanks, resultRanks;
  std::vector<CustomOutput> outputs;
  /// The CPU kernels (required) and the CUDA kernels (empty when the rules
  /// file gives none: the op then runs on the CPU target only).
  CustomKernels cpu, cuda;
  /// Where the rule came from, for errors: `rules.json: ops[0]`.
  std::string origin;
};

/// Checks the syntax of a shape expression: integers, `inK[d]` (K below
/// `numInputs`; d may be negative, counting from the end), `+ - * /` and
/// parentheses. On failure returns false with the reason in `error`.
bool checkShapeExpr(const std::string &text, int numInputs, std::string &error);

/// Evaluates a shape expression on the input shapes. Division must be exact;
/// an index outside an input's rank, a division with a remainder or by zero
/// is an error.
bool evalShapeExpr(const std::string &text, llvm::ArrayRef<std::vector<int64_t>> inputs,
                   int64_t &value, std::string &error);

} // namespace carve

#endif // CARVE_COMPILER_RULES_CUSTOMOP_H
