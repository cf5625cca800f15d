//===- Passes.td - a rules file's checks on the program ----*- tablegen -*-===//

#ifndef CARVE_RULES_PASSES_TD
#define CARVE_RULES_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveBindCustomOps : Pass<"carve-bind-custom-ops", "mlir::ModuleOp"> {
  let summary = "Give each custom op the partition annotation its rules file gives it";
  let description = [{
    A rules file describes each custom op (`carve.custom`) with a partition
    annotation, and may replace it for some ops by node-name glob (an
    `"ops"` entry with `"match"`). The partitioner and the gradient rule read
    the annotation from the op, so it must be on the op before carve-autodiff
    builds the gradient (whose `carve.custom_grad` follows the same split).

    Before: `@forward` as imported with the rules file's custom ops.
    After: every `carve.custom` carries the annotation of the first override
    that matches it (else its rule's), with the gradient annotation derived
    from it, bound to the op's shapes. Error, on the module: an annotation
    that does not fit the op's shapes, naming the node and the rules entry.
    Without a rules file (`rules` empty) nothing changes.
  }];
  let options = [
    Option<"rulesPath", "rules", "std::string", /*default=*/"\"\"",
           "The rules file (JSON, docs/custom-ops.md)">,
  ];
}

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
