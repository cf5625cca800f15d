//===- Params16.cpp - 16-bit parameter copies with fp32 masters -----------===//
//
// carve-store-params16: under a bf16/fp16 plan each trainable parameter
// argument becomes the 16-bit copy the step reads (Passes.td states the
// rules); carve-plan-memory gives it an fp32 master with the optimizer state.
//
//===----------------------------------------------------------------------===//

#include "compiler/precision/Precision.h"

#include "compiler/fusion/Fusion.h"
#include "compiler/stages/StageSplit.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/SetVector.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESTOREPARAMS16
#include "compiler/precision/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

/// A reshape of a trainable parameter read by both forward and backward (a
/// convolution's weight as [O, C*K], read by the forward's GEMM and by the
/// input gradient's): backward gets a reshape of its own, so that the fp32
/// view each reader's cast makes lives in its own pass, not from forward to
/// backward (an fp32 copy of the weight kept all step).
void splitViewsAcrossPasses(func::FuncOp fn) {
  ProgramOrder order(fn);
  const int64_t backwardBegin = order.backwardBegin(true);
  for (BlockArgument a : fn.getArguments()) {
    if (!fn.getArgAttr(a.getArgNumber(), kParamAttr) ||
        !fn.getArgAttr(a.getArgNumber(), kTrainableAttr))
      continue;
    for (Operation *u : llvm::to_vector(a.getUsers())) {
      auto r = dyn_cast<ReshapeOp>(u);
      if (!r || !order.index.count(r) || order.index.lookup(r) >= backwardBegin)
        continue;
      SmallVector<OpOperand *> backward;
      Operation *first = nullptr;
      for (OpOperand &use : r.getResult().getUses()) {
        Operation *v = use.getOwner();
        if (!order.index.count(v) || order.index.lookup(v) < backwardBegin)
          continue;
        backward.push_back(&use);
        if (!first || order.index.lookup(v) < order.index.lookup(first))
          first = v;
      }
      if (backward.empty() ||
          backward.size() == (size_t)std::distance(r->getUses().begin(), r->getUses().end()))
        continue;
      OpBuilder b(first);
      std::string node = nodeName(r->getLoc());
      Operation *copy = b.clone(*r.getOperation());
      copy->setLoc(NameLoc::get(b.getStringAttr(std::string(kBackwardPrefix) + node), r->getLoc()));
      for (OpOperand *use : backward)
        use->set(copy->getResult(0));
    }
  }
}

struct StoreParams16Pass : carve::impl::CarveStoreParams16Base<StoreParams16Pass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    MLIRContext *ctx = module.getContext();
    Type f16;
    if (plan->precision == "bf16")
      f16 = BFloat16Type::get(ctx);
    else if (plan->precision == "fp16")
      f16 = Float16Type::get(ctx);
    else
      return;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      bool changed = false;
      splitViewsAcrossPasses(fn);
      ArgAttrEdits masters(fn);
      for (BlockArgument a : fn.getArguments()) {
        unsigned i = a.getArgNumber();
        auto name = fn.getArgAttrOfType<StringAttr>(i, kParamAttr);
        auto t = dyn_cast<RankedTensorType>(a.getType());
        if (!name || !fn.getArgAttr(i, kTrainableAttr) || !t || !t.getElementType().isF32() ||
            !t.hasStaticShape())
          continue;
        llvm::SetVector<Operation *> readers;
        for (Operation *u : a.getUsers())
          readers.insert(u);
        a.setType(RankedTensorType::get(t.getShape(), f16));
        OpBuilder b(ctx);
        Location loc = NameLoc::get(b.getStringAttr(name.getValue() + " (16-bit copy as fp32)"));
        for (Operation *u : readers) {
          b.setInsertionPoint(u);
          Value view = CastOp::create(b, loc, t, a).getResult();
          u->replaceUsesOfWith(a, view);
          ++numCasts;
        }
        masters.set(i, kMasterAttr, b.getUnitAttr());
        numBytesSaved += t.getNumElements() * 2;
        ++numParams;
        changed = true;
      }
      masters.apply();
      if (changed)
        fn.setType(FunctionType::get(ctx, fn.getBody().front().getArgumentTypes(),
                                     fn.getFunctionType().getResults()));
    }
  }
};

} // namespace

} // namespace carve
