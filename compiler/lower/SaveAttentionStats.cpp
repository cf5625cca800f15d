//===- SaveAttentionStats.cpp - carve-save-attention-stats -----------------===//
//
// The rules are in Passes.td.
//
//===----------------------------------------------------------------------===//

#include "compiler/lower/Passes.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESAVEATTENTIONSTATS
#include "compiler/lower/Passes.h.inc"
} // namespace carve

namespace carve {
namespace {

/// Whether `g` differentiates `a`: the same inputs, mask and attributes.
bool differentiates(AttentionGradOp g, AttentionOp a) {
  return g.getQuery() == a.getQuery() && g.getKey() == a.getKey() && g.getValue() == a.getValue() &&
         g.getMask() == a.getMask() && g.getScale() == a.getScale() &&
         g.getCausal() == a.getCausal();
}

struct SaveAttentionStats : impl::CarveSaveAttentionStatsBase<SaveAttentionStats> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (plan->target != "cuda" || plan->recompute != "none")
      return;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (fn.isExternal() || !isEmittedFunction(fn))
        continue;
      std::vector<AttentionOp> forwards;
      std::vector<AttentionGradOp> grads;
      for (Operation &op : fn.getBody().front()) {
        if (auto a = dyn_cast<AttentionOp>(op))
          forwards.push_back(a);
        else if (auto g = dyn_cast<AttentionGradOp>(op))
          grads.push_back(g);
      }
      llvm::DenseMap<Operation *, AttentionStatsOp> saved;
      for (AttentionGradOp g : grads) {
        AttentionOp fwd;
        for (AttentionOp a : forwards)
          if (a->isBeforeInBlock(g) && differentiates(g, a))
            fwd = a;
        // A forward rounded to 16 bits as written (carve.round16, read as such
        // by backward) is not the output the gradient's forward-again computes.
        if (!fwd || fwd->hasAttr(kRound16Attr))
          continue;
        AttentionStatsOp stats = saved.lookup(fwd);
        if (!stats) {
          OpBuilder b(fwd);
          auto out = cast<RankedTensorType>(fwd.getResult().getType());
          auto lseType = RankedTensorType::get(out.getShape().drop_back(), b.getF32Type());
          stats = AttentionStatsOp::create(b, fwd.getLoc(), TypeRange{out, lseType}, fwd.getQuery(),
                                           fwd.getKey(), fwd.getValue(), fwd.getMask(),
                                           fwd.getScaleAttr(), fwd.getCausalAttr());
          stats->setDiscardableAttrs(fwd->getDiscardableAttrDictionary());
          fwd.getResult().replaceAllUsesWith(stats.getResult());
          saved[fwd] = stats;
        }
        OpBuilder b(g);
        auto grad = AttentionGradStatsOp::create(b, g.getLoc(), g->getResultTypes(), g.getQuery(),
                                                 g.getKey(), g.getValue(), stats.getResult(),
                                                 stats.getLse(), g.getGrad(), g.getMask(),
                                                 g.getScaleAttr(), g.getCausalAttr());
        grad->setDiscardableAttrs(g->getDiscardableAttrDictionary());
        g->replaceAllUsesWith(grad->getResults());
        g->erase();
        ++numPaired;
      }
      for (auto &[fwd, stats] : saved)
        fwd->erase();
    }
  }
};

} // namespace
} // namespace carve
