//===- SelectKernels.cpp - carve-select-kernels ---------------------------===//
//
// The rules are in Passes.td. Each rule is one case of `select`: a new
// implementation (a library call, a fused kernel) is one more case, one line
// of runtime/include/carve/rt/kernels.def and one more lit case.
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"
#include "compiler/lower/CopiesByWriter.h"
#include "compiler/lower/Kernels.h"
#include "compiler/lower/Passes.h"
#include "compiler/optimizer/Optimizer.h"
#include "compiler/precision/Precision.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include <functional>

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

/// Whether `v` is an exact f32 view of a 16-bit tensor of the plan's
/// format: the result of a carve.cast from it (carve-store-params16's weight
/// views, carve-pack-activations' saved activations).
bool isView16(Value v, StringRef precision) {
  auto c = v.getDefiningOp<CastOp>();
  return c && elementOf(c.getResult()).isF32() && stored16(v, c, precision) == c.getInput();
}

/// Rule 3's products on the CUDA target under bf16/fp16: a matmul whose
/// operand (as read, through a folded transpose and reshapes) has a 16-bit
/// tensor of the same bits (stored16: the tensor it is a view of, or its
/// 16-bit copy made before the call, carve-round-operands16) reads that
/// tensor itself (`matmul16`, carve.read16 per operand) instead of rounding
/// the operand again; a view that every reader reads so (directly or through
/// reshapes and folded transposes) is no call (`none`). The values cuBLAS
/// multiplies are the same bits.
/// Rule 3c's backward likewise: an attention_grad_stats that runs on cuDNN
/// reads the 16-bit tensors its query, key and value are views of (the
/// forward's saved 16-bit copies) instead of the views (carve.read16, one
/// flag per q, k, v): cuDNN's graph reads 16-bit inputs, so the call would
/// otherwise round the views back to the same bits. Its forward
/// (attention_stats) reads the copies carve-pack-activations made before it.
struct Read16 {
  /// Whether every use of `v` (through reshapes and folded transposes) reads
  /// it as the 16-bit tensor of its bits.
  std::function<bool(Value)> allRead16;
  llvm::DenseMap<Operation *, std::array<bool, 2>> flags; // the op that runs the matmul
  llvm::DenseMap<Operation *, std::array<bool, 3>> attention; // q, k, v of a cuDNN gradient
  llvm::DenseMap<Operation *, std::array<bool, 2>> conv;      // a cuDNN convolution's operands
  llvm::DenseSet<Operation *> deadViews;                      // casts nothing reads as f32
  llvm::DenseSet<Operation *> crossEntropy;                   // reads its logits as 16 bits
  llvm::DenseSet<std::pair<Operation *, unsigned>> reads;     // (op, operand) read as 16 bits
  /// Ops of rule 3g (readsExact16): one flag per operand.
  llvm::DenseMap<Operation *, SmallVector<bool>> widen;
  bool failed = false;

