//===- Grads16.cpp - gradients produced, reduced and kept in 16 bits -----===//
//
// carve-store-grads16: under a bf16/fp16 plan whose gradients are 16-bit
// (PlanAttrs::gradients16), each gradient a function returns becomes a
// carve.cast of it to the format, placed right after the value is final;
// the rules are in Passes.td.
//
//===----------------------------------------------------------------------===//

#include "compiler/precision/Precision.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseMap.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESTOREGRADS16
#include "compiler/precision/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

struct StoreGrads16Pass : carve::impl::CarveStoreGrads16Base<StoreGrads16Pass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (!plan->gradients16())
      return;
    MLIRContext *ctx = module.getContext();
    Type f16 = plan->precision == "bf16" ? Type(BFloat16Type::get(ctx)) : Float16Type::get(ctx);
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
      llvm::DenseMap<Value, Value> rounded; // one cast per gradient value
      SmallVector<Type> results(fn.getFunctionType().getResults());
      OpBuilder b(ctx);
      for (unsigned k = 0; k < ret.getNumOperands(); ++k) {
        StringAttr of = gradOf(fn, k);
        if (!of)
          continue;
        Value g = ret.getOperand(k);
        auto t = dyn_cast<RankedTensorType>(g.getType());
        if (!t || !t.getElementType().isF32()) {
          emitError(g.getLoc()) << "carve-store-grads16: the gradient of '" << of.getValue()
                                << "' is " << g.getType() << ", not an f32 tensor";
          return signalPassFailure();
        }
        auto [it, fresh] = rounded.try_emplace(g, Value());
        if (fresh) {
          // Right after the value is final: its f32 storage is freed there,
          // and what the step keeps (and reduces) is the 16-bit one.
          if (Operation *def = g.getDefiningOp())
            b.setInsertionPointAfter(def);
          else
            b.setInsertionPointToStart(&fn.getBody().front());
          Location loc =
              NameLoc::get(b.getStringAttr("gradient of " + of.getValue() + " (16-bit)"));
          it->second =
              CastOp::create(b, loc, RankedTensorType::get(t.getShape(), f16), g).getResult();
          numGrads++;
          numBytesSaved += t.getNumElements() * 2;
        }
        ret->setOperand(k, it->second);
        results[k] = it->second.getType();
      }
      fn.setType(FunctionType::get(ctx, fn.getFunctionType().getInputs(), results));
    }
  }
};

} // namespace

} // namespace carve
