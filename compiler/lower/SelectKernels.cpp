//===- SelectKernels.cpp - carve-select-kernels ---------------------------===//
//
// The rules are in Passes.td. Each rule is one case of `select`: a new
// implementation (a library call, a fused kernel) is one more case, one line
// of runtime/include/carve/rt/kernels.def and one more lit case.
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Kernels.h"
#include "compiler/lower/Passes.h"
#include "compiler/optimizer/Optimizer.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESELECTKERNELS
#include "compiler/lower/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

/// The choice for one op: an entry of kernels.def or kNoKernel; or, with
/// `error` set, why the target cannot run the op.
struct Choice {
  std::string kernel;
  std::string error;
};

Choice call(const char *kernel) { return {kernel, ""}; }
Choice refuse(std::string why) { return {"", std::move(why)}; }

Type elementOf(Value v) { return cast<ShapedType>(v.getType()).getElementType(); }

/// Rule 5's cast: the conversion its element types name.
Choice selectCast(Operation *op) {
  Type from = elementOf(op->getOperand(0)), to = elementOf(op->getResult(0));
  if (to.isBF16() && from.isF32())
    return call("toBf16");
  if (to.isF16() && from.isF32())
    return call("toF16");
  if (from.isBF16() && to.isF32())
    return call("fromBf16");
  if (from.isF16() && to.isF32())
    return call("fromF16");
  if (from.isBF16() || from.isF16() || to.isBF16() || to.isF16())
    return refuse("16-bit casts are between f32 and bf16 or f16 only");
  return call("cast");
}

/// Rule 5's arithmetic: the CUDA target's binary kernels take f32 (16-bit
/// plans compute in f32 too) and int64 (index arithmetic, but not Pow).
Choice selectBinary(Operation *op, StringRef target) {
  Type elt = elementOf(op->getResult(0));
  if (target == "cuda" && !elt.isF32() && !(elt.isInteger(64) && !isa<PowOp>(op))) {
    StringRef k = binaryKernel(op);
    return refuse(("the CUDA target has no " + k +
                   " kernel for this element type (f32, and int64 but for Pow); compute it in "
                   "float before exporting, or use the CPU target")
                      .str());
  }
  return call("binary");
}

bool sharded(Operation *op) { return (bool)op->getAttrOfType<IntegerAttr>(kShardedRowsAttr); }

