//===- LowerConvolutions.cpp - carve-lower-convolutions -------------------===//
//
// The rules are in Passes.td; the builders, which the importer shares, are in
// compiler/frontend/LowerConvolutions.cpp. The pass reads the plan: tp's
// divisibility of a convolution's channels, the "ops" entries that keep one
// whole, and sync_batch_norm.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/LowerConvolutions.h"
#include "compiler/lower/Passes.h"
#include "compiler/partition/Partitioner.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/Support/GlobPattern.h"

namespace carve {
#define GEN_PASS_DEF_CARVELOWERCONVOLUTIONS
#include "compiler/lower/Passes.h.inc"
} // namespace carve

using namespace mlir;

namespace carve {

namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

struct CarveLowerConvolutionsPass
    : carve::impl::CarveLowerConvolutionsBase<CarveLowerConvolutionsPass> {
  using CarveLowerConvolutionsBase::CarveLowerConvolutionsBase;

  void runOnOperation() override {
    SmallVector<Operation *> todo;
    getOperation().walk([&](Operation *op) {
      if (isa<Conv2dOp, MaxPool2dOp, BatchNormOp>(op))
        todo.push_back(op);
    });
    // sync_batch_norm: the statistics over the plan's dp replicas (0: this
    // replica's share alone, as PyTorch DDP without SyncBatchNorm).
    int64_t syncReplicas = 0, tp = 1;
    bool keepConvolutions = false; // cuDNN's convolutions run them whole
    std::vector<OpOverride> ops; // the plan's "ops" entries
    std::vector<std::optional<llvm::GlobPattern>> globs;
    if (auto module = getOperation()->getParentOfType<ModuleOp>()) {
      FailureOr<PlanAttrs> plan = readPlan(module);
      if (failed(plan))
        return signalPassFailure();
      if (plan->syncBatchNorm)
        syncReplicas = plan->dp;
      tp = plan->tp;
      // The CUDA target's convolutions through cuDNN: one op, forward and
      // gradients, where the plan splits no channel (tp splits the im2col
      // GEMMs); the planner's profile asks for them whole (keepWhole) or not.
      keepConvolutions =
          plan->target == "cuda" && plan->convolution == "cudnn" && tp == 1 && !planning;
      for (const auto &[glob, dim] : plan->ops)
        ops.push_back({glob, dim});
    }
    // The planner's profile of such a program (tp = 1).
    if (keepWhole)
      keepConvolutions = true;
    // A GlobPattern refers to its pattern's characters: `ops` holds them.
    for (const OpOverride &o : ops) {
      auto g = llvm::GlobPattern::create(o.glob);
      if (g) {
        globs.push_back(std::move(*g));
      } else {
        llvm::consumeError(g.takeError());
        globs.push_back(std::nullopt);
      }
    }
    for (Operation *op : todo) {
      OpBuilder b(op);
      if (auto conv = dyn_cast<Conv2dOp>(op); conv && keepConvolutions) {
        // cuDNN's convolution adds no bias: the bias is an add after it,
        // [O, 1, 1] against [N, O, H, W], which fusion joins to what follows.
        if (Value bias = conv.getBias()) {
          auto ct = typeOf(conv.getResult());
          Value y = Conv2dOp::create(b, op->getLoc(), ct, conv.getInput(), conv.getWeight(),
                                     Value(), conv.getStridesAttr(), conv.getPadsAttr(),
                                     conv.getDilationsAttr(), conv.getGroupAttr());
          const int64_t o = ct.getShape()[1];
          auto bt = RankedTensorType::get({o, 1, 1}, ct.getElementType());
          Value b3 = ReshapeOp::create(b, op->getLoc(), bt, bias);
          conv.getResult().replaceAllUsesWith(AddOp::create(b, op->getLoc(), ct, y, b3));
          op->erase();
        }
        continue;
      }
      // tp splits a convolution's output channels (or its groups), or its
      // input channels after a split one: one of them must divide.
      if (auto conv = dyn_cast<Conv2dOp>(op); conv && tp > 1 && !planning) {
        const int64_t in = typeOf(conv.getInput()).getShape()[1];
        const int64_t out = typeOf(conv.getWeight()).getShape()[0], g = conv.getGroup();
        const std::string node = nodeName(op->getLoc());
        // Replicated by the "ops" entry that decides it (the partitioner
        // reports a conflict between entries).
        std::string conflict;
        const int k = decidingOverride(ops, globs, node, conflict);
        const bool pinned = k >= 0 && replicates(ops[k]);
        if (out % tp != 0 && in % tp != 0 && g % tp != 0 && !pinned) {
          op->emitError() << "carve.conv2d" << (node.empty() ? "" : " (node '" + node + "')")
                          << ": tp=" << tp << " divides neither its " << in
                          << " input channels nor its " << out
                          << " output channels, so no rank can hold a share of it; choose a tp "
                             "that divides one of them, or keep it whole on every rank with "
                             "the plan's \"ops\": {\""
                          << (node.empty() ? "NODE" : node) << "\": \"replicate\"}";
          return signalPassFailure();
        }
      }
      if (auto bn = dyn_cast<BatchNormOp>(op)) {
        std::string error;
        if (failed(lowerBatchNorm(b, bn, syncReplicas, planning, error))) {
          std::string node = nodeName(op->getLoc());
          op->emitError() << "carve.batch_norm" << (node.empty() ? "" : " (node '" + node + "')")
                          << ": " << error;
          return signalPassFailure();
        }
      } else {
        Value r = isa<Conv2dOp>(op) ? lowerConv2d(b, cast<Conv2dOp>(op))
                                    : lowerMaxPool2d(b, cast<MaxPool2dOp>(op));
        op->getResult(0).replaceAllUsesWith(r);
      }
      op->erase();
      ++numLowered;
    }
  }
};

} // namespace

} // namespace carve