  Read16(func::FuncOp fn, const PlanAttrs &plan) {
    StringRef precision = plan.precision;
    // Which operand of which matmul (or cuDNN attention gradient) reads a
    // view as 16 bits.
    for (Operation &op : fn.getBody().front().without_terminator()) {
      // Rule 3g: kernels that compute in f32 read operands whose exact
      // 16-bit tensor exists as that tensor, widened in registers.
      {
        SmallVector<bool> w(op.getNumOperands(), false);
        bool any = false;
        for (unsigned k = 0; k < op.getNumOperands(); ++k)
          if (readsExact16(&op, k, plan)) {
            w[k] = any = true;
            reads.insert({&op, k});
          }
        if (any) {
          widen[&op] = std::move(w);
          continue;
        }
      }
      // A bias add its matmul computes (carve-fold-views' "epilogue"): the
      // matmul reads the bias as its 16-bit tensor.
      if (Value bias; isa<AddOp>(&op) && epilogueMatmulOf(&op, &bias)) {
        for (unsigned k = 0; k < 2; ++k)
          if (op.getOperand(k) == bias)
            reads.insert({&op, k});
        continue;
      }
      // A GELU gradient its matmul computes (the same rule): the matmul
      // reads the pre-activation as its 16-bit tensor (DGELU's input).
      if (isa<UnaryGradOp>(&op) && epilogueMatmulOf(&op)) {
        reads.insert({&op, 0});
        continue;
      }
      // cuDNN's convolutions: operands that have a 16-bit tensor of their
      // bits (a weight's copy, a saved activation, a copy made before the
      // call by carve-round-operands16) are read as that tensor, which is
      // what the call would round them to.
      if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(&op)) {
        std::array<bool, 2> f = {false, false};
        for (unsigned k = 0; k < 2; ++k)
          if (stored16(op.getOperand(k), &op, precision)) {
            f[k] = true;
            reads.insert({&op, k});
          }
        if (f[0] || f[1])
          conv[&op] = f;
        continue;
      }
      // cuDNN's forward: q, k, v whose 16-bit copies carve-pack-activations
      // made just before it are read as those copies.
      if (isa<AttentionStatsOp>(&op) && cudnnAttentionRefusal(&op, plan).empty()) {
        std::array<bool, 3> f = {false, false, false};
        for (unsigned k = 0; k < 3; ++k)
          f[k] = (bool)copy16BeforeView(op.getOperand(k), &op, precision);
        if (f[0] || f[1] || f[2])
          attention[&op] = f;
        continue;
      }
      if (isa<AttentionGradStatsOp>(&op) && cudnnAttentionRefusal(&op, plan).empty()) {
        std::array<bool, 3> f = {false, false, false};
        for (unsigned k = 0; k < 3; ++k)
          if (stored16(op.getOperand(k), &op, precision)) {
            f[k] = true;
            reads.insert({&op, k});
          }
        if (f[0] || f[1] || f[2])
          attention[&op] = f;
        continue;
      }
      // Cross-entropy (not vocab-parallel) and its gradient read logits
      // that have a 16-bit tensor of their bits as stored.
      if (isa<CrossEntropyOp, CrossEntropyGradOp>(&op) && !sharded(&op)) {
        if (stored16(op.getOperand(0), &op, precision)) {
          crossEntropy.insert(&op);
          reads.insert({&op, 0});
        }
        continue;
      }
      Operation *mm = nullptr;
      if (isa<MatmulOp>(&op) && !isProductMatmul(&op) && !isScatteredProduct(&op) &&
          !gatheredOperand(&op) && !op.hasAttr(kFusionGroupAttr))
        mm = &op;
      else if (isa<TransposeOp>(&op) && foldOf(&op) == kFoldProduct)
        mm = op.getOperand(0).getDefiningOp();
      if (!mm || !isa<MatmulOp>(mm))
        continue;
      std::array<bool, 2> f = {false, false};
      for (unsigned k = 0; k < 2; ++k)
        if (stored16(readOperand(mm, k), &op, precision)) {
          f[k] = true;
          reads.insert({mm, k});
        }
      if (f[0] || f[1])
        flags[&op] = f;
    }
    // A view is dead when every use reads it as 16 bits: a flagged matmul
    // or attention operand, or a reshape or folded transpose whose every
    // use is one.
    allRead16 = [this](Value v) {
      return !v.use_empty() && llvm::all_of(v.getUses(), [this](OpOperand &use) {
        Operation *u = use.getOwner();
        if (reads.count({u, use.getOperandNumber()}))
          return true;
        if (isa<ReshapeOp>(u) || (isa<TransposeOp>(u) && foldOf(u) == kFoldOperand))
          return allRead16(u->getResult(0));
        return false;
      });
    };
    // (neverStoredF32 is the rule carve-plan-memory gave no memory by.)
    for (Operation &op : fn.getBody().front().without_terminator())
      if (isa<CastOp>(&op) && isView16(op.getResult(0), precision) &&
          neverStoredF32(op.getResult(0), plan)) {
        if (!allRead16(op.getResult(0))) {
          op.emitError("carve-select-kernels: carve-plan-memory gave this f32 view no memory, "
                       "but not every reader reads its 16-bit tensor");
          failed = true;
        }
        deadViews.insert(&op);
      }
  }
};

