//===- CarveOptimizerOps.td - the step's tail: norm, clipping, updates ----===//
//
// The ops carve-optimizer appends to each emitted function after backward.
// Unlike the tensor ops they update the rank's persistent tensors in place
// (the parameters, their gradient slots and optimizer state laid out by
// carve-plan-memory), so they have side effects and stay in program order.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_OPTIMIZER_OPS_TD
#define CARVE_OPTIMIZER_OPS_TD

class Carve_TailOp<string mnemonic, list<Trait> traits = []>
    : Op<Carve_Dialect, mnemonic, traits> {
  let hasVerifier = 1;
}

// A parameter the optimizer updates: f32, or under a bf16/fp16 plan the
// 16-bit copy of an fp32 master (carve.master, carve-store-params16).
def Carve_ParamTensor : RankedTensorOf<[F32, BF16, F16]>;
// A gradient: f32, or 16-bit (carve-store-grads16).
def Carve_GradTensor : RankedTensorOf<[F32, BF16, F16]>;

def Carve_UnscaleGradientsOp
    : Carve_TailOp<"unscale_gradients", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "fp16: divide the gradients by the step's dynamic loss scale, in place.";
  let description = [{
    Under `precision = fp16` the loss seed carries the dynamic loss scale
    (the runtime adjusts it); this divides it out of each listed gradient's
    slot (ZeRO >= 2: this rank's chunk) before the norm and the update.
    `slots`: each operand's index in the function's `carve.gradients`.

    ```mlir
    carve.unscale_gradients %g0, %g1 {slots = array<i64: 0, 1>} : tensor<64x32xf32>, tensor<32xf32>
    ```
  }];
  let arguments = (ins Variadic<Carve_GradTensor>:$gradients, DenseI64ArrayAttr:$slots);
  let assemblyFormat = "$gradients attr-dict `:` type($gradients)";
}

def Carve_GradNormOp : Carve_TailOp<"grad_norm", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "The L2 norm of all the step's gradients, over every rank (a collective).";
  let description = [{
    The norm of the whole model's gradient, as
    `torch.nn.utils.clip_grad_norm_` computes it. Each function contributes
    the squares of this rank's elements of the gradients it lists (ZeRO >= 2:
    this rank's chunk); a gradient split over tp (`tp_split`) is summed over
    tp, a replicated one counted once; the sums then add over dp (ZeRO >= 2)
    and over the pipeline stages. A gradient several stages share (a tied
    embedding) is listed on its first stage only. Every rank gets the same
    value; the runtime's NaN guard (`train --on-nan`) may skip the rest of
    the tail when it is not finite.

    ```mlir
    %norm = carve.grad_norm %g0, %g1 {slots = array<i64: 0, 1>, tp_split = array<i1: true, false>}
              : (tensor<32x32xf32>, tensor<32xf32>) -> f64
    ```
  }];
  let arguments = (ins Variadic<Carve_GradTensor>:$gradients, DenseI64ArrayAttr:$slots,
                       DenseBoolArrayAttr:$tp_split);
  let results = (outs F64:$norm);
  let assemblyFormat = "$gradients attr-dict `:` functional-type($gradients, $norm)";
}

def Carve_ClipCoefficientOp : Carve_TailOp<"clip_coefficient", [Pure]> {
  let summary = "min(1, max_norm / (norm + 1e-6)): clip_grad_norm_'s scale.";
  let description = [{
    Every step's tail has one: `max_norm` is the compiled default, 0 for no
    clipping (coefficient 1); a run's `train --clip` replaces it
    (docs/training.md#hyperparameters).

    ```mlir
    %clip = carve.clip_coefficient %norm {max_norm = 1.000000e+00 : f64}
    ```
  }];
  let arguments = (ins F64:$norm, F64Attr:$max_norm);
  let results = (outs F32:$coefficient);
  let assemblyFormat = "$norm attr-dict";
}

def Carve_ScaleGradientsOp
    : Carve_TailOp<"scale_gradients", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "Multiply the gradients by a scalar in place (clipping).";
  let description = [{
    Each listed gradient's slot (ZeRO >= 2: this rank's chunk) times
    `scale`. `slots`: each operand's index in `carve.gradients`.

    ```mlir
    carve.scale_gradients %clip, %g0, %g1 {slots = array<i64: 0, 1>} : tensor<64x32xf32>, tensor<32xf32>
    ```
  }];
  let arguments = (ins F32:$scale, Variadic<Carve_GradTensor>:$gradients,
                       DenseI64ArrayAttr:$slots);
  let assemblyFormat = "$scale `,` $gradients attr-dict `:` type($gradients)";
}

