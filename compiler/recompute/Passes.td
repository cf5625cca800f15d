//===- Passes.td - activation recomputation ----------------*- tablegen -*-===//

#ifndef CARVE_RECOMPUTE_PASSES_TD
#define CARVE_RECOMPUTE_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveRecompute : Pass<"carve-recompute", "mlir::ModuleOp"> {
  let summary = "Recompute activations in backward instead of keeping them (the plan's recompute)";
  let description = [{
    Reads `carve.plan`'s `recompute` and, in each function the emitter prints
    (`@train_step`, or `@stage0 ..` per micro-batch), trades memory for
    forward work the way Megatron-LM does (Korthikanti et al. 2022):

      - `full`: every numbered layer (the `/<name>.<k>/` component of ONNX
        node names, as carve-split-stages cuts them) keeps only its inputs
        from forward; in backward its forward ops are run again and the
        backward ops read the recomputed values. `recompute_layers` (layer
        globs such as `h.*` or `layers.[0-3]`, matched against `h.0`,
        `layers.3`, ...) restricts it to the layers they name.
      - `selective`: the attention core: scores, their scaling and mask,
        the softmax and the weighted sum. A `carve.attention` op keeps no
        scores in the first place (its gradient recomputes the softmax from
        the query and key), so only attention written out op by op (a
        `carve.softmax` fed by a `carve.matmul` through elementwise ops) has
        anything to recompute.

    For each such group of forward ops, a value is recomputed when backward
    reads it and no forward op outside the group does (a layer's output is
    the next layer's input: it stays). The ops that produce these values
    (and what they read inside the group) are cloned, in program order, just
    before the first backward op that reads any of them, named `backward of
    NODE (recomputed)` and marked `carve.recomputed`; the backward ops then
    read the clones. Pipeline sends and receives are never cloned (a
    received value is an input). The recomputed ops are the same ops on the
    same values, so the program's losses and weights are bitwise those of
    the plan without recomputation; the memory plan, which runs later, sees
    the forward values die early.

    Bitwise means each clone runs the kernel its original ran, so the pass
    runs after the decisions about kernels: a clone of a member of a fused
    group (carve.fusion_group) comes with the whole group, under a group
    number of its own; a clone of a matmul with a folded transpose
    (carve.fold) comes with that transpose and keeps the fold. The originals
    keep theirs (they lose readers, never gain one).

    Every forward op carve has today computes its result from its operands
    alone, which is what makes a clone exact. An op that draws random
    numbers (dropout) must, when it comes, be cloned with the same seed and
    offset, or kept.

    Before: after carve-fuse-elementwise (where it runs) and
    carve-fold-transposes, before carve-data-parallel. After: clones added;
    nothing else changes.

    Errors: a `recompute_layers` glob that is malformed or names no layer of
    the model (a layer that is on another pipeline stage counts).
  }];
  let statistics = [
    Statistic<"numGroups", "num-groups", "Layers or attention cores with recomputed values">,
    Statistic<"numCloned", "num-cloned", "Forward ops run again in backward">
  ];
}

#endif // CARVE_RECOMPUTE_PASSES_TD
