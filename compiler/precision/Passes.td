//===- Passes.td - 16-bit activations ----------------------*- tablegen -*-===//

#ifndef CARVE_PRECISION_PASSES_TD
#define CARVE_PRECISION_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveRoundActivations : Pass<"carve-round-activations", "mlir::ModuleOp"> {
  let summary = "Round the activations backward reads to the plan's 16-bit format (bf16/fp16 plans)";
  let description = [{
    Under `carve.plan`'s `precision` `bf16` or `fp16` (nothing under `fp32`),
    marks `carve.round16` on each forward op of `@train_step` whose result
    backward reads: the value is rounded to the format (round to nearest even)
    as it is written, and every reader, forward and backward, sees the
    rounded value. These are the activations mixed-precision training keeps in
    16 bits (Megatron-LM's and PyTorch autocast's bf16/fp16 tensors);
    carve-pack-activations stores them so.

    A value is marked when it is an f32 result of a forward op, depends on the
    batch (a value computed from parameters alone, such as a transposed
    weight, stays fp32: weights are the optimizer's), and some backward op
    reads it, directly or through reshapes (a reshape shares its input's
    memory, so the reshape's source is marked). Not marked: additive
    attention masks (operand 3 of `carve.attention` and its gradient: a mask
    of -3.4e38 would round to -inf), integer and boolean values.

    Rounding is a property of the value, fixed before the program is cut into
    stages or recomputed: carve-recompute's clones carry the mark and compute
    the same bits, so recomputation stays bitwise; the pipeline's receives of
    a marked value are marked too (the sender rounded it). The matmul and
    attention kernels already round their inputs to the precision, so a value
    only they read computes the same with or without the mark.

    Before: after carve-partition (where it runs), before carve-split-stages.
    After: the marks; nothing else changes.
  }];
  let statistics = [
    Statistic<"numMarked", "num-marked", "Forward values rounded to 16 bits as they are written">
  ];
}

def CarvePackActivations : Pass<"carve-pack-activations", "mlir::ModuleOp"> {
  let summary = "Keep 16-bit copies of the rounded activations from forward to backward";
  let description = [{
    Under a bf16 or fp16 plan, in each function the emitter prints
    (`@train_step`, or `@stage0 ..`): for each forward value marked
    `carve.round16` (or a pipeline receive of one) that backward reads,
    directly or through reshapes,

      - after its last forward reader (a fused group's root for a member),
        `carve.cast` writes a 16-bit copy (bf16 or f16, two bytes per
        element: exact, the value is rounded already); on the CUDA target,
        where that reader is an attention_stats that runs as cuDNN's
        attention (cudnnAttentionRefusal, carve-select-kernels' rule 3c)
        and reads the value as q, k or v, just before it instead, so that
        the call reads the copy as stored;
      - before its first backward reader, `carve.cast` back to f32 (exact),
        named `backward of NODE (16-bit copy)`; backward's readers (and
        reshapes of it, cloned there) read that.

    So what lives from forward to backward is the 16-bit copy, and the f32
    value dies after its last forward reader: the memory plan (which runs
    later) sees half the bytes, and nothing computes differently (both casts
    are exact).

    Pipeline stages send rounded activations in 16 bits: a forward send of a
    rounded value sends a 16-bit copy of it (the buffer a send holds until
    it completes is half the size, and so are the bytes on the link); the
    receive of it (marked `carve.round16` by carve-split-stages) receives
    16 bits, cast to f32 after the receives waited for with it, and when
    backward reads the value, the receive's own buffer is the 16-bit copy
    it keeps.

    Values that a function returns, or that a transpose folded into a
    matmul reads, stay f32.

    Before: after carve-recompute (where it runs), before carve-data-parallel
    and carve-plan-memory. After: the casts.
  }];
  let statistics = [
    Statistic<"numPacked", "num-packed", "Activations kept in 16 bits">,
    Statistic<"numBytesSaved", "bytes-saved", "Bytes no longer kept in f32 (per function call)">,
    Statistic<"numSendBytesSaved", "send-bytes-saved", "Bytes pipeline sends no longer send (per micro-batch)">
  ];
}

def CarveStoreParams16 : Pass<"carve-store-params16", "mlir::ModuleOp"> {
  let summary = "Store each trainable parameter as the 16-bit copy the step reads; its fp32 master goes with the optimizer state";
  let description = [{
    Under `carve.plan`'s `precision` `bf16` or `fp16` (nothing under `fp32`),
    in each function the emitter prints, each trainable f32 parameter
    argument becomes the 16-bit copy (bf16 or f16, two bytes per element)
    that forward and backward read, marked `carve.master`:

      - carve-plan-memory lays out the copy where the parameter was (ZeRO-1
        and 2: the whole copy, gathered in place; ZeRO-3: this rank's chunk,
        and 16-bit gather buffers) and an fp32 master of it with the
        optimizer state (ZeRO >= 1: this rank's chunk), so the model states
        are ZeRO's mixed-precision accounting: 2 bytes of weights, 4 of
        gradients (see below), 12 of master, exp_avg and exp_avg_sq per
        parameter, divided as the stage says;
      - the optimizer's update reads and writes the master and then rounds
        it (round to nearest even) into the copy; ZeRO-1 and 2 all-gather
        the copies' chunks and ZeRO-3 gathers them in 16 bits, half the
        bytes of fp32;
      - checkpoints save and load the masters, so they are fp32 and load
        into any plan and precision.

    Each op that reads the parameter reads it through a `carve.cast` to f32
    placed just before it (`PARAM (16-bit copy as fp32)`, exact), so no
    kernel changes and the f32 value lives only while its reader runs. The
    matmul and attention kernels round their inputs to the format anyway,
    so for them the copy changes nothing; norms' weights, biases and
    embedding rows are read rounded, as in Megatron-LM's and DeepSpeed's
    bf16/fp16 models.

    Gradients are carve-store-grads16's: 16-bit unless micro-batches
    accumulate them in fp32 (2 or 4 bytes per parameter).

    Frozen parameters and buffers stay f32 (no optimizer, no master).

    Before: after carve-pack-activations (and carve-recompute, whose clones
    get their own casts), before carve-data-parallel (ZeRO-3's gather
    ranges are the casts') and carve-plan-memory. After: the arguments'
    types and marks, and the casts.
  }];
  let statistics = [
    Statistic<"numParams", "num-params", "Parameters stored as 16-bit copies">,
    Statistic<"numCasts", "num-casts", "Reads of a copy as fp32">,
    Statistic<"numBytesSaved", "bytes-saved", "Bytes the copies take less than fp32 parameters">
  ];
}

def CarveStoreGrads16 : Pass<"carve-store-grads16", "mlir::ModuleOp"> {
  let summary = "Produce, reduce and keep the gradients in the plan's 16-bit format";
  let description = [{
    Under `carve.plan`'s `precision` `bf16` or `fp16`, when the plan's
    gradients are 16-bit (`PlanAttrs::gradients16`: always, except when
    micro-batches accumulate whole gradients (ZeRO-0/1, `num_micro_batches`
    > 1) and `grad_accumulation` is `fp32`, Megatron-LM's
    `accumulate_allreduce_grads_in_fp32`), each gradient an emitted
    function returns (`carve.grad_of`) becomes a `carve.cast` of it to the
    format (round to nearest even), placed right after the op that makes
    it final (`gradient of PARAM (16-bit)`). The function's result types
    follow.

    What follows from the types, in the passes after it and the emitter:
      - the gradient slots (carve-plan-memory) take 2 bytes per element, and
        the kernel's f32 result lives only until the cast;
      - dp's bucket all-reduces and ZeRO-2/3's reduce-scatters move and sum
        16 bits (each step rounded, in rank order, on every communicator);
      - micro-batches under ZeRO-2/3 reduce-scatter 16-bit gradients into
        16-bit staging chunks, added into fp32 chunk accumulators
        (`grad_accumulation` `fp32`, PlanAttrs::fp32ChunkAccumulators) or
        into 16-bit chunks (`16bit`); under ZeRO-0/1 with `16bit` the
        whole 16-bit gradient accumulates (each add rounded);
      - the tail (unscale, norm, clipping, the update) reads 16-bit
        gradients exactly as floats; unscaling and clipping write them back
        rounded.

    Before: after carve-store-params16, before carve-data-parallel. After:
    the casts, and the emitted functions' gradient result types.
  }];
  let statistics = [
    Statistic<"numGrads", "num-grads", "Gradients kept in 16 bits">,
    Statistic<"numBytesSaved", "bytes-saved", "Bytes the gradients take less than fp32">
  ];
}

def CarveRoundOperands16 : Pass<"carve-round-operands16", "mlir::ModuleOp"> {
  let summary = "Round an f32 matmul operand to 16 bits once, before its first reader (CUDA target, bf16/fp16 plans)";
  let description = [{
    On the CUDA target under a bf16 or fp16 plan, cuBLAS multiplies 16-bit
    operands: a matmul whose operand is f32 rounds it into scratch first (a
    conversion kernel per call). In each function the emitter prints, for
    each f32 value (through reshapes, the value they alias) that matmuls
    run by cuBLAS read as an operand (through folded transposes; not a
    fused chain's, a convolution's gathered windows or a scattered
    product's), or cuDNN's convolutions (conv2d and its two gradients, which
    round their operands the same way), and that is not itself an f32 view
    of a 16-bit tensor:

      - where it has a 16-bit copy already (carve-pack-activations' copy of
        a saved activation, a pipeline send's), that copy moves before the
        first such reader if it is after it;
      - otherwise, where two or more such matmuls read it (a gradient that
        the data-gradient and the weight-gradient matmuls both read; the
        normalized input of Llama's q, k and v projections) and all of them
        are in the forward or all in the backward, a `carve.cast` to the
        format right after the op that writes the value (where that op is
        in the same part and not a fused chain's member: carve-select-kernels'
        rule 3e may have it write the cast's result itself), else before the
        first reader (`NODE (16-bit operand)`). (A copy kept
        from forward to backward beside the f32 value would cost memory.)

    And the first 16-bit copy of any value whose writer rounds it
    (carve.round16; not a cast, not a fused chain's member) moves right
    after the writer, so that carve-select-kernels' rule 3d has the copy do
    the rounding (roundCopyBf16: one kernel where there were two).

    And the output gradient dy of a carve.attention_grad_stats that runs on
    cuDNN (which rounds dy to 16 bits), where dy is a transpose to heads
    (perm 0, 2, 1, 3) of a reshape of a matmul run by cuBLAS, each read
    only by the next: a `carve.cast` to the format right after the matmul
    (`NODE (16-bit dy)`), which rule 3e has the matmul write instead of its
    f32 result (carve-fold-views has the gradient read dy's transpose in
    place: `attention_grad_stats_cudnn(..., dy16)`). Exact: cuBLAS rounds
    its f32 accumulators to nearest even, the bits the gradient's own
    conversion wrote.

    And dq, dk and dv of a carve.attention_grad_stats that runs on cuDNN
    (which writes them in 16 bits), where every reader of each, through
    reshapes, reads it at a position of carve-select-kernels' rule 3g (a
    rotary gradient's input, a reduction's, a binary op's, a unary
    gradient's input, a fused chain's input; not a folded op): a
    `carve.cast` of each to the format right after the gradient (`NODE
    (16-bit dq)`, ...), which rule 3h has cuDNN write (no f32 gradients,
    neverStoredF32), and a cast of each copy back to f32 that the readers
    read instead (a view, read as the copy: rule 3g). Exact: cuDNN's
    gradients are 16-bit values, which the call widened before. (Llama's
    rotary gradient and grouped-query sums; GPT's and BERT's gradients go
    to their transposes, which carve-fold-views has cuDNN write.)

    And the tensor whose column slices are q, k and v of a
    carve.attention_stats that runs on cuDNN, where carve-fold-views' rule
    "strided" will have cuDNN read them in place (fusion/Passes.td; the QKV
    projection of a GPT): it is marked carve.round16 and gets a
    `carve.cast` to the format right after its writer (`NODE (16-bit q, k,
    v)`), which that writer (the bias add's binary16, rule 3h, or the
    matmul, rule 3e) writes instead of the f32 tensor. Exact: q, k and v
    are its elements rounded to the format either way (their transposes
    round as written), and nothing else reads it.

    And a carve.add of a bias to a matmul's product that carve-fold-views'
    "epilogue" can have the matmul compute (biasedMatmul: the bias an f32
    view of a 16-bit tensor along the last dimension, the matmul's product
    read by the add alone), where the add is a fused chain's member rounded
    as written (carve.round16) and read only by the chain's members and its
    16-bit copies: it leaves the chain (its carve.fusion_group removed), and
    its copy moves right after it (above). The chain then reads the copy as
    its input (carve-select-kernels' rule 3g); the same bits, since the
    chain read the rounded sum (GPT-2's MLP: the bias add before GELU).

    carve-select-kernels then marks those operands carve.read16 (matmul16
    reads the copy as stored). Exact: the cast rounds to nearest even as
    the matmul's own rounding does, from the same value; the reader
    multiplies the same bits. The fp32 plans and the CPU target are
    unchanged.

    Before: after carve-store-grads16, before carve-data-parallel and
    carve-plan-memory (which gives the casts their memory). After: the casts,
    and the copies' new places.
  }];
  let statistics = [
    Statistic<"numMoved", "num-moved", "16-bit copies moved earlier (before their first matmul reader, or right after the op that rounds their input)">,
    Statistic<"numCasts", "num-casts", "Operands rounded once for several matmuls">,
    Statistic<"numReads", "num-reads", "Matmul reads of a 16-bit tensor made before them">,
    Statistic<"numUnfused", "num-unfused", "Bias adds of a matmul's product taken out of their fused chain (its epilogue adds them)">
  ];
}

#endif // CARVE_PRECISION_PASSES_TD