def Carve_LearningRateOp : Carve_TailOp<"learning_rate", [MemoryEffects<[MemRead]>]> {
  let summary = "The scheduled learning rate of the step being taken.";
  let description = [{
    `lr` after a linear warmup over `warmup_steps` and a cosine decay over
    `decay_steps` to `min_lr_ratio` x `lr` (0 steps: no warmup, no decay).
    It reads the runtime's step counter.

    ```mlir
    %lr = carve.learning_rate {decay_steps = 0 : i64, lr = 1.000000e-03 : f64,
                               min_lr_ratio = 0.000000e+00 : f64, warmup_steps = 0 : i64}
    ```
  }];
  let arguments = (ins F64Attr:$lr, I64Attr:$warmup_steps, I64Attr:$decay_steps,
                       F64Attr:$min_lr_ratio);
  let results = (outs F64:$rate);
  let assemblyFormat = "attr-dict";
}

def Carve_AdamWOp : Carve_TailOp<"adamw", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "torch.optim.AdamW's update of one parameter, in place.";
  let description = [{
    Updates `param` from its gradient slot and its two state tensors
    (exp_avg, exp_avg_sq: carve.persistent_plan's `states`) at learning
    rate `lr`, with bias correction at the runtime's step + 1. Under ZeRO
    (carve.zero_chunk on the parameter) only this rank's chunk. `param` is
    an argument of the function; `grad` is its gradient as the function
    returns it. A 16-bit `param` (carve.master) is the copy of an fp32
    master: the update reads and writes the master (carve.persistent_plan's
    `masters`), then rounds it into the copy.

    ```mlir
    carve.adamw %arg2, %g0, %lr {beta1 = 9.000000e-01 : f64, beta2 = 9.990000e-01 : f64,
                                 eps = 1.000000e-08 : f64, weight_decay = 0.01 : f64}
      : tensor<64x32xf32>, tensor<64x32xf32>
    ```
  }];
  let arguments = (ins Carve_ParamTensor:$param, Carve_GradTensor:$grad, F64:$lr, F64Attr:$beta1,
                       F64Attr:$beta2, F64Attr:$eps, F64Attr:$weight_decay);
  let assemblyFormat = "$param `,` $grad `,` $lr attr-dict `:` type($param) `,` type($grad)";
}

def Carve_SGDOp : Carve_TailOp<"sgd", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "torch.optim.SGD's update of one parameter, in place.";
  let description = [{
    As torch.optim.SGD: weight decay, then (momentum != 0) the momentum
    buffer (carve.persistent_plan's first state tensor; the first step
    copies the gradient into it), dampening and Nesterov. Under ZeRO only
    this rank's chunk. A 16-bit `param` is updated through its master, as
    carve.adamw's.

    ```mlir
    carve.sgd %arg2, %g0, %lr {dampening = 0.0 : f64, momentum = 0.9 : f64, nesterov = false,
                               weight_decay = 0.0 : f64} : tensor<64x32xf32>, tensor<64x32xf32>
    ```
  }];
  let arguments = (ins Carve_ParamTensor:$param, Carve_GradTensor:$grad, F64:$lr, F64Attr:$momentum,
                       F64Attr:$dampening, F64Attr:$weight_decay, BoolAttr:$nesterov);
  let assemblyFormat = "$param `,` $grad `,` $lr attr-dict `:` type($param) `,` type($grad)";
}

def Carve_ZeroGatherOp : Carve_TailOp<"zero_gather", [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "ZeRO-1 and 2: all-gather each updated parameter's chunks over dp, in place.";
  let description = [{
    Every dp rank updated its chunk (carve.zero_chunk elements) of each
    listed parameter; afterwards every rank holds the whole updated
    parameter. The parameters are arguments of the function; 16-bit copies
    (carve.master) are gathered in 16 bits.

    ```mlir
    carve.zero_gather %arg2, %arg3 : tensor<64x32xf32>, tensor<16x32xf32>
    ```
  }];
  let arguments = (ins Variadic<Carve_ParamTensor>:$params);
  let assemblyFormat = "$params attr-dict `:` type($params)";
}

#endif // CARVE_OPTIMIZER_OPS_TD
