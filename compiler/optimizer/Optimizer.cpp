//===- Optimizer.cpp - carve-optimizer: the step's tail as ops ------------===//
//
// Appends unscaling, the gradient norm, clipping, the learning rate, one
// update per gradient and ZeRO's gathers to each emitted function
// (Passes.td states the order and the rules), and reads them back for the
// emitter.
//
//===----------------------------------------------------------------------===//

#include "compiler/optimizer/Optimizer.h"

#include "compiler/dataparallel/DataParallel.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/Verifier.h"

#include <map>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEOPTIMIZER
#include "compiler/optimizer/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {
/// A number as Python prints it in a repr.
struct PyNum {
  double x;
};
llvm::raw_ostream &operator<<(llvm::raw_ostream &os, PyNum n) { return os << shortestNumber(n.x); }
} // namespace

std::string OptimizerConfig::describe() const {
  std::string s;
  llvm::raw_string_ostream os(s);
  double wd = effectiveWeightDecay();
  if (kind == "adamw")
    os << "AdamW(lr=" << PyNum{lr} << ", betas=(" << PyNum{beta1} << ", " << PyNum{beta2}
       << "), eps=" << PyNum{eps} << ", weight_decay=" << PyNum{wd} << ")";
  else
    os << "SGD(lr=" << PyNum{lr} << ", momentum=" << PyNum{momentum}
       << ", dampening=" << PyNum{dampening} << ", weight_decay=" << PyNum{wd}
       << ", nesterov=" << (nesterov ? "True" : "False") << ")";
  if (clipGradNorm > 0)
    os << ", clip_grad_norm=" << PyNum{clipGradNorm};
  if (warmupSteps > 0 || decaySteps > 0)
    os << ", schedule: warmup " << warmupSteps << " steps, cosine decay over " << decaySteps
       << " steps to " << PyNum{minLrRatio} << " x lr";
  return s;
}

bool isOptimizerOp(Operation *op) {
  return isa<UnscaleGradientsOp, GradNormOp, ClipCoefficientOp, ScaleGradientsOp, LearningRateOp,
             AdamWOp, SGDOp, ZeroGatherOp>(op);
}

namespace {

bool tpSplitArg(func::FuncOp fn, unsigned arg) {
  auto d = fn.getArgAttrOfType<DictionaryAttr>(arg, kLayoutAttr);
  auto l = d ? d.getAs<dist::SbpAttr>("tp") : dist::SbpAttr();
  return l && l.isSplit();
}

struct OptimizerPass : carve::impl::CarveOptimizerBase<OptimizerPass> {
  using CarveOptimizerBase::CarveOptimizerBase;

