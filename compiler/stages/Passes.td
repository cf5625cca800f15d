//===- Passes.td - the pipeline stage split ----------------*- tablegen -*-===//

#ifndef CARVE_STAGES_PASSES_TD
#define CARVE_STAGES_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveSplitStages : Pass<"carve-split-stages", "mlir::ModuleOp"> {
  let summary = "Cut @train_step into the plan's pipeline stages, joined by sends and receives";
  let description = [{
    Reads the module's plan (`carve.plan`: pp, virtual_stages, cuts, dp, tp)
    and cuts `@train_step` (one micro-batch's forward and backward, after
    carve-partition where the plan has tp or ZeRO) into S = pp x
    virtual_stages functions `@stage0 .. @stage{S-1}`:

      1. forward ops that depend on the batch are cut into S contiguous
         pieces at layer boundaries (the `/<name>.<k>/` component of ONNX
         node names, of the most frequent name, or of every name numbering
         two layers or more where there are several; a model without
         numbered layers is cut where a single tensor crosses), balanced by
         FLOPs or at the plan's `cuts`;
      2. a backward op runs on the stage of the forward op it differentiates;
      3. ops that compute only from weights and constants follow their
         consumers (cloned into each consumer stage when nothing trains them);
      4. a value used on another stage travels by `dist.send` / `dist.recv`
         over the mesh axis "pp" (forward activations up, gradients down;
         `carve.from_stage` / `carve.to_stage`, `carve.phase = "backward"` on
         the receives that open a stage's backward part);
      5. a parameter used on several stages (a tied embedding) is an argument
         of each; each stage returns its own part of the gradient, marked
         `carve.shared_grad`, and the emitted code sums the parts over pp.

    Before: `@train_step` (the conventions of carve-autodiff) and a plan.
    After: no `@train_step`; `dist.mesh @mesh` with axes ["pp", "dp", "tp"];
    the stage functions, each with `carve.stage`, `carve.num_stages`,
    `carve.stage_summary` (its first and last node, layers, FLOPs, parameter
    and sent bytes), result 0 `carve.loss` on the last stage. With pp = 1
    and several micro-batches the one stage is the whole step.

    Errors, on the module: more stages than layers, a cut glob that names no
    forward op, cut points out of order or too many / too few.
  }];
  let dependentDialects = ["dist::DistDialect"];
  let statistics = [
    Statistic<"numTransfers", "num-transfers", "Send/receive pairs per micro-batch">
  ];
}

#endif // CARVE_STAGES_PASSES_TD