/// The rules of Passes.td, in order.
Choice select(Operation *op, StringRef target) {
  // 1. Fused chains.
  if (op->hasAttr(kFusionGroupAttr))
    return call("fused");
  // 2. No call of its own.
  StringRef fold = foldOf(op);
  if (isa<ConstantOp, ReshapeOp>(op) || fold == kFoldOperand || isProductMatmul(op) ||
      isScatteredProduct(op) || isGatheredOperand(op))
    return call(kNoKernel);
  // 3. Products computed where they are read.
  if (fold == kFoldProduct)
    return call("matmul");
  if (isa<MatmulOp>(op))
    return call(gatheredOperand(op) ? "matmul_gathered" : "matmul");
  if (isa<GatherGradOp>(op) && fold == kFoldScatter)
    return call("matmul_gather_grad");
  // 4. Rows or classes split over tp; 5. the op's family.
  if (isa<GatherOp, GatherGradOp>(op) && !elementOf(op->getOperand(1)).isInteger(64))
    return refuse("indices must be int64 for the CPU target");
  if (isa<GatherOp>(op))
    return call(sharded(op) ? "gather_sharded" : "gather");
  if (isa<GatherGradOp>(op))
    return call(sharded(op) ? "gather_sharded_grad" : "gather_grad");
  if (isa<CrossEntropyOp, CrossEntropyGradOp>(op)) {
    if (!elementOf(op->getOperand(1)).isInteger(64))
      return refuse("targets must be int64 for the CPU target");
    if (isa<CrossEntropyOp>(op))
      return call(sharded(op) ? "cross_entropy_vocab_parallel" : "cross_entropy");
    return call(sharded(op) ? "cross_entropy_vocab_parallel_grad" : "cross_entropy_grad");
  }
  if (binaryKernel(op))
    return selectBinary(op, target);
  if (isa<EqualOp, LessOp, GreaterOp>(op))
    return call("compare");
  if (isa<AndOp, OrOp, NotOp>(op))
    return call("logic");
  if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
          ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op))
    return call("unary");
  if (isa<UnaryGradOp>(op))
    return call("unary_grad");
  if (isa<WhereOp>(op))
    return call("where");
  if (isa<CastOp>(op))
    return selectCast(op);
  if (isa<DropoutOp>(op))
    return call("dropout");
  // train --eval-data's choice, and a buffer's new value: copies.
  if (isa<EvalSelectOp, AssignOp>(op))
    return call("copy");
  // SyncBatchNorm's statistics: summed over the replicas (a copy at dp = 1).
  if (isa<ReplicaSumOp>(op))
    return call("allReduce");
  if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(op))
    return call("reduce");
  if (isa<SoftmaxOp, LogSoftmaxOp>(op))
    return call("softmax");
  if (isa<SoftmaxGradOp>(op))
    return call("softmax_grad");
  if (isa<LayerNormOp>(op))
    return call("layer_norm");
  if (isa<LayerNormGradOp>(op))
    return call("layer_norm_grad");
  if (isa<RmsNormOp>(op))
    return call("rms_norm");
  if (isa<RmsNormGradOp>(op))
    return call("rms_norm_grad");
  if (isa<AttentionOp>(op))
    return call("attention");
  if (isa<AttentionGradOp>(op))
    return call("attention_grad");
  if (isa<AttentionStatsOp>(op))
    return call("attention_stats");
  if (isa<AttentionGradStatsOp>(op))
    return call("attention_grad_stats");
  if (isa<TransposeOp>(op))
    return call("transpose");
  if (isa<SliceOp>(op))
    return call("slice");
  if (isa<SliceGradOp>(op))
    return call("slice_grad");
  if (isa<ConcatOp>(op))
    return call("concat");
  if (isa<ExpandOp>(op))
    return call("expand");
  if (isa<NonzeroOp>(op))
    return call("nonzero");
  if (isa<ExpertAllToAllOp>(op)) {
    if (!elementOf(op->getOperand(0)).isF32())
      return refuse("the expert exchange moves f32 tensors");
    return call("allToAllSplit");
  }
  if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp, dist::AllToAllOp>(op)) {
    Type et = elementOf(op->getOperand(0));
    if (!et.isF32() && !et.isF64() && !et.isInteger(64))
      return refuse("collectives on the CPU target take f32, f64 or i64 tensors");
  }
  if (isa<dist::AllReduceOp>(op))
    return call("allReduce");
  if (isa<dist::AllGatherOp>(op))
    return call("allGatherSplit");
  if (isa<dist::ReduceScatterOp>(op))
    return call("reduceScatterSplit");
  if (isa<dist::AllToAllOp>(op))
    return call("allToAllSplit");
  if (isa<dist::LocalSplitOp>(op))
    return call("takeShard");
  if (isa<dist::BroadcastOp>(op))
    return call("broadcast");
  if (isa<dist::SendOp>(op))
    return call("sendAsync");
  if (isa<dist::RecvOp>(op))
    return call("recvAsync");
  // The user's kernel, declared by the rules file (carve/rt/custom.h's ABI).
  if (isa<CustomOp, CustomGradOp>(op))
    return call("custom");
  return refuse(std::string("the ") + (target == "cuda" ? "CUDA" : "CPU") +
                " target has no kernel for this op yet");
}

struct SelectKernels : impl::CarveSelectKernelsBase<SelectKernels> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    MLIRContext *ctx = module.getContext();
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (fn.isExternal() || !isEmittedFunction(fn))
        continue;
      for (Operation &op : fn.getBody().front().without_terminator()) {
        if (isOptimizerOp(&op))
          continue; // the step's tail: its printer reads the ops themselves
        Choice c = select(&op, plan->target);
        if (!c.error.empty()) {
          std::string node = nodeName(op.getLoc());
          op.emitError("'" + op.getName().getStringRef().str() + "'" +
                       (node.empty() ? "" : " (node '" + node + "')") + ": " + c.error);
          return signalPassFailure();
        }
        if (c.kernel != kNoKernel && c.kernel != "custom") {
          std::optional<RuntimeEntry> e = lookupRuntimeEntry(c.kernel);
          if (!e || !runsOn(*e, plan->target)) {
            op.emitError("carve-select-kernels chose '" + c.kernel + "', which the " +
                         plan->target +
                         " runtime does not have (runtime/include/carve/rt/"
                         "kernels.def)");
            return signalPassFailure();
          }
        }
        ++(c.kernel == kNoKernel ? numNone : numCalls);
        op.setAttr(kKernelAttr, StringAttr::get(ctx, c.kernel));
      }
    }
  }
};

} // namespace

} // namespace carve
