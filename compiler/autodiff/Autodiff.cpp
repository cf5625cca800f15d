//===- Autodiff.cpp - reverse-mode differentiation of @forward -----------===//
//
// 1. Clone @forward into @train_step and add the loss-seed argument.
// 2. Mark the active values: reachable from a trainable float parameter and
//    reaching the loss. Only ops with an active operand and a result gradient
//    are differentiated.
// 3. Walk the ops in reverse, call each op's gradient rule, sum the
//    contributions per value (a weight used twice, like GPT's tied
//    embedding, gets both).
// 4. Return the loss and the parameter gradients; erase what the forward
//    results no longer need.
//
//===----------------------------------------------------------------------===//

#include "compiler/autodiff/Autodiff.h"

#include "dialects/carve/CarveOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "mlir/Pass/PassRegistry.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEAUTODIFF
#include "compiler/autodiff/Passes.h.inc"
} // namespace carve

namespace carve {
namespace {

std::string describe(Operation *op) {
  std::string node = nodeName(op->getLoc());
  std::string s = "'" + op->getName().getStringRef().str() + "'";
  if (!node.empty())
    s += " (node '" + node + "')";
  return s;
}

bool isFloatTensor(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && isa<FloatType>(t.getElementType());
}

/// How the loss reduces over the batch, looking through scalar scaling and
/// reshapes to the reducing op.
std::string lossReduction(Value loss) {
  Value v = loss;
  while (Operation *op = v.getDefiningOp()) {
    if (auto ce = dyn_cast<CrossEntropyOp>(op))
      return ce.getReduction() == "none" ? "unknown" : ce.getReduction().str();
    if (isa<ReduceMeanOp>(op))
      return "mean";
    if (isa<ReduceSumOp>(op))
      return "sum";
    if (isa<ReshapeOp, CastOp, NegOp>(op)) {
      v = op->getOperand(0);
      continue;
    }
    if (isa<MulOp, DivOp>(op)) {
      // Scaling by a constant keeps the kind of reduction.
      Value l = op->getOperand(0), r = op->getOperand(1);
      if (r.getDefiningOp<ConstantOp>()) {
        v = l;
        continue;
      }
      if (isa<MulOp>(op) && l.getDefiningOp<ConstantOp>()) {
        v = r;
        continue;
      }
    }
    if (isa<AddOp, SubOp>(op)) {
      // A sum of terms: of one kind, that kind; a mean plus another term (a
      // mixture of experts' load-balancing loss added to the cross-entropy)
      // is averaged over the replicas, as PyTorch DDP averages gradients.
      std::string l = lossReduction(op->getOperand(0)), r = lossReduction(op->getOperand(1));
      if (l == r)
        return l;
      return l == "mean" || r == "mean" ? "mean" : "unknown";
    }
    break;
  }
  return "unknown";
}

struct Differentiator {
  func::FuncOp fn;
  std::string &error;
  DenseMap<Value, Value> grads;

  /// The op at fault, where there is one (its location names the node).
  std::optional<Location> where;

  bool fail(const std::string &msg) {
    error = msg;
    return false;
  }
  bool fail(Operation *op, const std::string &msg) {
    where = op->getLoc();
    return fail(msg);
  }

  bool accumulate(OpBuilder &b, Location loc, Value v, Value g) {
    if (g.getType() != v.getType())
      return fail("internal error: gradient of type " + mlirString(g.getType()) +
                  " for a value of type " + mlirString(v.getType()));
    auto it = grads.find(v);
    if (it == grads.end()) {
      grads[v] = g;
      return true;
    }
    it->second = AddOp::create(b, loc, v.getType(), it->second, g);
    return true;
  }

  static std::string mlirString(Type t) {
    std::string s;
    llvm::raw_string_ostream os(s);
    t.print(os);
    return s;
  }