  OptimizerConfig config() const {
    OptimizerConfig c;
    c.kind = kind;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.weightDecay = weightDecay;
    c.momentum = momentum;
    c.dampening = dampening;
    c.nesterov = nesterov;
    c.clipGradNorm = clipGradNorm;
    c.warmupSteps = warmupSteps;
    c.decaySteps = decaySteps;
    c.minLrRatio = minLrRatio;
    return c;
  }

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    const OptimizerConfig c = config();
    if (c.kind != "adamw" && c.kind != "sgd") {
      module.emitError() << "carve-optimizer: unknown optimizer '" << c.kind
                         << "' (known: adamw, sgd)";
      return signalPassFailure();
    }
    if (c.stateTensors() != plan->optimizerState) {
      module.emitError() << "carve-optimizer: " << c.describe() << " keeps " << c.stateTensors()
                         << " state tensor(s) per parameter; carve.plan's optimizer_state laid "
                            "out "
                         << plan->optimizerState;
      return signalPassFailure();
    }
    // A gradient several stages share counts in the norm on its first stage.
    std::map<std::string, int> owner;
    for (const SharedGradient &sh : sharedGradients(module))
      owner[sh.name] = sh.owner;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      if (failed(append(fn, *plan, c, owner)))
        return signalPassFailure();
    }
  }

  LogicalResult append(func::FuncOp fn, const PlanAttrs &plan, const OptimizerConfig &c,
                       const std::map<std::string, int> &owner) {
    Block &block = fn.getBody().front();
    for (Operation &op : block)
      if (isOptimizerOp(&op))
        return op.emitError("carve-optimizer: @")
               << fn.getSymName() << " already ends with an optimizer update ('" << op.getName()
               << "')";
    std::vector<GradientSlot> slots;
    std::string error;
    if (!readGradients(fn, slots, error))
      return fn.emitError("carve-optimizer: ") << error;
    Operation *ret = block.getTerminator();
    OpBuilder b(ret);
    Location loc = NameLoc::get(b.getStringAttr("optimizer step"), ret->getLoc());
    auto stageAttr = fn->getAttrOfType<IntegerAttr>(kStageAttr);
    SmallVector<Value> grads;
    SmallVector<int64_t> all, counted;
    SmallVector<bool> split;
    SmallVector<Value> countedGrads;
    for (size_t i = 0; i < slots.size(); ++i) {
      Value g = ret->getOperand(slots[i].result);
      grads.push_back(g);
      all.push_back((int64_t)i);
      if (stageAttr && fn.getResultAttr(slots[i].result, kSharedGradAttr)) {
        auto it = owner.find(paramNameOf(fn, slots[i].param).getValue().str());
        if (it != owner.end() && it->second != stageAttr.getInt())
          continue;
      }
      counted.push_back((int64_t)i);
      countedGrads.push_back(g);
      split.push_back(tpSplitArg(fn, slots[i].param));
    }
    if (plan.precision == "fp16" && !grads.empty())
      UnscaleGradientsOp::create(b, loc, grads, b.getDenseI64ArrayAttr(all));
    Value norm =
        GradNormOp::create(b, loc, b.getF64Type(), countedGrads, b.getDenseI64ArrayAttr(counted),
                           b.getDenseBoolArrayAttr(split));
    // Always: max_norm 0 clips nothing unless the run asks (train --clip).
    Value clip = ClipCoefficientOp::create(b, loc, b.getF32Type(), norm,
                                           b.getF64FloatAttr(std::max(0.0, c.clipGradNorm)));
    if (!grads.empty())
      ScaleGradientsOp::create(b, loc, clip, grads, b.getDenseI64ArrayAttr(all));
    Value lr = LearningRateOp::create(
        b, loc, b.getF64Type(), b.getF64FloatAttr(c.lr), b.getI64IntegerAttr(c.warmupSteps),
        b.getI64IntegerAttr(c.decaySteps), b.getF64FloatAttr(c.minLrRatio));
    const double wd = c.effectiveWeightDecay();
    SmallVector<Value> chunked;
    for (size_t i = 0; i < slots.size(); ++i) {
      Value p = fn.getArgument(slots[i].param);
      Operation *u;
      if (c.kind == "adamw")
        u = AdamWOp::create(b, loc, p, grads[i], lr, b.getF64FloatAttr(c.beta1),
                            b.getF64FloatAttr(c.beta2), b.getF64FloatAttr(c.eps),
                            b.getF64FloatAttr(wd));
      else
        u = SGDOp::create(b, loc, p, grads[i], lr, b.getF64FloatAttr(c.momentum),
                          b.getF64FloatAttr(c.dampening), b.getF64FloatAttr(wd),
                          b.getBoolAttr(c.nesterov));
      if (failed(mlir::verify(u)))
        return failure();
      ++numUpdates;
      if ((plan.zero == 1 || plan.zero == 2) && zeroChunkOf(fn, slots[i].param) > 0)
        chunked.push_back(p);
    }
    if (!chunked.empty())
      ZeroGatherOp::create(b, loc, chunked);
    return success();
  }
};

} // namespace

std::unique_ptr<Pass> createCarveOptimizer(const OptimizerConfig &c) {
  CarveOptimizerOptions o;
  o.kind = c.kind;
  o.lr = c.lr;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.weightDecay = c.weightDecay;
  o.momentum = c.momentum;
  o.dampening = c.dampening;
  o.nesterov = c.nesterov;
  o.clipGradNorm = c.clipGradNorm;
  o.warmupSteps = c.warmupSteps;
  o.decaySteps = c.decaySteps;
  o.minLrRatio = c.minLrRatio;
  return createCarveOptimizer(o);
}

namespace {
/// Slot list `slots` of `op`: in range, and operand k (from `first`) the
/// gradient slot slots[k] returns.
bool checkSlots(Operation *op, ArrayRef<int64_t> slots, unsigned first,
                const std::vector<GradientSlot> &order, Operation *ret, std::string &error) {
  for (size_t k = 0; k < slots.size(); ++k) {
    if (slots[k] >= (int64_t)order.size() ||
        op->getOperand(first + k) != ret->getOperand(order[slots[k]].result)) {
      error = "'" + op->getName().getStringRef().str() + "' operand " + std::to_string(first + k) +
              " is not the gradient of slot " + std::to_string(slots[k]) + " of carve.gradients";
      return false;
    }
  }
  return true;
}
} // namespace

