//===- Passes.td - passes of the frontend ------------------*- tablegen -*-===//

#ifndef CARVE_FRONTEND_PASSES_TD
#define CARVE_FRONTEND_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveRaise : Pass<"carve-raise", "mlir::func::FuncOp"> {
  let summary = "Recognize normalizations, activations and the attention core";
  let description = [{
    PyTorch's exporter writes many high-level ops out as chains of elementwise
    ops: RMSNorm always, LayerNorm before opset 17, GELU before opset 20, SiLU,
    and attention written by hand as MatMul / Mul / Where / Softmax / MatMul.
    (LogSoftmax + NegativeLogLikelihoodLoss becomes `carve.cross_entropy` in
    the importer itself, since carve has no NLL op.) Autodiff, the
    partitioner and the fused kernels need these ops whole, and a person reads
    them more easily, so this pass folds each chain back into one op:

      1. `x * sigmoid(x)`                                   -> `carve.silu`
      2. `x * 0.5 * (1 + erf(x / sqrt 2))` (any order)      -> `carve.gelu {none}`
         `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`  -> `carve.gelu {tanh}`
      3. `(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* g] [+ b]`
                                                            -> `carve.layer_norm`
      4. `x * rsqrt(mean(x^2) + eps) [* w]` (rsqrt written as 1/sqrt, reciprocal
         or division)                                       -> `carve.rms_norm`
      5. `softmax(s) @ v` with `s = (q @ k^T) * c` (or `/ c`), optionally masked
         by `where(causal_const, -inf, s)` or `s + mask`    -> `carve.attention`

    Before: any carve IR. After: the same computation with the chains replaced;
    ops left without users are erased (the pass runs canonicalization-style
    dead-code removal on the function). Chains that do not match exactly are
    left alone, never approximated.
  }];
  let dependentDialects = ["carve::CarveDialect"];
  let statistics = [
    Statistic<"numRaised", "num-raised", "Number of op chains replaced">
  ];
}

def CarveLowerConvolutions : Pass<"carve-lower-convolutions", "mlir::func::FuncOp"> {
  let summary = "Convolution and max pooling as gathers, matmuls and reductions (im2col); batch norm";
  let description = [{
    Rewrites every `carve.conv2d` and `carve.max_pool2d` into ops that autodiff,
    the partitioner and both targets already handle (LowerConvolutions.cpp):
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

    Runs first in `carve compile`, and in `carve plan`'s profile (so that the
    planner prices the ops that run). Before: any carve IR. After: no conv2d,
    max_pool2d or batch_norm.
  }];
  let options = [
    Option<"planning", "planning", "bool", /*default=*/"false",
           "The planner's one-sample import: batch norm over one value per channel "
           "is lowered to be priced, not refused">
  ];
  let dependentDialects = ["carve::CarveDialect"];
  let statistics = [
    Statistic<"numLowered", "num-lowered", "Number of convolutions and poolings lowered">
  ];
}

#endif // CARVE_FRONTEND_PASSES_TD
