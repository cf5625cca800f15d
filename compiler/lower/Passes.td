//===- Passes.td - lowerings under the plan and to runtime calls -*- tablegen -*-===//

#ifndef CARVE_LOWER_PASSES_TD
#define CARVE_LOWER_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveSelectKernels : Pass<"carve-select-kernels", "mlir::ModuleOp"> {
  let summary = "Choose, per op and target, the runtime entry that implements it";
  let description = [{
    The same op can run as different calls: a matmul as `matmul`, as
    `matmul_gathered` (its right operand a convolution's windows, never in
    memory) or not at all (its product computed by the gather_grad or the
    transpose that reads it); a transpose as `transpose` or as nothing (a
    matmul's transpose flag); a gather as `gather`, `gather_sharded` (rows
    split over tp) or nothing. Which one is a decision of the compiler, so it
    is made here, on the IR, where lit sees it, and the emitter prints what
    it is told. The GPU libraries (cuBLASLt with epilogues, cuDNN attention)
    plug in as further patterns of this pass.

    For every op of the functions the emitter prints (`@train_step`, or the
    stage functions `@stage0 ..`) but the optimizer's tail (carve-optimizer's
    ops, which the tail's printer reads), in order:

      1. a member of a fused chain (carve.fusion_group) runs as `fused`;
      2. a constant (a static array), a reshape (a view of the same memory),
         a transpose folded into its readers' flags (carve.fold = "operand"),
         a matmul whose product another op computes (the transpose marked
         "product", or a gather_grad marked "scatter", through reshapes) and
         a gather whose matmuls gather it themselves (carve.fold = "gather",
         and its reshapes), and the ops carve-fold-views marked "view",
         "producer", "consumer", "accumulate", "assemble", "strided" or
         "epilogue" run as `none` (a transpose marked "strided" whose
         source's writer does not write the source's 16-bit copy alone,
         neverStoredF32, is an error); the matmul whose product an add
         marked "epilogue" reads runs as `matmul16_bias` (cuBLASLt adds the
         bias and writes the add's copy, carve.copy_by_writer; the bias's
         f32 view is no call);
      3. a transpose marked "product" runs as `matmul` (B^T A^T); a matmul
         reading a gathered operand as `matmul_gathered`; a gather_grad
         marked "scatter" as `matmul_gather_grad`;
      4. a gather, gather_grad or cross-entropy whose rows or classes are
         split over tp (dist.sharded_rows) runs as its `_sharded` or
         `_vocab_parallel` entry;
      3b. on the CUDA target under bf16/fp16, a matmul (or product) whose
         operand, as read (through folded transposes and reshapes), has a
         16-bit tensor of the same bits (stored16: the tensor it is an f32
         view of, a cast from the plan's 16-bit format: a weight's copy, a
         saved activation; or its 16-bit copy made before the call,
         carve-round-operands16) runs as `matmul16` with `carve.read16`
         marking the operands whose 16-bit tensor cuBLAS reads directly (the
         same bits the call would round the operand to); a view that every
         reader reads so (directly or through reshapes) runs as `none`, and
         the emitter prints no pointer for it or its reshapes
         (carve-plan-memory keeps the 16-bit tensor alive until its last
         such reader);
      3k. on the CUDA target, a convolution carve-lower-convolutions kept
         whole (conv2d, conv2d_grad_input, conv2d_grad_weight) runs as its
         runtime entry, cuDNN's convolution; under bf16/fp16 with
         carve.read16 on the operands whose 16-bit tensor exists (stored16),
         which the call reads as stored; elsewhere it is an error;
      3c. on the CUDA target, an attention_stats or attention_grad_stats
         (carve-save-attention-stats) runs as `attention_stats_cudnn` /
         `attention_grad_stats_cudnn`, cuDNN's fused flash attention, where
         the plan's precision is bf16 or fp16, a mask (if any) is an f32
         tensor that broadcasts to the scores (cuDNN's 16-bit bias) and
         the head dimensions are multiples of 8 up to 256 (the forward
         reads q, k, v as the 16-bit copies made before it, of them or of
         the values they are reshapes of); otherwise as
         carve's kernel, with `carve.kernel_why` saying why not (carve
         compile prints a note; the runtime checks again and runs carve's
         kernel where cuDNN's engines refuse the shape on the GPU);
      3d. on the CUDA target under bf16/fp16, a 16-bit copy (a cast from f32
         to the plan's format) right after the op that wrote its input,
         where that op is marked carve.round16 and would round with a kernel
         of its own (not a cast or a fused chain's member), runs as
         `roundCopyBf16` / `roundCopyF16`: the input rounded in place and
         the copy written in one kernel (the same bits); the op is marked
         `carve.round16_in_copy` and the emitter prints no rounding after it
         (carve-round-operands16 puts such copies right after their op);
      3e. on the CUDA target under bf16/fp16, a 16-bit copy right after a
         matmul run by cuBLAS (or the transpose of a product it computes) or a
         cross_entropy_grad that writes its input, where every other reader
         of the input reads the copy's bits (carve.read16, directly or
         through reshapes), is written by that op itself
         (`matmul16_to16`: cuBLAS rounds its fp32 accumulators to the
         format; `cross_entropy_grad16`), which is marked `carve.write16`
         and writes no f32 result; the copy runs as `none`. A cross_entropy
         or cross_entropy_grad (not vocab-parallel) whose logits have a
         16-bit tensor of their bits (stored16) reads it
         (`cross_entropy16` / `cross_entropy_grad16`, carve.read16, and
         train --eval-data's accuracy `count_correct16`);
      3f. on the CUDA target under bf16/fp16, a 16-bit copy (a conversion)
         of a fused chain's output, among the copies right after the
         chain's root (carve-round-operands16 puts them there), is written
         by the chain's kernel as it writes the f32 value, rounded to
         nearest even as the conversion rounds it (a value the chain
         rounds, carve.round16, is its copy's value): the copy runs as
         `none`, marked `carve.copy_in_fused`;
      3g. on the CUDA target under bf16/fp16, a kernel that computes in f32
         reads an f32 operand as the 16-bit tensor holding exactly its values
         (exact16: the tensor it is a view of, a parameter's copy or a saved
         activation; or its copy made before the op where the value is
         rounded as written), widened in registers, where that operand is
         the input, scale or bias of a layer or RMS norm, the input or scale
         of their gradients, the input of a unary gradient, an operand of a
         binary op, a gather's table (not vocab-parallel), the input of a
         sum, mean or max, or an input of a fused chain: the op runs as
         `layer_norm16`, `layer_norm_grad16`, `rms_norm16`,
         `rms_norm_grad16`, `unary_grad16`, `binary16`, `gather16`,
         `reduce16` (a chain's member stays `fused`), with `carve.read16`
         one flag per operand; a view every reader reads so runs as `none`
         (as 3b; the same bits);
      3h. on the CUDA target under bf16/fp16 (before 3d), the first 16-bit
         copy (toBf16 / toF16) among the copies right after the op that
         writes its input, where that op is an f32 binary op, unary
         gradient, layer or RMS norm, rotary embedding or its gradient,
         concat, transpose or expand (not a fused chain's member, not
         folded), is written by that op as it writes
         the value (and the copy of a gather's gradient, by
         `gather_grad16`; the copies of cuDNN's dq, dk, dv that
         carve-round-operands16 made, all three, by
         `attention_grad_stats_cudnn` itself; the copy of a layer or RMS norm gradient's input
         gradient, by that gradient: `layer_norm_grad16`,
         `rms_norm_grad16`; the copy of a cuDNN convolution's result, by the
         convolution's own entry, which computes it in 16 bits): the op runs as `binary16`, `unary_grad16`,
         `layer_norm16`, `rms_norm16`, `rotary16`, `rotary_grad16`
         (carve.read16 as rule 3g left it, else all false), `concat16`,
         `transpose16`, `expand16` or `transpose16_view`
         (rule 4b), and the copy runs as
         `none`, marked `carve.copy_by_writer`; an op marked carve.round16
         rounds its value as it writes it (the same bits: the value rounded
         to nearest even, as the conversion rounds it); where every other
         reader reads the copy's bits, the op writes no f32 value
         (neverStoredF32);
      3i. on the CUDA target under bf16/fp16, after rules 3e and 3h: a
         bias gradient's reduction (a carve.reduce_sum over every axis but
         the last, run as `reduce16`, whose f32 result is never stored: its
         16-bit copy is the parameter's gradient, carve.copy_by_writer)
         whose input, through reshapes, is the [K, N] operand a weight
         gradient's GEMM reads as its 16-bit tensor, where that GEMM runs as
         `matmul16_to16` (carve.write16) computing a^T b (a call with
         transA and not transB: a product's transpose or a matmul whose
         first operand is a folded transpose), both operands read in 16
         bits, and where every reader of the bias gradient comes after the
         GEMM: the GEMM runs as `matmul16_to16_bgrad` (cuBLASLt's BGRADB
         epilogue for its call's first operand, BGRADA for its second:
         `carve.bias_grad_of` = 0 or 1) and writes the bias gradient's
         16-bit copy; the reduction runs as `none`, marked
         `carve.bias_grad_in_gemm`. Not the same bits: cuBLASLt sums the
         16-bit values it multiplies, where reduce16 summed the f32 values
         they were rounded from (each within half a 16-bit ulp: the sum
         moves by at most that relative to the sum of magnitudes);
      3j. on the CUDA target, in `@train_step` (not in pipeline stages,
         whose forward and backward print as functions of their own), a
         cross_entropy_grad (run as
         `cross_entropy_grad` or `cross_entropy_grad16`) after the
         cross_entropy of the same logits (through reshapes and 16-bit
         casts), targets, ignore_index and reduction, read in the same
         format, with only ops that run as `none` between them and its
         output gradient's seed defined before the loss: it runs as
         `cross_entropy_with_grad`, which writes the loss as well (one pass
         over the logits, bit for bit the two calls), and the cross_entropy
         is marked `carve.loss_in_grad` (the emitter guards its call with
         ctx.evaluating: train --eval-data's forward still computes it);
      4b. on the CUDA target, a slice carve-fold-views marked
         (carve.fold = "view") runs as `none`, and each transpose reading it
         (through reshapes) as `transpose_view`: the slice's source read in
         place as a strided view (the emitter passes the source at the
         view's offset with its shape and strides); a transpose it marked
         "producer" (dq, dk and dv of a cuDNN attention gradient, written
         by it as [b, t, h, d]) or "consumer" (dy of such a gradient, read
         by it as [b, t, h, d]) runs as `none`;
      4c. on the CUDA target, an add carve-fold-views marked
         (carve.fold = "accumulate") runs as `none`, and the layer or RMS
         norm gradient whose input gradient it reads as
         `layer_norm_grad_add` / `rms_norm_grad_add`: it adds the add's
         other operand as it writes the add's result; under bf16/fp16 the
         first 16-bit copy among the copies right after the add is written
         by it too (as rule 3h: `layer_norm_grad_add16` /
         `rms_norm_grad_add16`, the copy `none` with
         `carve.copy_by_writer`); rule 3g's 16-bit reads turn the entries
         into their 16-bit forms as they do `layer_norm_grad`'s;
      4d. on the CUDA target, a concat carve-fold-views marked
         (carve.fold = "assemble": the pieces are a cuDNN attention
         gradient's dq, dk and dv) runs as `none`, and its 16-bit copy (the
         first among the copies right after it) is `none` with
         `carve.copy_by_writer`: `attention_grad_stats_cudnn` writes the
         pieces into it in 16 bits; likewise the copy of a cuDNN attention
         forward's output transpose marked "producer" (rule 4b), which
         `attention_stats_cudnn` writes O into;
      5. every other op runs as its family's entry (`binary`, `unary`,
         `reduce`, `layer_norm`, `attention`, `allGatherSplit`, ...; a cast
         as the conversion its element types name), if the target has it;
      6. the step's tail (carve-optimizer's ops, otherwise left to their
         printer), on the CUDA target: every carve.adamw runs as
         `adamwMulti` (one launch over all parameters), every carve.sgd as
         `sgdMulti` (its 16-bit copies written in it), and carve.grad_norm
         as `sumSquaresMulti` (two launches), bit for bit the per-tensor
         calls.

    Before: the module after carve-optimizer (every mark above in place;
    the target in `carve.plan`, "cpu" when absent). After: every such op
    carries `carve.kernel = "<entry>"`, an entry of
    runtime/include/carve/rt/kernels.def that the plan's target has, or
    "none". An op no entry of the target implements (an f64 add on CUDA, a
    16-bit cast other than to or from f32, an op with no kernel at all) is
    an error naming the op, its model node and the target. The emitter
    refuses an op without `carve.kernel`, naming this pass.
  }];
  let statistics = [
    Statistic<"numCalls", "num-calls", "Ops that run as a runtime call">,
    Statistic<"numNone", "num-none", "Ops that run as no call of their own">,
    Statistic<"numWrite16", "num-write16",
              "Ops that write their result's 16-bit copy themselves (carve.write16)">,
    Statistic<"numCopyInFused", "num-copy-in-fused",
              "16-bit copies a fused chain's kernel writes (carve.copy_in_fused)">,
    Statistic<"numRoundInCopy", "num-round-in-copy",
              "Roundings done by the 16-bit copy after them (roundCopyBf16/F16)">,
    Statistic<"numCopyByWriter", "num-copy-by-writer",
              "16-bit copies written by the op that writes the value (rule 3h)">,
    Statistic<"numRead16Ops", "num-read16-ops",
              "Norms, elementwise kernels and gathers that read 16-bit tensors (rule 3g)">,
    Statistic<"numRead16Views", "num-read16-views",
              "16-bit views no call computes: their matmuls read the 16-bit tensor">,
    Statistic<"numCudnnAttention", "num-cudnn-attention",
              "Attention calls that run as cuDNN's fused flash attention">,
    Statistic<"numBiasGradInGemm", "num-bias-grad-in-gemm",
              "Bias gradients summed by their weight gradient's GEMM (rule 3i)">,
    Statistic<"numLossInGrad", "num-loss-in-grad",
              "Cross-entropy losses computed with their gradient (rule 3j)">
  ];
}

def CarveSaveAttentionStats : Pass<"carve-save-attention-stats", "mlir::ModuleOp"> {
  let summary = "Attention keeps its row statistics for its gradient (CUDA target)";
  let description = [{
    The CUDA target's attention backward needs each query row's
    log-sum-exp and the forward's output; without them it runs the forward
    again (a third of attention's time in a GPT-2 step). For each
    `carve.attention_grad` of a printed function whose query, key, value,
    mask, scale and causal flag are those of a `carve.attention` before it
    in the same function, the forward becomes `carve.attention_stats` (the
    output and its f32 row statistics) and the gradient
    `carve.attention_grad_stats`, which reads both. The statistics are f32
    and the output stays as the forward wrote it (no 16-bit copy), so the
    gradient is the one the forward-again kernel computes, bit for bit.
    Runs for the CUDA target only (the CPU kernel computes the
    probabilities in blocks and keeps no statistics), and not under a
    `recompute` plan (which asked for the memory back). Before: after
    carve-recompute's place in the pipeline, before carve-pack-activations
    and carve-plan-memory (the statistics and the output's longer life are
    planned like any value). After: no attention_grad with such a forward;
    an attention whose gradient is elsewhere (another stage) is unchanged.
  }];
  let statistics = [
    Statistic<"numPaired", "num-paired", "Attention gradients that read the saved statistics">
  ];
}

def CarveLowerConvolutions : Pass<"carve-lower-convolutions", "mlir::func::FuncOp"> {
  let summary = "Convolution and max pooling as gathers, matmuls and reductions (im2col); batch norm";
  let description = [{
    Rewrites every `carve.conv2d` and `carve.max_pool2d` into ops that autodiff,
    the partitioner and both targets already handle (the builders of
    compiler/frontend/LowerConvolutions.cpp, which the importer shares):
    the sliding windows as a `carve.gather` of the flattened image with a
    constant index of positions (strides, padding, dilation; the taps in the
    padding read one element of 0, or -inf for max pooling, concatenated after
    the image); then a
    `carve.matmul` with the weight (per group: grouped and depthwise
    convolutions) and the bias, or a `carve.reduce_max` over the kernel's taps.
    The windows are [N, C, taps, pixels] and the GEMM one per sample, the
    weight as stored, the result NCHW; where the pixels are fewer than the
    output channels, [N, C, pixels, taps] transposed into one GEMM over every
    sample's pixels.

    `carve.batch_norm` becomes reductions and elementwise ops: in training
    mode the batch's mean and biased variance over all dimensions but 1
    (`carve.eval_select` puts the running statistics there in an
    evaluation's forward), and `carve.assign` writes the running statistics
    updated as PyTorch updates them (momentum, unbiased variance) to their
    buffers; in eval mode the running statistics. Where the module's plan
    has `sync_batch_norm`, the training statistics are over every
    data-parallel replica's share: the per-channel sums go through
    `carve.replica_sum` (the mean, then the squares about it).

    On the CUDA target with the plan's `convolution = "cudnn"` (the default;
    `carve compile --convolution carve` says otherwise) and tp = 1, a
    `carve.conv2d` stays whole: autodiff gives it `carve.conv2d_grad_input`
    and `carve.conv2d_grad_weight`, and carve-select-kernels runs the three
    as cuDNN's convolutions. Under tp (channels split through the GEMMs) and
    in the planner's profile they are lowered.

    Runs first in `carve compile`, and in `carve plan`'s profile (so that the
    planner prices the ops that run). Before: any carve IR. After: no
    max_pool2d or batch_norm, and no conv2d except those kept for cuDNN.
  }];
  let options = [
    Option<"planning", "planning", "bool", /*default=*/"false",
           "The planner's one-sample import: batch norm over one value per channel "
           "is lowered to be priced, not refused">,
    Option<"keepWhole", "keep-whole", "bool", /*default=*/"false",
           "Keep every conv2d whole, whatever the plan (the planner's profile of a "
           "CUDA program whose convolutions run as cuDNN's at tp = 1)">
  ];
  let dependentDialects = ["carve::CarveDialect"];
  let statistics = [
    Statistic<"numLowered", "num-lowered", "Number of convolutions and poolings lowered">
  ];
}

#endif // CARVE_LOWER_PASSES_TD
