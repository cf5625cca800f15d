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
         (a constant additive mask of 0 on and below the diagonal and -inf or
         at most -1e30 above it, Hugging Face's `finfo.min` mask, is the
         `causal` flag: the same softmax exactly, no mask tensor)
      6. `(x * cos) + (concat(-x[..., d/2:], x[..., :d/2]) * sin)` over the last
         dimension (any operand order; cos and sin depend on no trainable
         value)                                             -> `carve.rotary`

    Before: any carve IR. After: the same computation with the chains replaced;
    ops left without users are erased (the pass runs canonicalization-style
    dead-code removal on the function). Chains that do not match exactly are
    left alone, never approximated.
  }];
  let dependentDialects = ["carve::CarveDialect"];
  let options = [
    Option<"learnedMasks", "learned-masks", "bool", /*default=*/"true",
           "Leave unraised an attention whose additive mask is computed from a "
           "trainable parameter (a learned bias, such as T5's relative position "
           "buckets, needs its gradient, which carve.attention gives no mask). "
           "The importer turns it off where it guessed the parameters (a plain "
           "export without carve.parameters metadata), so that a mask buffer "
           "exported as a parameter is raised and left untrained, as PyTorch "
           "leaves its buffer; a mask gathered from a parameter (a learned "
           "table) is left unraised either way.">
  ];
  let statistics = [
    Statistic<"numRaised", "num-raised", "Number of op chains replaced">
  ];
}

#endif // CARVE_FRONTEND_PASSES_TD
