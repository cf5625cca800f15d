//===- Passes.td - elementwise fusion ----------------------*- tablegen -*-===//

#ifndef CARVE_FUSION_PASSES_TD
#define CARVE_FUSION_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveFuseElementwise : Pass<"carve-fuse-elementwise", "mlir::ModuleOp"> {
  let summary = "Group chains of elementwise ops into one fused kernel each";
  let description = [{
    A training step is full of short elementwise chains (bias add and GELU,
    residual adds, the GELU's gradient times the incoming gradient); run as
    one kernel each op reads and writes its whole tensor. This pass groups
    such chains so that the emitter writes one kernel per group that reads
    each input once and writes only what is read later (docs/fusion.md).

    Walking back from each not-yet-grouped elementwise op (the root), an op
    P producing one of the group's operands joins when

      1. P is an f32 elementwise op with a fused form (add, sub, mul, div,
         max, min, the unary ops of the runtime's Unary enum and their
         gradients) over the root's shape (read element for element, never
         broadcast), on the same side of forward / backward as the root;
      2. every reader of P's result outside the group runs after the root
         (the kernel writes that result as an extra output), or nothing
         else reads it (it is never stored);
      3. neither P's result nor its operands are results of the function
         (the gradients, which bucket reductions update in place once final);
      4. the group stays small: at most 16 ops, 8 inputs and 4 outputs.

    Candidates are taken from the latest op back, so an op's readers inside
    the group have all been decided when it is considered.

    Before: the functions the emitter prints, `@train_step` or the stage
    functions `@stage0 ..` (after carve-partition and carve-split-stages);
    other functions are left alone. After: the ops are unchanged; each member
    of a group of two or more carries `carve.fusion_group = K` (K numbered
    from 0 in program order within its function; the last member is the
    root, where the kernel runs). Without this pass (`carve compile
    --no-fuse`) every op is its own kernel.
  }];
  let statistics = [
    Statistic<"numGroups", "num-groups", "Fused kernels formed">,
    Statistic<"numFused", "num-fused", "Ops that run inside a fused kernel">
  ];
}

