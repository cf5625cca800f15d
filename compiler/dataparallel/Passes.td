//===- Passes.td - data parallelism ------------------------*- tablegen -*-===//

#ifndef CARVE_DATAPARALLEL_PASSES_TD
#define CARVE_DATAPARALLEL_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveDataParallel : Pass<"carve-data-parallel", "mlir::ModuleOp"> {
  let summary = "Order the gradients, cut them into reduction buckets and shard them for ZeRO";
  let description = [{
    Reads the module's plan (`carve.plan`: dp, zero) and decides, for each
    function the emitter prints (`@train_step`, or `@stage0 ..` after
    carve-split-stages), how data parallelism treats its gradients
    (docs/partition.md, "ZeRO"):

      1. **Order.** Each gradient the function returns gets a slot, in the
         order backward finishes them (`ready`: the index of the op after
         which it is final). In `@train_step` a gradient that is an op's
         result (through reshapes) is computed in its slot; one that is an
         argument, a constant, the loss or another gradient's memory is
         copied into its slot after the last op (`copy`, ready = the number
         of ops). A stage accumulates every gradient over the micro-batches,
         so each is copied and ready after its defining op.
      2. **Buckets.** Consecutive gradients in that order, each bucket up to
         `bucket-bytes` (a larger gradient is a bucket of its own); a bucket
         is ready with its last gradient, when its reduction can start: an
         all-reduce of its range, or under ZeRO-2 and 3 a reduce-scatter of
         each gradient into the chunk its rank keeps. Under ZeRO >= 2 one
         bucket is in flight: bucket k is waited for (`wait_at`) when bucket
         k+1 is ready, the last after the last op; in a stage this holds
         per micro-batch (each micro-batch's bucket is reduce-scattered and
         its chunk added to the rank's fp32 chunk accumulator at the wait).
         `@train_step` records its
         buckets at dp = 1 too (`reduce = "none"`: the compile summary counts
         them); a stage records them only when dp > 1.
      3. **ZeRO chunks.** Under ZeRO stage z >= 1 and dp > 1 each trainable
         parameter's elements (as the function holds them, after tp) are cut
         into dp chunks of ceil(n / dp), the last padded; dp rank d keeps the
         optimizer state (z >= 1), the summed gradient (z >= 2) and the
         parameter (z = 3) of chunk d only.
      4. **ZeRO-3 gathers.** A parameter kept as a chunk is gathered whole
         before its first read in forward and again before its first read in
         backward, into a buffer free after its last read in that pass; reads
         are where they run (a fused group's at its root, a folded
         transpose's at its matmul), so this pass runs after
         carve-fuse-elementwise and carve-fold-transposes. With the plan's
         `zero3_prefetch_layers` = k > 0 a gather starts early, while
         earlier ops compute: in each pass the gathered parameters' layers
         (the `/<name>.<j>/` of their first reader's node) are taken in the
         order of their first reads, and a gather of the i-th layer starts
         at the first read of the (i - k)-th (of the first for i < k); at
         most k + 1 layers' gathered parameters are alive at a time.

    Before: the emitted functions, each returning the loss (`@train_step`;
    a stage where `carve.loss` marks it) and the gradients (`carve.grad_of`).
    After: the ops are unchanged; each function carries `carve.gradients`
    and (where formed) `carve.buckets`, trainable arguments `carve.zero_chunk`
    and `carve.zero3_gather` where they apply (dialects/carve/Contract.h:
    [forward first, forward last, backward first, backward last] read, and
    with prefetch the [forward, backward] op where each gather starts).
    The emitter prints the collectives and gathers these describe.

    Errors, on the function's result or op: a result after the loss that is
    not a gradient, a gradient of no argument, a gradient that is not f32.
  }];
  let options = [
    Option<"bucketBytes", "bucket-bytes", "int64_t", /*default=*/"4194304",
           "Largest gradient bucket in bytes (a larger gradient is its own bucket)">
  ];
  let statistics = [
    Statistic<"numGradients", "num-gradients", "Gradients given a slot">,
    Statistic<"numBuckets", "num-buckets", "Gradient buckets formed">,
    Statistic<"numGathered", "num-gathered", "Parameters gathered whole by ZeRO-3">
  ];
}

#endif // CARVE_DATAPARALLEL_PASSES_TD
