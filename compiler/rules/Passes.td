//===- Passes.td - a rules file's checks on the program ----*- tablegen -*-===//

#ifndef CARVE_RULES_PASSES_TD
#define CARVE_RULES_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveCheckOverrides : Pass<"carve-check-overrides", "mlir::ModuleOp"> {
  let summary = "Every annotation override of a rules file must match an op of @train_step";
  let description = [{
    A rules file's `"ops"` entries with `"match"` replace the partition
    annotation of the ops they match (by op name, e.g. "carve.matmul", or by
    a glob of ONNX node names). An entry that matches nothing is almost
    always a typo, and silently ignoring it would leave the user's intended
    split undone, so this pass makes it an error naming the entry.

    Before: `@train_step` (after carve-autodiff, so that gradient ops count).
    After: unchanged. Error, on the module: the rules file's entry
    (`rules.json: ops[1]`), its glob, and where to find node names. Without a
    rules file (`rules` empty) the pass checks nothing.
  }];
  let options = [
    Option<"rulesPath", "rules", "std::string", /*default=*/"\"\"",
           "The rules file (JSON, docs/custom-ops.md) whose overrides to check">,
  ];
}

#endif // CARVE_RULES_PASSES_TD
