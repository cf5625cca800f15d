//===- Passes.td - the memory plan -------------------------*- tablegen -*-===//

#ifndef CARVE_MEMORY_PASSES_TD
#define CARVE_MEMORY_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarvePlanMemory : Pass<"carve-plan-memory", "mlir::ModuleOp"> {
  let summary = "Lay out the arena: the persistent tensors, and the activations sharing memory by liveness";
  let description = [{
    Every tensor a step computes lives in one arena; the tensors that live
    only part of the step (the activations) share memory. For each function
    the emitter prints (`@train_step`, or `@stage0 ..`, whose activations
    live in one micro-batch's slot):

      1. **Buffers.** Each op result has its own buffer, except a reshape's
         (its input's memory under a new name), a transpose folded into a
         matmul's flag, a matmul whose product a transpose writes, a fused
         group's interior result (carve.fold, carve.fusion_group) and a
         constant (static data). ZeRO-3 adds a buffer per gathered parameter
         and pass (carve.zero3_gather); under ZeRO-2 and 3 the whole
         gradients are activations until their bucket is waited for, a
         copied one in a buffer of its own (carve.gradients, carve.buckets);
         in a stage each gradient also gets a staging buffer of its chunk,
         which its bucket's reduce-scatter writes (from the bucket's ready
         to its wait, where the chunk is added to the fp32 accumulator).
         Gradients computed in place otherwise live in the gradient region,
         which the emitter lays out with the other persistent tensors.
      2. **Live ranges.** A buffer lives from the op that writes it to the
         last op that reads it, a read counted where it runs (a fused group
         at its root, a folded transpose at its matmul); the loss, a stage's
         sends (until the send has completed) and copied gradients live to the
         end; a gradient lives to when backward has finished it (a stage)
         or its bucket is waited for (ZeRO >= 2).
      3. **Placement.** Two placements, and the one with the smaller region
         (first fit where they tie; `placement` chooses one instead): first
         fit in order of definition, where each buffer (its bytes rounded up
         to 64) takes the lowest offset that overlaps no placed buffer still
         live when it is written; and largest first, where each buffer in
         order of decreasing size takes the lowest offset that overlaps no
         placed buffer whose live range overlaps its own (first fit leaves
         holes where a small buffer lands in a large one's way; on the
         memory-matrix plans largest first is never larger and up to 11%
         smaller). A stage's buffers are
         placed in three parts, one after another: what a micro-batch keeps
         from its forward to its backward and what its forward sends (the
         slot, kept per micro-batch in flight), what its backward sends
         (kept until that send completes), and the rest (scratch, which the
         rank's next forward or backward reuses).
      4. **Persistent tensors**, one after another, each rounded up to 64:
         the parameters and buffers in argument order, each in its own
         element type (a 16-bit copy: 2 bytes per element; ZeRO-1 and 2: padded
         to dp chunks, gathered in place; ZeRO-3: this rank's chunk), the
         gradient slots in carve.gradients' order (ZeRO >= 2: this rank's
         chunk of each), the optimizer state (carve.plan's optimizer_state
         tensors per gradient, each its size or chunk; then the fp32 master
         of each 16-bit parameter copy, carve.master, its size or chunk
         likewise), then `@train_step`'s
         inputs and loss seed (its activations follow) or a stage's seed. A
         pipeline rank's arena starts with the graph inputs of all its
         micro-batches, as its first stage lists them, then the persistent
         tensors of its stages r, r + pp, ... in turn.

    Before: after carve-data-parallel (and carve-fuse-elementwise,
    carve-fold-transposes where they run). After: the ops are unchanged;
    each op with a buffer of its own carries `carve.arena_offset` (one
    offset per result from the start of the activation region, -1 for a
    result without its own activation buffer); a ZeRO-3 argument carries
    `carve.zero3_gather_offsets` [forward, backward]; the function carries
    `carve.activation_plan = {bytes, unplanned, copies}` (the region's size,
    the sum of the buffers without reuse, and the offset of each copied
    gradient, or a stage's staging buffer, under ZeRO >= 2 in
    carve.gradients' order, -1 for none; a stage adds `slot` and `sends`,
    the sizes of its first two parts); each
    argument carries `carve.persistent_offset` (its byte in the rank's
    arena) and the function `carve.persistent_plan = {begin, params_end,
    grads_end, state_end, end, grads, states, masters}` (dialects/carve/Contract.h).
  }];
  let options = [
    Option<"placement", "placement", "std::string", /*default=*/"\"best\"",
           "best (the smaller of the two), first-fit or largest-first">
  ];
  let statistics = [
    Statistic<"numBuffers", "num-buffers", "Activation buffers placed">
  ];
}

#endif // CARVE_MEMORY_PASSES_TD
