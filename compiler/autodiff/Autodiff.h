//===- Autodiff.h - the training step from the forward function ----------===//
//
// Reverse-mode differentiation of the imported `@forward` function: builds
// `@train_step`, which returns the loss and the gradient of every trainable
// parameter that reaches it. The gradient of each op comes from its
// DifferentiableOpInterface rule (dialects/carve/Gradients.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_AUTODIFF_AUTODIFF_H
#define CARVE_COMPILER_AUTODIFF_AUTODIFF_H

#include "dialects/carve/Contract.h"
#include "dialects/carve/CarveDialect.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <memory>
#include <optional>
#include <string>

namespace carve {

struct AutodiffOptions {
  /// The function to differentiate.
  std::string function = "forward";
  /// The output that is the loss (its `carve.output` name); empty: the only
  /// output.
  std::string loss;
  /// The name of the function to build.
  std::string result = "train_step";
};

/// Builds the training step next to the forward function.
///
/// `@train_step` has the forward function's arguments plus a last argument
/// `carve.loss_seed` (the gradient fed into the loss: 1, or 1/dp for a
/// data-parallel mean). It returns the loss (`carve.output`) and then one
/// gradient per trainable parameter that reaches the loss, in argument order
/// (`carve.grad_of` = the parameter's name). The function carries
/// `carve.loss_reduction` ("mean", "sum" or "unknown": how the loss reduces
/// over the batch) and `carve.unused_params` (trainable parameters that do
/// not reach the loss; PyTorch leaves their .grad None and the optimizer
/// skips them).
///
/// On failure returns false with one line in `error` (naming the op and its
/// node where there is one).
/// `errorLoc`, when given, receives the location of the op at fault.
bool buildTrainingStep(mlir::ModuleOp module, const AutodiffOptions &opts, std::string &error,
                       std::optional<mlir::Location> *errorLoc = nullptr);

#define GEN_PASS_DECL
#include "compiler/autodiff/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/autodiff/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_AUTODIFF_AUTODIFF_H
