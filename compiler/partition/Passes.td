//===- Passes.td - the training step over the device mesh --*- tablegen -*-===//

#ifndef CARVE_PARTITION_PASSES_TD
#define CARVE_PARTITION_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarvePartition : Pass<"carve-partition", "mlir::ModuleOp"> {
  let summary = "Split @train_step over the plan's dp x tp mesh (layouts, collectives, local shapes)";
  let description = [{
    Reads the module's plan (`carve.plan`: dp, tp, sequence_parallel, zero,
    ops), chooses for every op of `@train_step` which annotated dimension
    (PartitionableOpInterface, or a rules file's override) is split over tp,
    inserts the cheapest collectives where a producer's layout differs from
    what a consumer needs, and rewrites the function to local (per-rank)
    shapes. docs/partition.md.

    Before: `@train_step` as carve-autodiff builds it, shaped for one
    data-parallel replica's share of the batch; a `carve.plan` (absent: one
    rank, and the pass changes nothing but the mesh).

    After: `dist.mesh @mesh` with axes ["dp", "tp"] (kept when the module
    has one); `@train_step` in per-rank shapes, SPMD: every op carries
    `dist.choice` ("tp: <dim>" or "tp: replicate") and `dist.annotation`,
    arguments and results `dist.layout`; `dist` collectives over "tp" sit
    where layouts change; split embeddings and cross-entropies carry
    `dist.sharded_rows`; the module carries `dist.partition_summary` (ops
    split, collectives inserted by kind). Data-parallel gradient sums and ZeRO are not in the
    IR yet: the emitter adds them from the plan.

    Errors, on the module, naming the op's model node or the plan field: a
    tp that does not divide a dimension the plan splits, an `ops` entry that
    matches no op or names no dimension of the op's annotation.
  }];
  let dependentDialects = ["dist::DistDialect"];
  let statistics = [
    Statistic<"numSplit", "num-split", "Ops split over tp">,
    Statistic<"numCollectives", "num-collectives", "Collectives inserted">
  ];
}

def CarveSplitStages : Pass<"carve-split-stages", "mlir::ModuleOp"> {
  let summary = "Cut @train_step into the plan's pipeline stages, joined by sends and receives";
  let description = [{
    Reads the module's plan (`carve.plan`: pp, virtual_stages, cuts, dp, tp)
    and cuts `@train_step` (one micro-batch's forward and backward, after
    carve-partition where the plan has tp or ZeRO) into S = pp x
    virtual_stages functions `@stage0 .. @stage{S-1}`:

      1. forward ops that depend on the batch are cut into S contiguous
         pieces at layer boundaries (the `/<name>.<k>/` component of ONNX
         node names; a model without numbered layers is cut where a single
         tensor crosses), balanced by FLOPs or at the plan's `cuts`;
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

#endif // CARVE_PARTITION_PASSES_TD