def CarveFoldViews : Pass<"carve-fold-views", "mlir::ModuleOp"> {
  let summary = "Slices read in place by their transposes, and other copies and adds that the ops around them absorb (CUDA target)";
  let description = [{
    A tensor split into parts that are then transposed (the QKV projection's
    output split into q, k and v, each reshaped to heads and transposed to
    [batch, heads, tokens, head size]) is copied twice: once by each slice,
    once by each transpose. The transpose can read the slice's elements
    where they are, as a strided view of the slice's source.

    This pass marks a carve.slice `carve.fold = "view"` when

      1. its steps are positive (its bounds are normalized), its result is
         not empty and its elements are f32, f64, i64 or i32 (the
         transpose's types);
      2. every reader of its result, through carve.reshape ops, is a
         carve.transpose that is neither folded (carve-fold-transposes)
         nor a fused kernel's member;
      3. each such transpose's input is a strided view of the slice's
         source: every reshape on the way splits or merges only dimensions
         that are contiguous within the view (no copy needed).

    The slice is then never in memory: carve-plan-memory gives it no block
    and keeps its source alive until the transposes, carve-select-kernels
    makes it no call and runs the transposes as `transpose_view` /
    `transpose16_view` (runtime/cuda/kernels_data.cu), and the emitter
    passes the source's element at the view's offset with the view's
    strides. The same values: each transpose reads the elements the slice
    would have copied.

    It also marks `carve.fold = "producer"` each transpose of dq, dk and dv
    to [b, t, h, d] (perm 0, 2, 1, 3) after a carve.attention_grad_stats
    that runs on cuDNN (carve-select-kernels' rule 3c), where each of the
    three gradients is read by that transpose alone and none is rounded as
    written (carve.round16): cuDNN writes the gradients with those strides
    (`attention_grad_stats_cudnn(..., /*bthd=*/true)`), so the gradients are
    never in memory as [b, h, t, d], the transposes are no calls, and their
    results live from the attention gradient (carve-plan-memory). The same
    values: the elements cuDNN writes, in the transposes' places. Likewise
    it marks `carve.fold = "consumer"` the transpose of the output gradient
    dy from [b, t, h, d] to [b, h, t, d] that such an attention gradient
    reads, where it is that transpose's only reader and dy is not rounded as
    written: cuDNN reads dO with those strides (`/*dy_bthd=*/true`), so the
    transpose is no call and never in memory, and its input lives until the
    attention gradient.

    Under a bf16/fp16 plan it marks `carve.fold = "producer"` the transpose
    of a cuDNN attention forward's output O to [b, t, h, d] (perm 0, 2, 1,
    3) where O's only other readers are cuDNN attention gradients (as their
    o), the plan's 16-bit copy is among the casts right after the transpose
    and every other reader of the transpose reads that copy (see below):
    cuDNN writes O in 16 bits straight into the copy
    (`attention_stats_cudnn(..., y16)`), and the gradients read o there
    (`attention_grad_stats_cudnn(..., o16)`), so neither O nor its transpose
    is in f32 memory and the transpose is no call. The same values: cuDNN
    writes O in 16 bits either way (before, it was widened, transposed and
    rounded again to the same bits, and rounded for the gradient again).

    Under a bf16/fp16 plan it then marks `carve.fold = "assemble"` (and
    `carve.round16`) a carve.concat along the last axis whose three operands
    are those dq, dk and dv transposes, each through a reshape merging heads
    and head dimension ([b, t, h, d] -> [b, t, h * d]; the QKV projection's
    gradient), where the plan's 16-bit copy is among the casts right after
    the concat and every other reader of the concat reads that copy: a
    matmul run by cuBLAS (through reshapes and folded transposes: it rounds
    its operands to the copy's bits) or a sum, mean or max (which reads the
    copy exactly: carve-select-kernels' rule 3g). cuDNN writes each gradient
    in 16 bits straight into the copy at its columns (a row stride of the
    concat's width; `attention_grad_stats_cudnn(..., dq16, dk16, dv16,
    rowStride)`), so neither the concat nor the transposes are in f32
    memory, the concat is no call, and its copy lives from the attention
    gradient. The same values: cuDNN writes the gradients in 16 bits either
    way (before, they were widened, transposed, concatenated and rounded
    again to the same bits).

    Under a bf16/fp16 plan it marks `carve.fold = "strided"` the three
    transposes that make q, k and v of a cuDNN attention forward, and the
    16-bit copy of each, where they are column slices (through slices marked
    "view" and reshapes to [b, t, h, d]) of one rank-3 f32 tensor that
    carve-round-operands16 rounded as written and gave a 16-bit copy right
    after its writer (a binary op or a matmul run by cuBLAS, neither fused
    nor folded; the QKV projection, as llm.c reads it), where nothing else
    reads the tensor, each transpose (perm 0, 2, 1, 3, rounding as written)
    is read only by its copy and by cuDNN attention forwards and gradients
    at the same operand, and each copy only through f32 views by such
    gradients. cuDNN's forward and gradient read q, k and v in place in
    the rows of the tensor's copy, as [b, t, h, d] rows of the tensor's
    width (`attention_stats_cudnn(..., inRowStride16)`,
    `attention_grad_stats_cudnn(..., inRowStride16)`), so neither the
    transposes, their copies nor the f32 tensor are in memory, none is a
    call, and the tensor's copy lives until the last gradient
    (carve-plan-memory). The same values: each element of q, k and v is
    the tensor's element rounded to the format, where it was before (three
    transposes copied it there).

    Where that tensor is a carve.add of a 1-D bias (an f32 view of a 16-bit
    tensor: a parameter, along the last dimension) to the product of a
    matmul run by cuBLAS (read by the add alone, its right operand a
    matrix), it marks the add `carve.fold = "epilogue"`: the matmul adds the
    bias to its fp32 product as it rounds it into the add's copy
    (`matmul16_bias`, cuBLASLt's BIAS epilogue; carve-select-kernels), so
    neither the product nor the add is in memory, the add is no call, and
    the copy lives from the matmul. The same bits: the product's fp32
    accumulator plus the bias, rounded once, as the add computed it.

    Under a bf16/fp16 plan it then marks `carve.fold = "epilogue"` a
    carve.gelu of the tanh form (`approximate = "tanh"`, cuBLASLt's GELU)
    rounded as written, alone in its fused chain (it leaves the chain),
    whose input is such a bias add, whose last dimension is a multiple of 8
    and whose f32 result no reader reads (its 16-bit copy right after it is
    what they read): the matmul applies GELU to the fp32 sum of its product
    and the bias as it writes both the add's copy (the pre-activation, which
    the backward reads) and the GELU's copy (`matmul16_bias_gelu`,
    cuBLASLt's GELU_AUX_BIAS epilogue; carve-select-kernels). Neither is
    in f32 memory and neither is a call. Not the same bits: GELU now reads
    the unrounded sum (the fused chain read the add's 16-bit copy), one
    rounding less; the CPU target keeps the rounding (the bf16 bound of
    tests/gpu/train_vs_cpu.py covers the difference).

    Under a bf16/fp16 plan it also marks `carve.fold = "epilogue"` a
    carve.unary_grad of the tanh GELU (`fn = "gelu_tanh"`, cuBLASLt's GELU
    form; not the erf form) whose gradient operand is the product of a
    matmul run by cuBLAS (read by it alone, its right operand a matrix, the
    last dimension a multiple of 8), whose input (the pre-activation) has a
    16-bit tensor of its bits, and whose f32 result no reader reads (its
    16-bit copy right after it is what they read): the matmul multiplies its
    fp32 product by GELU's derivative at the 16-bit pre-activation as it
    rounds it into the gradient's copy (`matmul16_dgelu`, cuBLASLt's DGELU
    epilogue with the pre-activation as its auxiliary input;
    carve-select-kernels), so neither the product nor the gradient is in
    f32 memory, the unary_grad is no call (marked `carve.round16` too: its
    value is its copy's, which a bias gradient's sum then reads, rule 3g),
    and the copy lives from the matmul. The same bits: the product's fp32
    accumulator times the derivative at the same 16-bit input, rounded
    once, as unary_grad16 computed it from the stored product (on a GPU,
    up to how cuBLASLt evaluates the derivative); every reader read the
    copy before too (the bias gradient's sum through the weight gradient's
    GEMM, rule 3i).

    And it marks `carve.fold = "accumulate"` a carve.add of a carve.layer_norm_grad's
    or carve.rms_norm_grad's input gradient and another f32 tensor of the
    same shape (the residual branch's gradient), where the input gradient is
    read by the add alone, the other operand is defined before the norm
    gradient, and neither op is fused, folded or rounded as written: the norm
    gradient adds that operand as it writes its input gradient, into the
    add's result (`layer_norm_grad_add`, `rms_norm_grad_add` and their 16-bit
    forms, carve-select-kernels), and writes the add's 16-bit copy where the
    add would have (rule 3h). The input gradient is never in memory, the add
    is no call, and its result lives from the norm gradient
    (carve-plan-memory). The same values: the same f32 sum of the same two
    values (an add commutes exactly), rounded the same way for the copy.

    Only on the CUDA target (the CPU runtime copies the slice); it runs
    right before carve-plan-memory, after every pass that adds readers.
    Before: the functions the emitter prints. After: the marks above (and
    the round16 they imply on an assembled concat and a strided source's
    writer); nothing else changes.
  }];
  let statistics = [
    Statistic<"numFolded", "num-folded", "Slices read in place by their transposes">,
    Statistic<"numProduced", "num-produced",
              "Transposes of attention gradients written by cuDNN in their place">,
    Statistic<"numConsumed", "num-consumed",
              "Transposes of an attention gradient's dy that cuDNN reads in place">,
    Statistic<"numAccumulated", "num-accumulated",
              "Adds of a norm gradient's input gradient that the norm gradient computes">,
    Statistic<"numOutputs", "num-outputs",
              "Transposes of an attention output that cuDNN writes in 16 bits in place">,
    Statistic<"numAssembled", "num-assembled",
              "Concats of dq, dk and dv that cuDNN writes in 16 bits in place">,
    Statistic<"numStrided", "num-strided",
              "Attention forwards whose q, k and v cuDNN reads in place in 16 bits">,
    Statistic<"numEpilogues", "num-epilogues",
              "Bias adds that their matmul computes (cuBLASLt's bias epilogue)">,
    Statistic<"numBiasGelus", "num-bias-gelus",
              "GELUs of a bias add that its matmul computes (cuBLASLt's GELU_AUX_BIAS "
              "epilogue)">,
    Statistic<"numDgelus", "num-dgelus",
              "GELU gradients that their gradient's matmul computes (cuBLASLt's DGELU "
              "epilogue)">
  ];
}

def CarveConcatSliceGrads : Pass<"carve-concat-slice-grads", "mlir::ModuleOp"> {
  let summary = "A sum of slice gradients that tile their input is one concat";
  let description = [{
    The gradient of a tensor split into parts (the QKV projection's output
    split into q, k and v: ONNX Split or three slices) is, as autodiff writes
    it, the sum of one carve.slice_grad per part, each the part's gradient
    placed in zeros of the whole shape: three zero-filled full-size tensors
    and two additions where one concatenation of the parts' gradients says
    the same. This pass replaces a tree of carve.add ops whose leaves are
    carve.slice_grad ops (each read only by the tree) by one carve.concat of
    the leaves' gradients, in the order of their slices, when

      1. every leaf has the tree's result type, unit steps, and slices the
         whole extent of every dimension but one (the same axis for all);
      2. their ranges along that axis are disjoint and cover it exactly;
      3. the tree's adds are f32 or f64, read only inside the tree (but the
         root), and carry no attribute (no fusion group, no rounding).

    Each element of the sum is then one part's gradient plus zeros, which
    is that gradient (but -0 + 0 = +0: a part's negative zero stays
    negative in the concatenation, as in PyTorch's own backward of split).

    Runs on both targets with or without fusion (fused and unfused programs
    stay equal bit for bit), before carve-fuse-elementwise. Before: the
    functions the emitter prints (after carve-autodiff, carve-partition and
    carve-split-stages). After: no such tree is left.
  }];
  let statistics = [
    Statistic<"numConcats", "num-concats", "Sums of slice gradients made one concat">,
    Statistic<"numSliceGrads", "num-slice-grads", "carve.slice_grad ops replaced">
  ];
}

def CarveFoldTransposes : Pass<"carve-fold-transposes", "mlir::ModuleOp"> {
  let summary = "Fold transposes of the last two dimensions into the matmuls around them";
  let description = [{
    The GEMM kernels take each operand with a transpose flag, so a transpose
    that swaps the last two dimensions need not be computed when a matmul is
    next to it. First, a transpose whose input is a transpose it undoes (the
    two permutations compose to the identity) is erased, its readers reading
    the inner transpose's input: backward's transpose of forward's transposed
    Linear weight then reads the weight itself, and the forward transpose
    folds into its matmul instead of keeping a transposed copy of the weight
    alive until backward (one copy per micro-batch in flight in a pipeline).
    Then, for each transpose of the last two dimensions, in program order:

      1. when its input is the result of a matmul whose operands both have
         rank >= 2 and whose only reader is this transpose, (A B)^T = B^T A^T:
         the matmul writes its product transposed in the transpose's place
         (the weight gradients of Linear layers, dW = (x^T dy)^T) and the
         transpose is marked `carve.fold = "product"`;
      2. otherwise, when every reader of its result is a matmul, each of them
         reads the transpose's input with its transpose flag set and the
         transpose is marked `carve.fold = "operand"` (it has no buffer).

    With `scatter-products` (`carve compile` sets it unless --no-fuse): 3. a gather_grad along its
    table's last axis of a matmul's product, read only through reshapes
    (an im2col convolution's input gradient, each product matrix whole rows
    of the table), is marked `carve.fold = "scatter"`: it computes the
    product a block of rows at a time, which never has a buffer.

    With `gather-operands` (likewise): 4. a gather along its table's
    last axis (f32 or f64, i64 indices, not a parameter's table) whose
    every reader, through reshapes and "operand"
    transposes, is a matmul of the same block reading it as its right
    operand only, with each batch matrix of that operand whole rows of
    indices (an im2col convolution's windows, read by the forward's GEMM
    and the weight gradient's), is marked `carve.fold = "gather"`: each
    matmul gathers the batch matrices it multiplies as it needs them, and
    the gather's result, kernel-size times the image, never has a buffer;
    its table is kept for the matmuls instead. Under a bf16 or fp16 plan
    such a gather is marked too although carve-round-activations rounds it
    (carve.round16): the matmuls round their inputs to the plan's format
    themselves, so they see the same bits, and carve-pack-activations keeps
    no 16-bit copy of it.

    Before: the functions the emitter prints, `@train_step` or `@stage0 ..`
    (other functions are left alone). After: the undoing transposes are gone
    and the other ops unchanged; the folded transposes carry `carve.fold`. The emitter and the memory plan
    read the mark: a "product" transpose is computed by its matmul, an
    "operand" one never, a "scatter" gather_grad computes its matmul, a
    "gather" gather is computed by its matmuls.
  }];
  let options = [
    Option<"scatterProducts", "scatter-products", "bool", /*default=*/"false",
           "Mark the gather_grads that compute their matmul's product (rule 3)">,
    Option<"gatherOperands", "gather-operands", "bool", /*default=*/"false",
           "Mark the gathers whose matmuls gather their operand themselves (rule 4)">,
    Option<"undoTransposes", "undo-transposes", "bool", /*default=*/"true",
           "Remove the transposes that undo another (off: marks only; carve plan's "
           "profile reads the marks of its memory model and keeps its ops as they are)">
  ];
  let statistics = [
    Statistic<"numUndone", "num-undone", "Transposes of a transpose they undo, removed">,
    Statistic<"numIntoOperand", "num-into-operand", "Transposes read through a matmul's flag">,
    Statistic<"numIntoProduct", "num-into-product", "Matmuls that write their product transposed">,
    Statistic<"numScattered", "num-scattered", "gather_grads that compute their matmul's product">,
    Statistic<"numGathered", "num-gathered", "gathers whose matmuls gather their operand themselves">
  ];
}

#endif // CARVE_FUSION_PASSES_TD
