//===- Passes.td - the optimizer update --------------------*- tablegen -*-===//

#ifndef CARVE_OPTIMIZER_PASSES_TD
#define CARVE_OPTIMIZER_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveOptimizer : Pass<"carve-optimizer", "mlir::ModuleOp"> {
  let summary = "Append the optimizer step: unscaling, the gradient norm, clipping, the updates, ZeRO's gathers";
  let description = [{
    Ends each function the emitter prints (`@train_step`, or `@stage0 ..`)
    with the step's tail as ops (dialects/carve/CarveOptimizerOps.td), after
    backward and before the return, in this order:

      1. `carve.unscale_gradients` (carve.plan precision = fp16 only): every
         gradient divided by the dynamic loss scale.
      2. `%norm = carve.grad_norm`: the whole model's gradient norm; this
         function lists every gradient it owns (a gradient several pipeline
         stages share is listed on the first of them), each marked
         `tp_split` when its parameter is split over tp.
      3. `%clip = carve.clip_coefficient %norm` and
         `carve.scale_gradients %clip, ...` (`clip-grad-norm` > 0 only).
      4. `%lr = carve.learning_rate`: the scheduled rate.
      5. One `carve.adamw` or `carve.sgd` per gradient, in carve.gradients'
         order, updating its parameter (ZeRO: this rank's chunk).
      6. `carve.zero_gather` of every chunked parameter (ZeRO-1 and 2).

    Gradients are the values the function returns, each tagged in `slots`
    with its index in carve.gradients; the updates work on the persistent
    tensors carve-plan-memory laid out (gradient slots or ZeRO chunks,
    optimizer state). The options are the optimizer's hyperparameters, as
    `carve compile` resolves them from the plan's "optimizer" object and its
    flags (docs/training.md); `weight-decay` < 0 takes the optimizer's
    default (AdamW 0.01, SGD 0). The state tensors the updates keep must be
    the number carve.plan's `optimizer_state` laid out.

    Before: after carve-plan-memory (carve.gradients, carve.zero_chunk and
    carve.persistent_plan present), with no tail yet. After: the tail ops
    above; nothing else changes. The emitter prints them as the step's
    tail; a pipeline rank sums its stages' norm contributions once.

    Errors: a function without carve.gradients, a tail already present, an
    optimizer whose state count differs from carve.plan's, and
    hyperparameters the ops' verifiers refuse.
  }];
  let options = [
    Option<"kind", "kind", "std::string", /*default=*/"\"adamw\"", "adamw or sgd">,
    Option<"lr", "lr", "double", /*default=*/"1e-3", "Learning rate (peak, under a schedule)">,
    Option<"beta1", "beta1", "double", /*default=*/"0.9", "AdamW beta1">,
    Option<"beta2", "beta2", "double", /*default=*/"0.999", "AdamW beta2">,
    Option<"eps", "eps", "double", /*default=*/"1e-8", "AdamW eps">,
    Option<"weightDecay", "weight-decay", "double", /*default=*/"-1",
           "Weight decay (< 0: AdamW 0.01, SGD 0)">,
    Option<"momentum", "momentum", "double", /*default=*/"0", "SGD momentum">,
    Option<"dampening", "dampening", "double", /*default=*/"0", "SGD dampening">,
    Option<"nesterov", "nesterov", "bool", /*default=*/"false", "SGD Nesterov momentum">,
    Option<"clipGradNorm", "clip-grad-norm", "double", /*default=*/"0",
           "Clip the gradient norm to this (0: no clipping)">,
    Option<"warmupSteps", "warmup-steps", "int64_t", /*default=*/"0", "Linear warmup steps">,
    Option<"decaySteps", "decay-steps", "int64_t", /*default=*/"0", "Cosine decay steps">,
    Option<"minLrRatio", "min-lr-ratio", "double", /*default=*/"0",
           "Learning rate at the end of the decay, as a fraction of lr">
  ];
  let statistics = [
    Statistic<"numUpdates", "num-updates", "Parameter updates appended">
  ];
}

#endif // CARVE_OPTIMIZER_PASSES_TD
