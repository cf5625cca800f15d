//===- Optimizer.h - the optimizer update as ops on the IR ----------------===//
//
// OptimizerConfig is what the user chose (plan and flags). carve-optimizer
// (Optimizer.cpp; its rules are in Passes.td) appends the step's tail as ops
// to each emitted function; the emitter reads them back with readTail and
// readOptimizer below and prints what they say.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_OPTIMIZER_OPTIMIZER_H
#define CARVE_COMPILER_OPTIMIZER_OPTIMIZER_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace carve {

/// The optimizer and its schedule: PyTorch's defaults unless set.
struct OptimizerConfig {
  std::string kind = "adamw"; // "adamw" or "sgd"
  double lr = 1e-3;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
  double weightDecay = -1; // -1: the optimizer's default (AdamW 0.01, SGD 0)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double clipGradNorm = 0; // 0: no clipping
  int64_t warmupSteps = 0, decaySteps = 0;
  double minLrRatio = 0;

  double effectiveWeightDecay() const {
    return weightDecay >= 0 ? weightDecay : (kind == "adamw" ? 0.01 : 0.0);
  }
  /// Tensors of state per parameter: AdamW 2, SGD with momentum 1, SGD 0
  /// (carve.plan's optimizer_state).
  int stateTensors() const { return kind == "adamw" ? 2 : momentum != 0 ? 1 : 0; }
  /// One line, e.g. "AdamW(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01)".
  std::string describe() const;
};

/// carve-optimizer with `config`'s hyperparameters.
std::unique_ptr<mlir::Pass> createCarveOptimizer(const OptimizerConfig &config);

/// True for the ops carve-optimizer appends (the step's tail).
bool isOptimizerOp(mlir::Operation *op);

/// One function's tail as the emitter needs it. Gradients are named by
/// their index in the function's carve.gradients, parameters by argument.
struct OptimizerTail {
  bool unscale = false;           // carve.unscale_gradients present
  bool clip = false;              // carve.clip_coefficient present (every tail has one)
  std::vector<int64_t> unscaled;  // its slots
  std::vector<int64_t> normSlots; // carve.grad_norm's gradients
  std::vector<bool> normSplit;    // ... and whether each is split over tp
  double maxNorm = 0;             // carve.clip_coefficient's default (0: no clipping)
  std::vector<int64_t> clipped;   // carve.scale_gradients' slots
  std::vector<int64_t> updated;   // the slot of each update, in order
  std::vector<unsigned> gathered; // carve.zero_gather's parameters
};

/// Reads `fn`'s tail and checks it against carve.gradients: each operand is
/// the gradient its slot returns, each slot updated once, each update's
/// parameter the slot's. False with `error` when it is missing or broken.
bool readTail(mlir::func::FuncOp fn, OptimizerTail &tail, std::string &error);

/// The optimizer the module's tail ops say (the learning rate, the updates'
/// kind and hyperparameters, clipping); every update must agree. False with
/// `error` when there is no tail or two updates disagree.
bool readOptimizer(mlir::ModuleOp module, OptimizerConfig &config, std::string &error);

#define GEN_PASS_DECL
#include "compiler/optimizer/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/optimizer/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_OPTIMIZER_OPTIMIZER_H