  bool run(unsigned lossIndex, Value seed) {
    Block &body = fn.getBody().front();
    auto ret = cast<func::ReturnOp>(body.getTerminator());
    Value loss = ret.getOperand(lossIndex);

    // Active values: forward-reachable from trainable parameters ...
    DenseSet<Value> fromParams;
    for (BlockArgument a : fn.getArguments())
      if (fn.getArgAttr(a.getArgNumber(), kTrainableAttr) && isFloatTensor(a))
        fromParams.insert(a);
    SmallVector<Operation *> ops;
    for (Operation &op : body.without_terminator()) {
      ops.push_back(&op);
      if (llvm::any_of(op.getOperands(), [&](Value v) { return fromParams.count(v); }))
        for (Value r : op.getResults())
          if (isFloatTensor(r))
            fromParams.insert(r);
    }
    // ... and reaching the loss.
    DenseSet<Value> toLoss{loss};
    for (Operation *op : llvm::reverse(ops))
      if (llvm::any_of(op->getResults(), [&](Value r) { return toLoss.count(r); }))
        for (Value o : op->getOperands())
          if (isFloatTensor(o))
            toLoss.insert(o);
    auto active = [&](Value v) { return fromParams.count(v) && toLoss.count(v); };

    OpBuilder b(ret);
    Value seedAsLoss = seed;
    if (seed.getType() != loss.getType())
      seedAsLoss = ReshapeOp::create(b, ret.getLoc(), loss.getType(), seed);
    grads[loss] = seedAsLoss;

    for (Operation *op : llvm::reverse(ops)) {
      SmallVector<Value> rg;
      bool any = false;
      for (Value r : op->getResults()) {
        Value g = grads.lookup(r);
        rg.push_back(g);
        any |= (bool)g;
      }
      if (!any || llvm::none_of(op->getOperands(), active))
        continue;
      auto rule = dyn_cast<DifferentiableOpInterface>(op);
      if (!rule)
        return fail(op, "no gradient rule for " + describe(op) +
                            ", which lies between a trainable parameter and the loss; freeze the "
                            "parameters before it with --frozen");
      std::string node = nodeName(op->getLoc());
      Location gradLoc = NameLoc::get(
          StringAttr::get(fn.getContext(),
                          "backward of " +
                              (node.empty() ? op->getName().getStringRef().str() : node)),
          op->getLoc());
      b.setInsertionPoint(ret);
      Operation *mark = ret->getPrevNode();
      SmallVector<Value> og;
      if (failed(rule.buildGradients(b, rg, og)))
        return fail(op, "the gradient rule of " + describe(op) + " failed");
      for (Operation *o = mark->getNextNode(); o && o != ret.getOperation(); o = o->getNextNode())
        o->setLoc(gradLoc);
      for (unsigned i = 0; i < op->getNumOperands(); ++i) {
        Value x = op->getOperand(i);
        if (!active(x))
          continue;
        if (i >= og.size() || !og[i]) {
          // Fine when the parameters behind it get no gradient at all (a
          // mask kept as a float buffer, exported as a parameter): they are
          // not trained. Checked once every gradient is known.
          gradientless.push_back({op, i});
          continue;
        }
        if (!accumulate(b, gradLoc, x, og[i]))
          return false;
      }
    }
    for (auto [op, i] : gradientless)
      for (BlockArgument a : trainableBehind(op->getOperand(i)))
        if (grads.lookup(a))
          return fail(op, describe(op) + " gives no gradient to operand " + std::to_string(i) +
                              ", which depends on trainable parameter '" + paramName(a) +
                              "', whose other uses need one");
    return true;
  }

  /// Operands a gradient rule gave no gradient to, though they depend on a
  /// trainable parameter.
  SmallVector<std::pair<Operation *, unsigned>> gradientless;

  /// The trainable parameters `v` is computed from.
  SmallVector<BlockArgument> trainableBehind(Value v) {
    SmallVector<BlockArgument> out;
    DenseSet<Value> seen;
    SmallVector<Value> work{v};
    while (!work.empty()) {
      Value x = work.pop_back_val();
      if (!seen.insert(x).second)
        continue;
      if (auto a = dyn_cast<BlockArgument>(x)) {
        if (fn.getArgAttr(a.getArgNumber(), kTrainableAttr))
          out.push_back(a);
        continue;
      }
      for (Value o : x.getDefiningOp()->getOperands())
        work.push_back(o);
    }
    return out;
  }

  std::string paramName(BlockArgument a) {
    auto n = fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), kParamAttr);
    return n ? n.getValue().str() : "#" + std::to_string(a.getArgNumber());
  }
};

/// Erases ops whose results are unused, except those with an effect
/// (carve.assign of a buffer's new value).
void eraseDeadOps(func::FuncOp fn) {
  Block &body = fn.getBody().front();
  SmallVector<Operation *> ops;
  for (Operation &op : body.without_terminator())
    ops.push_back(&op);
  for (Operation *op : llvm::reverse(ops))
    if (op->use_empty() && isPure(op))
      op->erase();
}

} // namespace

