//===- Rules.h - the rules file of `carve compile --rules` ----------------===//
//
// A rules file (JSON, docs/custom-ops.md) adds operators without rebuilding
// carve and overrides the partition annotations of built-in ones:
//
//   {"ops": [
//     {"domain": "carve.example", "type": "SwiGLU",
//      "annotation": "a b c, a b c -> a b c",
//      "outputs": [{"shape": ["in0[0]", "in0[1]", "in0[2]"], "dtype": "in0"}],
//      "cpu": {"sources": ["swiglu.cpp"], "forward": "swiglu_forward",
//              "backward": "swiglu_backward"},
//      "cuda": {"sources": ["swiglu.cu"], "forward": "swiglu_forward_cuda",
//               "backward": "swiglu_backward_cuda"}},
//     {"match": "carve.matmul", "annotation": "m k^, k^ n -> m n"}
//   ]}
//
// Loading checks every field (annotations are parsed with the partitioner's
// grammar) and reports the first problem as one line naming the file, the
// entry and the field.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_RULES_RULES_H
#define CARVE_COMPILER_RULES_RULES_H

#include "compiler/partition/Partitioner.h"
#include "compiler/rules/CustomOp.h"
#include "dialects/carve/Annotation.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <string>
#include <vector>

namespace carve {

struct RuleSet {
  std::string path; // as the user gave it, for errors
  /// Custom ops, for the importer (ImportOptions::customOps).
  std::vector<CustomOpRule> customOps;
  /// Replaced annotations of built-in ops, for the partitioner
  /// (PartitionOptions::annotations).
  std::vector<AnnotationOverride> overrides;
  /// Every CPU kernel source once, absolute paths, in file order.
  std::vector<std::string> sources;
  /// Every CUDA kernel source once (the `"cuda"` sections).
  std::vector<std::string> cudaSources;

  const CustomOpRule *find(const std::string &domain, const std::string &type) const;
};

/// Reads and checks the rules file at `path`. On failure returns false with
/// one line in `error`, e.g.
/// `rules.json: ops[0] (carve.example::SwiGLU): "annotation": ...`.
bool loadRules(const std::string &path, RuleSet &rules, std::string &error);

/// The annotation of a custom op's gradient op (`carve.custom_grad`): its
/// operands are the forward operands, then the gradients of the forward
/// results; its results are the gradients of the forward operands. Every
/// tensor keeps its forward dimensions. A name missing from some operand
/// gradient is marked `+` (each rank's piece of that operand gradient is a
/// partial sum over the name's split), `^` stays `^`, and other marks go.
std::string backwardAnnotation(const Annotation &forward);

/// Gives every `carve.custom` op of `module` the annotation of the first
/// override that matches it (by op name or model node name, as the
/// partitioner matches them), with the gradient annotation derived from it,
/// so that its gradient op follows the override too; then binds each custom
/// op's annotation to its shapes. On a mismatch returns false with one line
/// naming the node and the rules entry. Call it before autodiff.
bool prepareCustomOps(mlir::ModuleOp module, const RuleSet &rules, std::string &error);

/// Every override must match some op of `@train_step` (by op name or by
/// model node name); otherwise returns false naming the entry.
bool checkOverridesMatch(mlir::ModuleOp module, const RuleSet &rules, std::string &error);

/// `carve-bind-custom-ops` for a rules file already read.
std::unique_ptr<mlir::Pass> createBindCustomOpsPass(const RuleSet &rules);
/// `carve-check-overrides` for a rules file already read.
std::unique_ptr<mlir::Pass> createCheckOverridesPass(const RuleSet &rules);

#define GEN_PASS_DECL
#include "compiler/rules/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/rules/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_RULES_RULES_H
