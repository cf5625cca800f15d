//===- OptimizerOps.cpp - verifiers of the step's tail ops ----------------===//
//
// The rules PyTorch's optimizers and clip_grad_norm_ hold their arguments
// to, and the shape of the tail's references: gradients named by their
// carve.gradients slot, parameters that are arguments of the function.
//
//===----------------------------------------------------------------------===//

#include "dialects/carve/CarveOps.h"

#include "llvm/ADT/DenseSet.h"

#include <cmath>
#include <string>

using namespace mlir;

namespace carve {

namespace {

LogicalResult verifySlots(Operation *op, ArrayRef<int64_t> slots) {
  if (slots.size() != op->getNumOperands() - (isa<ScaleGradientsOp>(op) ? 1 : 0))
    return op->emitOpError("lists ")
           << slots.size() << " slots for "
           << op->getNumOperands() - (isa<ScaleGradientsOp>(op) ? 1 : 0) << " gradients";
  llvm::DenseSet<int64_t> seen;
  for (int64_t s : slots) {
    if (s < 0)
      return op->emitOpError("slot ") << s << " is negative";
    if (!seen.insert(s).second)
      return op->emitOpError("lists slot ") << s << " twice";
  }
  return success();
}

/// A parameter the update writes must be the function's own argument; its
/// gradient has its shape, in f32 or, for a 16-bit parameter (the copy of an
/// fp32 master, carve-store-params16), in f32 or its format
/// (carve-store-grads16).
LogicalResult verifyParameter(Operation *op, Value param, Value grad) {
  if (!isa<BlockArgument>(param))
    return op->emitOpError("updates a value that is not an argument of the function");
  auto p = cast<RankedTensorType>(param.getType());
  if (grad && grad.getType() != p.clone(Float32Type::get(op->getContext())) &&
      (p.getElementType().isF32() || grad.getType() != p))
    return op->emitOpError("gradient type ")
           << grad.getType() << " is neither f32 nor the format of the parameter's "
           << param.getType();
  return success();
}

LogicalResult inRange(Operation *op, StringRef what, double x, double lo, double hi, bool hiOpen) {
  if (!std::isfinite(x) || x < lo || x > hi || (hiOpen && x == hi))
    return op->emitOpError(what) << " = " << shortestNumber(x) << " must be in ["
                                 << shortestNumber(lo) << ", " << shortestNumber(hi)
                                 << (hiOpen ? ")" : "]");
  return success();
}

} // namespace

LogicalResult UnscaleGradientsOp::verify() { return verifySlots(*this, getSlots()); }

LogicalResult GradNormOp::verify() {
  if (failed(verifySlots(*this, getSlots())))
    return failure();
  if (getTpSplit().size() != getGradients().size())
    return emitOpError("tp_split has ")
           << getTpSplit().size() << " entries for " << getGradients().size() << " gradients";
  return success();
}

LogicalResult ClipCoefficientOp::verify() {
  double m = getMaxNorm().convertToDouble();
  if (!std::isfinite(m) || !(m >= 0))
    return emitOpError("max_norm must be 0 (no clipping) or positive, got ") << shortestNumber(m);
  return success();
}

LogicalResult ScaleGradientsOp::verify() { return verifySlots(*this, getSlots()); }

LogicalResult LearningRateOp::verify() {
  double lr = getLr().convertToDouble();
  if (!std::isfinite(lr) || !(lr > 0))
    return emitOpError("lr must be positive, got ") << shortestNumber(lr);
  if (getWarmupSteps() < 0 || getDecaySteps() < 0)
    return emitOpError("warmup_steps and decay_steps must not be negative");
  return inRange(*this, "min_lr_ratio", getMinLrRatio().convertToDouble(), 0, 1, false);
}

LogicalResult AdamWOp::verify() {
  if (failed(verifyParameter(*this, getParam(), getGrad())) ||
      failed(inRange(*this, "beta1", getBeta1().convertToDouble(), 0, 1, true)) ||
      failed(inRange(*this, "beta2", getBeta2().convertToDouble(), 0, 1, true)) ||
      failed(
          inRange(*this, "weight_decay", getWeightDecay().convertToDouble(), 0, INFINITY, false)))
    return failure();
  double eps = getEps().convertToDouble();
  if (!std::isfinite(eps) || !(eps > 0))
    return emitOpError("eps must be positive, got ") << shortestNumber(eps);
  return success();
}

LogicalResult SGDOp::verify() {
  if (failed(verifyParameter(*this, getParam(), getGrad())) ||
      failed(inRange(*this, "momentum", getMomentum().convertToDouble(), 0, INFINITY, false)) ||
      failed(inRange(*this, "dampening", getDampening().convertToDouble(), 0, INFINITY, false)) ||
      failed(
          inRange(*this, "weight_decay", getWeightDecay().convertToDouble(), 0, INFINITY, false)))
    return failure();
  if (getNesterov() &&
      (getMomentum().convertToDouble() <= 0 || getDampening().convertToDouble() != 0))
    return emitOpError("Nesterov momentum requires a momentum and zero dampening (as in PyTorch)");
  return success();
}

LogicalResult ZeroGatherOp::verify() {
  llvm::DenseSet<Value> seen;
  for (Value p : getParams()) {
    if (failed(verifyParameter(*this, p, Value())))
      return failure();
    if (!seen.insert(p).second)
      return emitOpError("gathers argument ") << cast<BlockArgument>(p).getArgNumber() << " twice";
  }
  return success();
}

} // namespace carve
