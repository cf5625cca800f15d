//===- Passes.td - the training step ----------------------*- tablegen -*-===//

#ifndef CARVE_AUTODIFF_PASSES_TD
#define CARVE_AUTODIFF_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveAutodiff : Pass<"carve-autodiff", "mlir::ModuleOp"> {
  let summary = "Build @train_step (the loss and every parameter's gradient) from @forward";
  let description = [{
    Reverse-mode differentiation: each op's gradient comes from its
    DifferentiableOpInterface rule (dialects/carve/Gradients.cpp); backward
    ops are located "backward of NODE".

    Before: the module holds `@forward` as the importer writes it (arguments
    tagged `carve.param` / `carve.trainable` / `carve.buffer` /
    `carve.input`, results `carve.output`), and no `@train_step`.

    After: `@forward` is unchanged and `@train_step` sits beside it. It takes
    the forward function's arguments plus a last argument `carve.loss_seed`
    (the gradient fed into the loss: 1, or 1/dp for a data-parallel mean,
    set at run time) and returns the loss (`carve.output`) and then one
    gradient per trainable parameter that reaches the loss, in argument order,
    each tagged `carve.grad_of = "<parameter>"`. The function carries
    `carve.loss_reduction` ("mean", "sum" or "unknown") and
    `carve.unused_params` (trainable parameters that do not reach the loss).
    Dead forward ops are erased from `@train_step`.

    Errors (one per failure, on the module; a gradient rule's own diagnostic
    comes first): no `@forward`, several outputs and no `loss` option, a loss
    that is no float scalar, an op without a gradient rule on the path from a
    trainable parameter to the loss.
  }];
  let dependentDialects = ["carve::CarveDialect"];
  let options = [
    Option<"function", "function", "std::string", /*default=*/"\"forward\"",
           "The function to differentiate">,
    Option<"loss", "loss", "std::string", /*default=*/"\"\"",
           "The output (its carve.output name) that is the loss; empty: the only output">,
    Option<"result", "result", "std::string", /*default=*/"\"train_step\"",
           "The name of the function to build">,
  ];
}

#endif // CARVE_AUTODIFF_PASSES_TD