bool readTail(func::FuncOp fn, OptimizerTail &tail, std::string &error) {
  tail = OptimizerTail();
  std::vector<GradientSlot> order;
  if (!readGradients(fn, order, error))
    return false;
  Block &block = fn.getBody().front();
  Operation *ret = block.getTerminator();
  const std::string where = "@" + fn.getSymName().str() + ": ";
  bool norm = false, lr = false;
  std::vector<int> updates(order.size(), 0);
  for (Operation &op : block) {
    if (auto u = dyn_cast<UnscaleGradientsOp>(op)) {
      tail.unscale = true;
      tail.unscaled.assign(u.getSlots().begin(), u.getSlots().end());
      if (!checkSlots(u, u.getSlots(), 0, order, ret, error))
        return error = where + error, false;
    } else if (auto n = dyn_cast<GradNormOp>(op)) {
      norm = true;
      tail.normSlots.assign(n.getSlots().begin(), n.getSlots().end());
      tail.normSplit.assign(n.getTpSplit().begin(), n.getTpSplit().end());
      if (!checkSlots(n, n.getSlots(), 0, order, ret, error))
        return error = where + error, false;
    } else if (auto c = dyn_cast<ClipCoefficientOp>(op)) {
      tail.clip = true;
      tail.maxNorm = c.getMaxNorm().convertToDouble();
    } else if (auto s = dyn_cast<ScaleGradientsOp>(op)) {
      tail.clipped.assign(s.getSlots().begin(), s.getSlots().end());
      if (!checkSlots(s, s.getSlots(), 1, order, ret, error))
        return error = where + error, false;
    } else if (isa<LearningRateOp>(op)) {
      lr = true;
    } else if (isa<AdamWOp, SGDOp>(op)) {
      Value p = op.getOperand(0), g = op.getOperand(1);
      auto arg = cast<BlockArgument>(p);
      int64_t slot = -1;
      for (size_t i = 0; i < order.size(); ++i)
        if (order[i].param == arg.getArgNumber())
          slot = (int64_t)i;
      if (slot < 0 || g != ret->getOperand(order[slot].result))
        return error = where + "'" + op.getName().getStringRef().str() + "' updates argument " +
                       std::to_string(arg.getArgNumber()) +
                       " with a value that is not its gradient in carve.gradients",
               false;
      ++updates[slot];
      tail.updated.push_back(slot);
    } else if (auto z = dyn_cast<ZeroGatherOp>(op)) {
      for (Value p : z.getParams())
        tail.gathered.push_back(cast<BlockArgument>(p).getArgNumber());
    }
  }
  if (!norm || !lr)
    return error = where + "no optimizer update (carve.grad_norm and carve.learning_rate; run "
                           "carve-optimizer)",
           false;
  for (size_t i = 0; i < order.size(); ++i)
    if (updates[i] != 1)
      return error = where + "the parameter of gradient slot " + std::to_string(i) + " has " +
                     std::to_string(updates[i]) + " updates; it needs one",
             false;
  return true;
}

bool readOptimizer(ModuleOp module, OptimizerConfig &config, std::string &error) {
  config = OptimizerConfig();
  bool haveLr = false, haveUpdate = false;
  bool ok = true;
  module.walk([&](Operation *op) {
    if (!ok || !isa<LearningRateOp, ClipCoefficientOp, AdamWOp, SGDOp>(op))
      return; // (the copy below only for the ops that set the configuration)
    OptimizerConfig c = config;
    if (auto l = dyn_cast<LearningRateOp>(op)) {
      c.lr = l.getLr().convertToDouble();
      c.warmupSteps = l.getWarmupSteps();
      c.decaySteps = l.getDecaySteps();
      c.minLrRatio = l.getMinLrRatio().convertToDouble();
      if (haveLr && (c.lr != config.lr || c.warmupSteps != config.warmupSteps ||
                     c.decaySteps != config.decaySteps || c.minLrRatio != config.minLrRatio))
        ok = false;
      haveLr = true;
    } else if (auto cl = dyn_cast<ClipCoefficientOp>(op)) {
      double m = cl.getMaxNorm().convertToDouble();
      if (config.clipGradNorm != 0 && config.clipGradNorm != m)
        ok = false;
      c.clipGradNorm = m;
    } else if (auto a = dyn_cast<AdamWOp>(op)) {
      c.kind = "adamw";
      c.beta1 = a.getBeta1().convertToDouble();
      c.beta2 = a.getBeta2().convertToDouble();
      c.eps = a.getEps().convertToDouble();
      c.weightDecay = a.getWeightDecay().convertToDouble();
      if (haveUpdate &&
          (c.kind != config.kind || c.beta1 != config.beta1 || c.beta2 != config.beta2 ||
           c.eps != config.eps || c.weightDecay != config.weightDecay))
        ok = false;
      haveUpdate = true;
    } else if (auto s = dyn_cast<SGDOp>(op)) {
      c.kind = "sgd";
      c.momentum = s.getMomentum().convertToDouble();
      c.dampening = s.getDampening().convertToDouble();
      c.weightDecay = s.getWeightDecay().convertToDouble();
      c.nesterov = s.getNesterov();
      if (haveUpdate && (c.kind != config.kind || c.momentum != config.momentum ||
                         c.dampening != config.dampening || c.weightDecay != config.weightDecay ||
                         c.nesterov != config.nesterov))
        ok = false;
      haveUpdate = true;
    } else {
      return;
    }
    if (!ok) {
      error = "'" + op->getName().getStringRef().str() +
              "' disagrees with the module's other optimizer ops: every function must update "
              "with one optimizer";
      return;
    }
    config = c;
  });
  if (!ok)
    return false;
  if (!haveLr || !haveUpdate) {
    error = "the module has no optimizer update (carve.learning_rate and carve.adamw or "
            "carve.sgd; run carve-optimizer)";
    return false;
  }
  return true;
}

} // namespace carve