bool buildTrainingStep(ModuleOp module, const AutodiffOptions &opts, std::string &error,
                       std::optional<Location> *errorLoc) {
  auto fwd = module.lookupSymbol<func::FuncOp>(opts.function);
  if (!fwd) {
    error = "the module has no function @" + opts.function;
    return false;
  }
  if (module.lookupSymbol(opts.result)) {
    error = "the module already has a symbol @" + opts.result;
    return false;
  }

  // The loss output.
  unsigned numResults = fwd.getNumResults();
  auto outputName = [&](unsigned i) {
    auto a = fwd.getResultAttrOfType<StringAttr>(i, kOutputAttr);
    return a ? a.getValue().str() : "#" + std::to_string(i);
  };
  int lossIndex = -1;
  if (opts.loss.empty()) {
    if (numResults != 1) {
      std::string names;
      for (unsigned i = 0; i < numResults; ++i)
        names += (i ? ", " : "") + outputName(i);
      error = "the model has " + std::to_string(numResults) + " outputs (" + names +
              "); choose the loss with --loss NAME";
      return false;
    }
    lossIndex = 0;
  } else {
    std::string names;
    for (unsigned i = 0; i < numResults; ++i) {
      names += (i ? ", " : "") + outputName(i);
      if (outputName(i) == opts.loss)
        lossIndex = (int)i;
    }
    if (lossIndex < 0) {
      error =
          "--loss " + opts.loss + ": the model has no output of that name (it has: " + names + ")";
      return false;
    }
  }
  auto lossType = cast<RankedTensorType>(fwd.getResultTypes()[lossIndex]);
  if (!isa<FloatType>(lossType.getElementType()) || lossType.getNumElements() != 1) {
    error = "the loss '" + outputName(lossIndex) + "' must be a float scalar, but it is " +
            Differentiator::mlirString(lossType);
    return false;
  }

  // Clone and add the seed argument.
  OpBuilder mb(module.getContext());
  mb.setInsertionPointAfter(fwd);
  auto step = cast<func::FuncOp>(mb.clone(*fwd.getOperation()));
  step.setName(opts.result);
  auto seedType = RankedTensorType::get({}, lossType.getElementType());
  unsigned seedIndex = step.getNumArguments();
  if (failed(step.insertArgument(
          seedIndex, seedType,
          mb.getDictionaryAttr({mb.getNamedAttr(kLossSeedAttr, mb.getUnitAttr())}),
          step.getLoc()))) {
    error = "internal error: cannot add the loss-seed argument";
    step.erase();
    return false;
  }

  Differentiator d{step, error, DenseMap<Value, Value>()};
  if (!d.run((unsigned)lossIndex, step.getArgument(seedIndex))) {
    if (errorLoc)
      *errorLoc = d.where;
    step.erase();
    return false;
  }

  // New results: the loss, then gradients in parameter order.
  Block &body = step.getBody().front();
  auto ret = cast<func::ReturnOp>(body.getTerminator());
  SmallVector<Value> results{ret.getOperand(lossIndex)};
  SmallVector<Attribute> resultAttrs{mb.getDictionaryAttr(
      {mb.getNamedAttr(kOutputAttr, mb.getStringAttr(outputName(lossIndex)))})};
  SmallVector<Attribute> unused;
  for (BlockArgument a : step.getArguments()) {
    unsigned i = a.getArgNumber();
    if (!step.getArgAttr(i, kTrainableAttr))
      continue;
    auto name = step.getArgAttrOfType<StringAttr>(i, kParamAttr);
    if (!isFloatTensor(a)) {
      error = "trainable parameter '" + (name ? name.getValue().str() : "?") +
              "' is not a float tensor";
      step.erase();
      return false;
    }
    Value g = d.grads.lookup(a);
    if (!g) {
      unused.push_back(name);
      continue;
    }
    results.push_back(g);
    resultAttrs.push_back(mb.getDictionaryAttr({mb.getNamedAttr(kGradOfAttr, name)}));
  }
  OpBuilder rb(ret);
  func::ReturnOp::create(rb, ret.getLoc(), results);
  ret.erase();
  SmallVector<Type> resultTypes;
  for (Value v : results)
    resultTypes.push_back(v.getType());
  step.setType(mb.getFunctionType(step.getArgumentTypes(), resultTypes));
  step.setAllResultAttrs(resultAttrs);
  step->setAttr(kLossReductionAttr, mb.getStringAttr(lossReduction(results.front())));
  step->setAttr(kUnusedParamsAttr, mb.getArrayAttr(unused));
  eraseDeadOps(step);
  return true;
}

namespace {

struct AutodiffPass : carve::impl::CarveAutodiffBase<AutodiffPass> {
  using CarveAutodiffBase::CarveAutodiffBase;

  void runOnOperation() override {
    AutodiffOptions opts;
    opts.function = function;
    opts.loss = loss;
    opts.result = result;
    std::string error;
    std::optional<Location> at;
    if (!buildTrainingStep(getOperation(), opts, error, &at)) {
      // On the op at fault (its location names the model node), else the module.
      emitError(at ? *at : getOperation().getLoc()) << error;
      signalPassFailure();
    }
  }
};

} // namespace

} // namespace carve
