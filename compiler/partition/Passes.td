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

def CarveExpertParallel : Pass<"carve-expert-parallel", "mlir::ModuleOp"> {
  let summary = "Split each routed mixture-of-experts layer's experts over the plan's ep ranks";
  let description = [{
    Runs before carve-autodiff on `@forward` when the plan's `ep` > 1. An
    expert of a routed layer is a `carve.gather` of rows by positions that
    come from `carve.nonzero` (the routed tokens), the ops after it that read
    only those rows, parameters and constants, and their one result read
    outside it; the experts of a layer gather from one tensor. On ep rank
    `ep-rank`, each layer's rows go to their experts' ranks by
    `carve.expert_all_to_all` (dispatch), the rank's E/ep experts run on the
    rows of all ep ranks, and the results come back by the reverse exchange
    (combine). The other experts and their parameters leave the function;
    the kept experts' parameters carry `carve.expert`, and the module
    `carve.ep_rank`. docs/moe.md.

    Errors, naming the node and the plan field: no routed layer, experts
    that do not divide by ep, an expert parameter used outside its expert,
    experts of one layer of different shapes, an op of an expert that does
    not keep its rows apart.
  }];
  let options = [
    Option<"epRank", "ep-rank", "int64_t", /*default=*/"0",
           "The ep rank whose experts the module keeps">
  ];
  let statistics = [
    Statistic<"numLayers", "num-layers", "Mixture-of-experts layers split">,
    Statistic<"numKept", "num-kept", "Expert parameters this rank keeps">,
    Statistic<"numDropped", "num-dropped", "Expert parameters other ranks hold">
  ];
}

#endif // CARVE_PARTITION_PASSES_TD