/// The rules of Passes.td, in order.
Choice select(Operation *op, StringRef target) {
  // 1. Fused chains.
  if (op->hasAttr(kFusionGroupAttr))
    return call("fused");
  // 2. No call of its own.
  StringRef fold = foldOf(op);
  if (isa<ConstantOp, ReshapeOp>(op) || fold == kFoldOperand || fold == kFoldView ||
      fold == kFoldProducer || fold == kFoldConsumer || fold == kFoldAccumulate ||
      fold == kFoldAssemble || fold == kFoldStrided || fold == kFoldEpilogue ||
      isProductMatmul(op) || isScatteredProduct(op) || isGatheredOperand(op))
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
  if (isa<LayerNormGradOp>(op)) // adding the residual's gradient (carve-fold-views), or not
    return call(accumulatedResidual(op) ? "layer_norm_grad_add" : "layer_norm_grad");
  if (isa<RmsNormOp>(op))
    return call("rms_norm");
  if (isa<RmsNormGradOp>(op))
    return call(accumulatedResidual(op) ? "rms_norm_grad_add" : "rms_norm_grad");
  if (isa<RotaryOp>(op))
    return call("rotary");
  if (isa<RotaryGradOp>(op))
    return call("rotary_grad");
  // 3k. A convolution kept whole (carve-lower-convolutions, CUDA target):
  // cuDNN's convolution, forward or either gradient.
  if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op)) {
    if (target != "cuda")
      return refuse("the CPU target runs convolutions as im2col GEMMs (carve-lower-convolutions)");
    if (!elementOf(op->getOperand(0)).isF32())
      return refuse("cuDNN's convolutions here take the f32 tensors the program stores");
    if (auto c = dyn_cast<Conv2dOp>(op); c && c.getBias())
      return refuse("a bias inside the convolution (carve-lower-convolutions adds it after)");
    return call(isa<Conv2dOp>(op)            ? "conv2d"
                : isa<Conv2dGradInputOp>(op) ? "conv2d_grad_input"
                                             : "conv2d_grad_weight");
  }
  if (isa<AttentionOp>(op))
    return call("attention");
  if (isa<AttentionGradOp>(op))
    return call("attention_grad");
  if (isa<AttentionStatsOp>(op))
    return call("attention_stats");
  if (isa<AttentionGradStatsOp>(op))
    return call("attention_grad_stats");
  if (isa<TransposeOp>(op)) // reading a slice in place (carve-fold-views), or not
    return call(foldedViewOf(op->getOperand(0)) ? "transpose_view" : "transpose");
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
      std::optional<Read16> read16;
      if (plan->target == "cuda" && plan->precision != "fp32") {
        read16.emplace(fn, *plan);
        if (read16->failed)
          return signalPassFailure();
      }
      for (Operation &op : fn.getBody().front().without_terminator()) {
        if (isOptimizerOp(&op)) {
          // The step's tail: its printer reads the ops themselves. On the
          // CUDA target (rule 6) AdamW and SGD run as one multi-tensor launch
          // over every parameter, and the gradient norm's sums of squares as two.
          if (plan->target == "cuda" && isa<AdamWOp>(&op))
            op.setAttr(kKernelAttr, StringAttr::get(ctx, "adamwMulti"));
          else if (plan->target == "cuda" && isa<SGDOp>(&op))
            op.setAttr(kKernelAttr, StringAttr::get(ctx, "sgdMulti"));
          else if (plan->target == "cuda" && isa<GradNormOp>(&op))
            op.setAttr(kKernelAttr, StringAttr::get(ctx, "sumSquaresMulti"));
          continue;
        }
        Choice c = select(&op, plan->target);
        if (isa<TransposeOp>(&op) && foldOf(&op) == kFoldStrided) {
          // carve-fold-views' "strided": read in place in the 16-bit copy its
          // source's writer writes alone.
          std::optional<StridedPiece> piece = stridedPieceOf(&op);
          std::optional<StridedView> view = foldedViewOf(op.getOperand(0));
          if (!piece || !view || !neverStoredF32(view->base, *plan))
            c = refuse("carve.fold = \"strided\" on a transpose whose source's writer does not "
                       "write the source's 16-bit copy alone");
        }
        if (read16 && c.kernel == "matmul") {
          auto it = read16->flags.find(&op);
          if (it != read16->flags.end()) {
            c = call("matmul16");
            op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, it->second));
          }
        }
        if (epilogueAddOf(&op) && (c.kernel == "matmul" || c.kernel == "matmul16")) {
          // carve-fold-views' "epilogue": it adds the bias as it writes the
          // add's 16-bit copy (cuBLASLt's BIAS), or multiplies its product
          // by GELU's derivative as it writes the gradient's copy (DGELU).
          const bool dgelu = isa<UnaryGradOp>(epilogueAddOf(&op));
          const char *what = dgelu ? "a GELU gradient" : "an add";
          if (!read16)
            c = refuse("carve.fold = \"epilogue\" outside a bf16/fp16 CUDA plan");
          else if (!neverStoredF32(epilogueAddOf(&op)->getResult(0), *plan))
            c = refuse(std::string("carve.fold = \"epilogue\" on ") + what +
                       " whose f32 result is read (its matmul writes only its 16-bit copy)");
          else if (dgelu && !dgeluMatmul(epilogueAddOf(&op), plan->precision))
            c = refuse("carve.fold = \"epilogue\" on a GELU gradient cuBLASLt's DGELU cannot "
                       "compute (the tanh form, a 16-bit input, rows a multiple of 8)");
          else if (Operation *g = epilogueGeluOf(&op);
                   g &&
                   (!biasGeluMatmul(g, plan->precision) || !neverStoredF32(g->getResult(0), *plan)))
            c = refuse("carve.fold = \"epilogue\" on a GELU cuBLASLt's GELU_AUX_BIAS cannot "
                       "compute, or whose f32 result is read (the tanh form, rows a multiple of "
                       "8, read as its 16-bit copy)");
          else {
            if (!op.hasAttr(kRead16Attr))
              op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, {false, false}));
            c = call(dgelu                 ? "matmul16_dgelu"
                     : epilogueGeluOf(&op) ? "matmul16_bias_gelu"
                                           : "matmul16_bias");
          }
        }
        if (read16 && (c.kernel == "cross_entropy" || c.kernel == "cross_entropy_grad") &&
            read16->crossEntropy.count(&op)) {
          c = call(c.kernel == "cross_entropy" ? "cross_entropy16" : "cross_entropy_grad16");
          op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, {true}));
        }
        if (read16) {
          auto it = read16->widen.find(&op);
          if (it != read16->widen.end()) {
            op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, it->second));
            ++numRead16Ops;
            if (c.kernel == "layer_norm" || c.kernel == "layer_norm_grad" ||
                c.kernel == "layer_norm_grad_add" || c.kernel == "rms_norm" ||
                c.kernel == "rms_norm_grad" || c.kernel == "rms_norm_grad_add" ||
                c.kernel == "unary_grad" || c.kernel == "binary" || c.kernel == "gather" ||
                c.kernel == "reduce" || c.kernel == "rotary" || c.kernel == "rotary_grad")
              c = call((c.kernel + "16").c_str());
            else if (c.kernel != "fused" && c.error.empty())
              c = refuse("carve-select-kernels: rule 3g marks an operand read as 16 bits, but '" +
                         c.kernel + "' has no 16-bit entry");
          }
        }
        if (read16 && StringRef(c.kernel).starts_with("conv2d")) {
          auto it = read16->conv.find(&op);
          if (it != read16->conv.end()) {
            op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, it->second));
            ++numRead16Ops;
          }
        }
        if (read16 && read16->deadViews.count(&op)) {
          c = call(kNoKernel);
          ++numRead16Views;
        }
        if (plan->target == "cuda" &&
            (c.kernel == "attention_stats" || c.kernel == "attention_grad_stats")) {
          std::string why = cudnnAttentionRefusal(&op, *plan);
          if (why.empty()) {
            c.kernel += "_cudnn";
            op.removeAttr(kKernelWhyAttr);
            ++numCudnnAttention;
            if (read16) {
              auto it = read16->attention.find(&op);
              if (it != read16->attention.end())
                op.setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, it->second));
            }
          } else {
            op.setAttr(kKernelWhyAttr, StringAttr::get(ctx, why));
          }
        }
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
      if (read16) {
        writeCopies(fn, *plan, *read16);
        copiesByWriter(fn, plan->precision);
        paramGradsByWriter(fn, *plan);
        roundInCopies(fn, plan->precision);
        copiesInFused(fn, plan->precision);
        biasGradsInGemms(fn, *plan);
      }
      // Not in pipeline stages: their forward and backward print as
      // functions of their own.
      if (plan->target == "cuda" && fn.getName() == "train_step")
        lossesInGradients(fn);
    }
  }

  /// Rule 3e: a 16-bit copy (a cast from f32 to the plan's format) right
  /// after a matmul run by cuBLAS (or a product's transpose) or a
  /// cross-entropy gradient that writes its input, where every other reader
  /// of that input reads it as the copy (carve.read16, through reshapes): the
  /// op writes the copy itself (`matmul16_to16`, `cross_entropy_grad16`;
  /// marked carve.write16) and no f32 result; the copy is no call. The same
  /// bits: the op's f32 values rounded to nearest even.
  void writeCopies(func::FuncOp fn, const PlanAttrs &plan, const Read16 &read16) {
    MLIRContext *ctx = fn.getContext();
    StringRef precision = plan.precision;
    for (Operation &op : fn.getBody().front().without_terminator()) {
      auto c = dyn_cast<CastOp>(&op);
      if (!c || !elementOf(c.getInput()).isF32())
        continue;
      Type to = elementOf(c.getResult());
      if (!(precision == "bf16" && to.isBF16()) && !(precision == "fp16" && to.isF16()))
        continue;
      Value v = c.getInput();
      Operation *w = v.getDefiningOp();
      if (!w || w->getNextNode() != &op || w->getNumResults() != 1 || w->hasAttr(kFusionGroupAttr))
        continue;
      StringAttr wk = w->getAttrOfType<StringAttr>(kKernelAttr);
      if (!wk)
        continue;
      const bool mm = (isa<MatmulOp>(w) || (isa<TransposeOp>(w) && foldOf(w) == kFoldProduct)) &&
                      (wk.getValue() == "matmul" || wk.getValue() == "matmul16");
      const bool ce = isa<CrossEntropyGradOp>(w) && (wk.getValue() == "cross_entropy_grad" ||
                                                     wk.getValue() == "cross_entropy_grad16");
      if (!mm && !ce)
        continue;
      // Every reader but the copy reads the copy's bits (the rule
      // carve-plan-memory gave the f32 result no memory by).
      if (!neverStoredF32(v, plan))
        continue;
      if (mm) {
        if (!w->hasAttr(kRead16Attr))
          w->setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, {false, false}));
        w->setAttr(kKernelAttr, StringAttr::get(ctx, "matmul16_to16"));
      } else {
        if (!w->hasAttr(kRead16Attr))
          w->setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, {false}));
        w->setAttr(kKernelAttr, StringAttr::get(ctx, "cross_entropy_grad16"));
      }
      w->setAttr(kWrite16Attr, UnitAttr::get(ctx));
      op.setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
      ++numWrite16;
    }
  }

  /// Rule 3h: a 16-bit copy, among the copies right after the op that wrote
  /// its f32 input, where that op is a binary op, a unary gradient, a layer
  /// or RMS norm, a rotary embedding or its gradient, or an f32
  /// concatenation or transpose (not a fused chain's member) is written by
  /// that op as it writes the value (binary16, unary_grad16, layer_norm16,
  /// rms_norm16, rotary16, rotary_grad16, concat16, transpose16; the copy
  /// is no call, marked carve.copy_by_writer); an op marked carve.round16
  /// rounds its value as it writes it (no rounding after it). The same bits:
  /// the value rounded to nearest even, as toBf16 / toF16 round it. Before
  /// rule 3d, which takes the copies of the other rounded writers.
  void copiesByWriter(func::FuncOp fn, StringRef precision) {
    MLIRContext *ctx = fn.getContext();
    for (Operation &op : fn.getBody().front().without_terminator()) {
      if (foldOf(&op) == kFoldAccumulate) {
        numCopyByWriter += accumulatedAddCopy(&op, precision);
        continue;
      }
      if (foldOf(&op) == kFoldAssemble || foldOf(&op) == kFoldEpilogue ||
          (foldOf(&op) == kFoldProducer && isa_and_nonnull<AttentionStatsOp>(producerOf(&op)))) {
        numCopyByWriter += copyWrittenElsewhere(&op, precision);
        continue;
      }
      StringAttr k = op.getAttrOfType<StringAttr>(kKernelAttr);
      if (k && k.getValue() == "attention_grad_stats_cudnn") {
        numCopyByWriter += attentionGradCopies(&op, precision);
        continue;
      }
      if (k && isa<LayerNormGradOp, RmsNormGradOp>(op) &&
          (k.getValue() == "layer_norm_grad" || k.getValue() == "layer_norm_grad16" ||
           k.getValue() == "rms_norm_grad" || k.getValue() == "rms_norm_grad16")) {
        numCopyByWriter += normGradInputCopy(&op, precision);
        continue;
      }
      if (!k || op.getNumResults() != 1 || op.hasAttr(kFusionGroupAttr) ||
          op.hasAttr(kWrite16Attr) || op.hasAttr(kRound16InCopyAttr))
        continue;
      StringRef kernel = k.getValue();
      // cuDNN's convolutions (the same entries): the call writes its 16-bit
      // result there instead of widening it only.
      if (kernel.starts_with("conv2d")) {
        numCopyByWriter += convolutionCopy(&op, precision);
        continue;
      }
      auto rt = dyn_cast<RankedTensorType>(op.getResult(0).getType());
      const bool f32 = rt && rt.getElementType().isF32();
      const bool flagged = kernel == "binary" || kernel == "binary16" || kernel == "unary_grad" ||
                           kernel == "unary_grad16" || kernel == "layer_norm" ||
                           kernel == "layer_norm16" || kernel == "rms_norm" ||
                           kernel == "rms_norm16" || kernel == "rotary" || kernel == "rotary16" ||
                           kernel == "rotary_grad" || kernel == "rotary_grad16";
      const bool layout =
          (kernel == "concat" || kernel == "transpose" || kernel == "transpose_view" ||
           kernel == "gather_grad" || kernel == "expand") &&
          f32;
      if ((!flagged && !layout) || !f32)
        continue;
      for (Operation *n = op.getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
        auto c = cast<CastOp>(n);
        StringAttr ck = n->getAttrOfType<StringAttr>(kKernelAttr);
        Type to = elementOf(c.getResult());
        if (c.getInput() != op.getResult(0) || !ck ||
            (ck.getValue() != "toBf16" && ck.getValue() != "toF16") ||
            !((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
          continue;
        if (flagged && !op.hasAttr(kRead16Attr))
          op.setAttr(kRead16Attr,
                     DenseBoolArrayAttr::get(ctx, SmallVector<bool>(op.getNumOperands(), false)));
        std::string entry = kernel.str();
        if (kernel == "transpose_view")
          entry = "transpose16_view";
        else if (!kernel.ends_with("16"))
          entry += "16";
        op.setAttr(kKernelAttr, StringAttr::get(ctx, entry));
        n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
        n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
        ++numCopyByWriter;
        break; // one copy per writer
      }
    }
  }

  /// Rule 3h's parameter gradients: a bias gradient's reduction, a norm
  /// gradient's scale or bias gradient, read only by its 16-bit cast
  /// (paramGradCopy16) is written in 16 bits only, by the op that sums it
  /// (reduce16, layer_norm_grad16, rms_norm_grad16; the cast is no call,
  /// marked carve.copy_by_writer). The same bits: the f32 sum rounded to
  /// nearest even.
  void paramGradsByWriter(func::FuncOp fn, const PlanAttrs &plan) {
    MLIRContext *ctx = fn.getContext();
    for (Operation &op : fn.getBody().front().without_terminator()) {
      StringAttr k = op.getAttrOfType<StringAttr>(kKernelAttr);
      if (!k || !isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp, LayerNormGradOp, RmsNormGradOp>(op))
        continue;
      bool any = false;
      for (Value r : op.getResults())
        if (Value c = paramGradCopy16(r, plan)) {
          Operation *cop = c.getDefiningOp();
          cop->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
          cop->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
          ++numCopyByWriter;
          any = true;
        }
      if (!any)
        continue;
      StringRef kernel = k.getValue();
      if (kernel == "reduce") {
        op.setAttr(kKernelAttr, StringAttr::get(ctx, "reduce16"));
        continue;
      }
      if (!op.hasAttr(kRead16Attr))
        op.setAttr(kRead16Attr,
                   DenseBoolArrayAttr::get(ctx, SmallVector<bool>(op.getNumOperands(), false)));
      if (!kernel.ends_with("16"))
        op.setAttr(kKernelAttr, StringAttr::get(ctx, kernel.str() + "16"));
    }
  }

  /// Rule 3f: a 16-bit copy of a fused chain's output (a conversion, toBf16
  /// / toF16), among the copies right after the chain's root, is written by
  /// the chain's kernel as it writes the f32 value (carve.copy_in_fused; the
  /// copy is no call). The same bits: the kernel rounds the value to nearest
  /// even as the conversion does (a value the chain rounds, carve.round16,
  /// is its own copy's value).
  void copiesInFused(func::FuncOp fn, StringRef precision) {
    MLIRContext *ctx = fn.getContext();
    llvm::DenseSet<Value> interior;
    llvm::DenseMap<Operation *, Operation *> rootOf;
    for (const FusionGroup &g : fusionGroups(fn, interior))
      for (Operation *m : g.ops)
        rootOf[m] = g.root;
    for (Operation &op : fn.getBody().front().without_terminator()) {
      auto c = dyn_cast<CastOp>(&op);
      if (!c || !elementOf(c.getInput()).isF32())
        continue;
      Type to = elementOf(c.getResult());
      if (!(precision == "bf16" && to.isBF16()) && !(precision == "fp16" && to.isF16()))
        continue;
      StringAttr k = op.getAttrOfType<StringAttr>(kKernelAttr);
      if (!k || (k.getValue() != "toBf16" && k.getValue() != "toF16"))
        continue;
      Operation *m = c.getInput().getDefiningOp();
      if (!m || !m->hasAttr(kFusionGroupAttr))
        continue;
      Operation *root = rootOf.lookup(m);
      if (!root || root->getBlock() != op.getBlock())
        continue;
      bool adjacent = false;
      for (Operation *n = root->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
        adjacent |= n == &op;
      if (!adjacent)
        continue;
      op.setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
      op.setAttr(kCopyInFusedAttr, UnitAttr::get(ctx));
      ++numCopyInFused;
    }
  }

  /// Rule 3i: a bias gradient's reduction summed by its weight gradient's
  /// GEMM (cuBLASLt's BGRADA/BGRADB epilogue; Passes.td says when).
  void biasGradsInGemms(func::FuncOp fn, const PlanAttrs &plan) {
    MLIRContext *ctx = fn.getContext();
    Block &block = fn.getBody().front();
    // `v` through reshapes back to the value they view.
    auto source = [](Value v) {
      while (auto r = v.getDefiningOp<ReshapeOp>())
        v = r.getInput();
      return v;
    };
    // A matmul's operand k as stored: through a transpose folded into the
    // call's flag (carve.fold = "operand").
    auto stored = [](Operation *mm, unsigned k, bool &trans) {
      Value v = mm->getOperand(k);
      auto t = v.getDefiningOp<TransposeOp>();
      trans = t && foldOf(t) == kFoldOperand;
      return trans ? t.getInput() : v;
    };
    // The weight gradients' GEMMs by the values their operands view, in
    // program order: a reduction looks at those that read its input only
    // (not at the whole block, once per reduction).
    llvm::DenseMap<Value, SmallVector<Operation *, 2>> gemmsReading;
    for (Operation &g : block.without_terminator()) {
      StringAttr gk = g.getAttrOfType<StringAttr>(kKernelAttr);
      if (!gk || gk.getValue() != "matmul16_to16" || !g.hasAttr(kWrite16Attr))
        continue;
      Operation *mm = isa<MatmulOp>(&g) ? &g : g.getOperand(0).getDefiningOp();
      if (!mm || !isa<MatmulOp>(mm))
        continue;
      bool t0, t1;
      Value a = source(stored(mm, 0, t0)), b = source(stored(mm, 1, t1));
      gemmsReading[a].push_back(&g);
      if (b != a)
        gemmsReading[b].push_back(&g);
    }
    for (Operation &op : block.without_terminator()) {
      auto r = dyn_cast<ReduceSumOp>(&op);
      StringAttr rk = op.getAttrOfType<StringAttr>(kKernelAttr);
      if (!r || !rk || rk.getValue() != "reduce16")
        continue;
      auto xt = dyn_cast<RankedTensorType>(r.getInput().getType());
      if (!xt || !xt.hasStaticShape() || xt.getRank() < 2 || !xt.getElementType().isF32())
        continue;
      ArrayRef<int64_t> axes = op.getAttrOfType<DenseI64ArrayAttr>("axes").asArrayRef();
      SmallVector<int64_t> leading(axes.begin(), axes.end());
      llvm::sort(leading);
      bool allButLast = (int64_t)leading.size() == xt.getRank() - 1;
      for (size_t i = 0; allButLast && i < leading.size(); ++i)
        allButLast = leading[i] == (int64_t)i;
      if (!allButLast)
        continue;
      Value grad16 = paramGradCopy16(r.getResult(), plan);
      if (!grad16 || !grad16.getDefiningOp()->hasAttr(kCopyByWriterAttr))
        continue;
      const int64_t n = xt.getShape().back(), k = xt.getNumElements() / std::max<int64_t>(n, 1);
      Value v = source(r.getInput());
      // The weight gradient's GEMM that reads v as its [K, N] 16-bit operand.
      Operation *gemm = nullptr;
      int biasOf = -1;
      auto readers = gemmsReading.find(v);
      for (Operation *gp : readers == gemmsReading.end() ? ArrayRef<Operation *>()
                                                         : ArrayRef<Operation *>(readers->second)) {
        Operation &g = *gp;
        StringAttr gk = g.getAttrOfType<StringAttr>(kKernelAttr);
        if (!gk || gk.getValue() != "matmul16_to16" || !g.hasAttr(kWrite16Attr) ||
            !op.isBeforeInBlock(&g))
          continue;
        auto flags = g.getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
        if (!flags || flags.size() != 2 || !flags[0] || !flags[1])
          continue;
        Operation *mm = isa<MatmulOp>(&g) ? &g : g.getOperand(0).getDefiningOp();
        if (!mm || !isa<MatmulOp>(mm))
          continue;
        bool t0, t1;
        Value s0 = stored(mm, 0, t0), s1 = stored(mm, 1, t1);
        // The call's (a, transA, b, transB): the matmul's, or for a
        // product's transpose (b^T a^T) the other way round.
        const bool product = !isa<MatmulOp>(&g);
        Value ca = product ? s1 : s0, cb = product ? s0 : s1;
        const bool ta = product ? !t1 : t0, tb = product ? !t0 : t1;
        auto at = dyn_cast<RankedTensorType>(ca.getType()),
             bt = dyn_cast<RankedTensorType>(cb.getType());
        if (!ta || tb || !at || !bt || at.getRank() != 2 || bt.getRank() != 2 ||
            at.getShape()[0] != k || bt.getShape()[0] != k)
          continue;
        for (int which = 0; which < 2 && biasOf < 0; ++which) {
          Value c = which == 0 ? ca : cb;
          if (source(c) == v && cast<RankedTensorType>(c.getType()).getShape()[1] == n)
            biasOf = which;
        }
        if (biasOf >= 0) {
          gemm = &g;
          break;
        }
      }
      if (!gemm)
        continue;
      // The GEMM writes the gradient later than the reduction did: nothing
      // may read it in between (a bucket's all-reduce, an accumulation).
      bool late = false;
      for (Operation *u : grad16.getUsers())
        late |= u->getBlock() != gemm->getBlock() || !gemm->isBeforeInBlock(u);
      if (late)
        continue;
      gemm->setAttr(kKernelAttr, StringAttr::get(ctx, "matmul16_to16_bgrad"));
      gemm->setAttr(kBiasGradOfAttr, IntegerAttr::get(IntegerType::get(ctx, 64), biasOf));
      op.setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
      op.setAttr(kBiasGradInGemmAttr, UnitAttr::get(ctx));
      op.removeAttr(kRead16Attr);
      ++numBiasGradInGemm;
    }
  }

  /// Rule 3j: a cross-entropy's loss computed by its gradient's call
  /// (cross_entropy_with_grad; Passes.td says when).
  void lossesInGradients(func::FuncOp fn) {
    MLIRContext *ctx = fn.getContext();
    // The tensor a logits operand reads: through reshapes, views of 16-bit
    // tensors (16 -> 32-bit casts) and 16-bit copies (32 -> 16).
    auto base = [](Value v) {
      for (;;) {
        if (auto r = v.getDefiningOp<ReshapeOp>()) {
          v = r.getInput();
          continue;
        }
        if (auto c = v.getDefiningOp<CastOp>()) {
          Type from = elementOf(c.getInput()), to = elementOf(c.getResult());
          if (((from.isBF16() || from.isF16()) && to.isF32()) ||
              (from.isF32() && (to.isBF16() || to.isF16()))) {
            v = c.getInput();
            continue;
          }
        }
        return v;
      }
    };
    auto kernel = [](Operation *op) {
      auto k = op->getAttrOfType<StringAttr>(kKernelAttr);
      return k ? k.getValue() : StringRef();
    };
    auto reads16 = [](Operation *op) {
      auto f = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      return f && f.size() == 1 && f[0];
    };
    for (Operation &op : fn.getBody().front().without_terminator()) {
      auto g = dyn_cast<CrossEntropyGradOp>(&op);
      if (!g || (kernel(g) != "cross_entropy_grad" && kernel(g) != "cross_entropy_grad16"))
        continue;
      Operation *f = nullptr;
      for (Operation *p = op.getPrevNode(); p; p = p->getPrevNode()) {
        if (isa<CrossEntropyOp>(p)) {
          f = p;
          break;
        }
        if (kernel(p) != kNoKernel)
          break;
      }
      if (!f || (kernel(f) != "cross_entropy" && kernel(f) != "cross_entropy16") ||
          f->getOperand(1) != g->getOperand(1) ||
          f->getAttr("ignore_index") != g->getAttr("ignore_index") ||
          f->getAttr("reduction") != g->getAttr("reduction") ||
          base(f->getOperand(0)) != base(g->getOperand(0)) ||
          (kernel(f) == "cross_entropy16" && reads16(f)) != reads16(g))
        continue;
      if (Operation *d = g->getOperand(2).getDefiningOp(); d && !d->isBeforeInBlock(f))
        continue;
      if (!g->hasAttr(kRead16Attr))
        g->setAttr(kRead16Attr, DenseBoolArrayAttr::get(ctx, {false}));
      g->setAttr(kKernelAttr, StringAttr::get(ctx, "cross_entropy_with_grad"));
      f->setAttr(kLossInGradAttr, UnitAttr::get(ctx));
      ++numLossInGrad;
    }
  }

  /// Rule 3d: a 16-bit copy (a cast from f32 to the plan's format) right
  /// after the op that wrote its input, where that op's carve.round16 would
  /// be a rounding kernel of its own (not a cast, not a fused chain's, an op
  /// that runs a call), rounds the input in place and writes the copy in one
  /// kernel (`roundCopyBf16` / `roundCopyF16`); the op is marked
  /// carve.round16_in_copy. The same bits in both.
  void roundInCopies(func::FuncOp fn, StringRef precision) {
    MLIRContext *ctx = fn.getContext();
    for (Operation &op : fn.getBody().front().without_terminator()) {
      auto c = dyn_cast<CastOp>(&op);
      if (!c || !elementOf(c.getInput()).isF32())
        continue;
      Type to = elementOf(c.getResult()); // the plan's format: what carve.round16 rounds to
      if (!(precision == "bf16" && to.isBF16()) && !(precision == "fp16" && to.isF16()))
        continue;
      StringAttr k = op.getAttrOfType<StringAttr>(kKernelAttr);
      if (!k || (k.getValue() != "toBf16" && k.getValue() != "toF16"))
        continue;
      Operation *def = c.getInput().getDefiningOp();
      if (!def || def->getNextNode() != &op || !def->hasAttr(kRound16Attr) || isa<CastOp>(def) ||
          def->hasAttr(kFusionGroupAttr) || def->getNumResults() != 1 ||
          def->hasAttr(kRound16InCopyAttr) || def->hasAttr(kWrite16Attr))
        continue;
      StringAttr dk = def->getAttrOfType<StringAttr>(kKernelAttr);
      if (!dk || dk.getValue() == kNoKernel)
        continue;
      op.setAttr(kKernelAttr,
                 StringAttr::get(ctx, k.getValue() == "toBf16" ? "roundCopyBf16" : "roundCopyF16"));
      def->setAttr(kRound16InCopyAttr, UnitAttr::get(ctx));
      ++numRoundInCopy;
    }
  }
};

} // namespace

} // namespace carve
