//===- Operands16.cpp - matmul operands rounded to 16 bits once ------------===//
//
// carve-round-operands16: on the CUDA target under a bf16/fp16 plan, an f32
// value that cuBLAS reads rounded to 16 bits is rounded once, into a 16-bit
// tensor made before its first matmul reader, which every matmul reading it
// then reads as stored (carve-select-kernels' carve.read16); the rules are
// in Passes.td.
//
//===----------------------------------------------------------------------===//

#include "compiler/precision/Precision.h"

#include "compiler/fusion/Fusion.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/MapVector.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEROUNDOPERANDS16
#include "compiler/precision/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

Type elementOf(Value v) { return cast<ShapedType>(v.getType()).getElementType(); }

/// The op that runs matmul `mm` through cuBLAS with its operands rounded to
/// 16 bits (the matmul, or the transpose whose product it is); null for a
/// matmul that runs otherwise (a fused chain's, a convolution's gathered
/// windows, a product a gather_grad scatters).
Operation *cublasRunner(Operation *mm) {
  if (!isa<MatmulOp>(mm) || mm->hasAttr(kFusionGroupAttr) || isScatteredProduct(mm) ||
      gatheredOperand(mm))
    return nullptr;
  if (isProductMatmul(mm))
    return *mm->getUsers().begin();
  return mm;
}

/// A use that reads its value as the 16-bit tensor of its bits (see
/// neverStoredF32), directly or through reshapes and folded transposes.
bool reads16(OpOperand &use, const PlanAttrs &plan) {
  Operation *u = use.getOwner();
  const unsigned k = use.getOperandNumber();
  // carve-fold-views' "strided": cuDNN's attention reads the transpose's
  // elements in place in its source's 16-bit copy.
  if (isa<TransposeOp>(u) && foldOf(u) == kFoldStrided)
    return true;
  // carve-fold-views' "epilogue": its matmul reads the bias as its 16-bit
  // tensor (cuBLASLt's bias epilogue).
  if (Value bias; isa<AddOp>(u) && epilogueMatmulOf(u, &bias))
    return use.get() == bias;
  // And a GELU gradient marked so: its matmul reads the pre-activation as
  // its 16-bit tensor (cuBLASLt's DGELU auxiliary input).
  if (isa<UnaryGradOp>(u) && epilogueMatmulOf(u))
    return k == 0;
  // A GELU marked so reads its input in the matmul's epilogue, from the
  // fp32 accumulator (cuBLASLt's GELU_AUX_BIAS): never from memory.
  if (isa<GeluOp>(u) && epilogueMatmulOf(u))
    return true;
  if (isa<ReshapeOp>(u) || (isa<SliceOp>(u) && foldOf(u) == kFoldView) ||
      (isa<TransposeOp>(u) && (foldOf(u) == kFoldOperand || foldOf(u) == kFoldConsumer))) {
    Value r = u->getResult(0);
    return !r.use_empty() &&
           llvm::all_of(r.getUses(), [&](OpOperand &x) { return reads16(x, plan); });
  }
  if (isa<MatmulOp>(u))
    return k < 2 && !u->hasAttr(kFusionGroupAttr) && !isScatteredProduct(u) && !gatheredOperand(u);
  if (isa<CrossEntropyOp, CrossEntropyGradOp>(u))
    return k == 0 && !u->getAttrOfType<IntegerAttr>(kShardedRowsAttr);
  // cuDNN's convolutions round both operands to 16 bits (conv_cudnn.cpp).
  if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(u))
    return k < 2 && plan.target == "cuda";
  // cuDNN's gradient: q, k, v, o where the forward wrote it in 16 bits, and
  // dy (which it rounds to 16 bits: its copy holds those bits).
  if (isa<AttentionGradStatsOp>(u))
    return (k < 3 || (k == 3 && outputCopy16(u->getOperand(3))) || k == 5) &&
           plan.target == "cuda" && cudnnAttentionRefusal(u, plan).empty();
  // cuDNN's forward reads q, k, v as their 16-bit copies made before it
  // (carve-select-kernels' rule 3c).
  if (isa<AttentionStatsOp>(u))
    return k < 3 && plan.target == "cuda" && cudnnAttentionRefusal(u, plan).empty() &&
           copy16BeforeView(u->getOperand(k), u, plan.precision);
  return readsExact16(u, k, plan);
}

bool isF32Tensor(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && t.getElementType().isF32();
}

} // namespace

bool readsExact16(Operation *u, unsigned k, const PlanAttrs &plan) {
  if (plan.target != "cuda" || plan.precision == "fp32" || k >= u->getNumOperands() ||
      u->getNumResults() == 0 || !isF32Tensor(u->getOperand(k)) || !isF32Tensor(u->getResult(0)))
    return false;
  if (!foldOf(u).empty() || isGatheredOperand(u))
    return false; // no call of its own: its reader reads its operands
  bool position = false;
  if (Attribute group = u->getAttr(kFusionGroupAttr)) {
    // A fused chain's input: an operand no member of the chain writes.
    if (!isa<AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp, NegOp, AbsOp, ExpOp, LogOp, SqrtOp,
             RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp, ReluOp, SinOp, CosOp, SiluOp, GeluOp,
             UnaryGradOp>(u))
      return false;
    Operation *d = u->getOperand(k).getDefiningOp();
    position = !d || d->getAttr(kFusionGroupAttr) != group;
  } else if (isa<LayerNormOp, RmsNormOp>(u)) {
    position = true; // the input, the scale and the bias
  } else if (isa<LayerNormGradOp, RmsNormGradOp>(u)) {
    position = k == 0 || k == 2; // the input and the scale (not the gradient)
  } else if (isa<UnaryGradOp, RotaryOp, RotaryGradOp>(u)) {
    position = k == 0; // (rotary's x or dy: not the cos and sin tables)
  } else if (binaryKernel(u)) {
    position = k < 2;
  } else if (isa<GatherOp>(u)) {
    position = k == 0 && !u->getAttrOfType<IntegerAttr>(kShardedRowsAttr);
  } else if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(u)) {
    position = k == 0; // the sums and maxima are taken in f64 of the widened values
  }
  return position && exact16(u->getOperand(k), u, plan.precision);
}

Value paramGradCopy16(Value v, const PlanAttrs &plan) {
  if (plan.target != "cuda" || plan.precision == "fp32")
    return Value();
  auto t = dyn_cast<RankedTensorType>(v.getType());
  auto r = dyn_cast<OpResult>(v);
  if (!t || !t.getElementType().isF32() || t.getNumElements() == 0 || !r)
    return Value();
  Operation *w = r.getOwner();
  const unsigned k = r.getResultNumber();
  const bool reduction = isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(w) && k == 0;
  const bool norm =
      (isa<LayerNormGradOp>(w) && (k == 1 || k == 2)) || (isa<RmsNormGradOp>(w) && k == 1);
  if ((!reduction && !norm) || w->hasAttr(kFusionGroupAttr) || !foldOf(w).empty())
    return Value();
  auto is16 = [&](Type e) {
    return (plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16());
  };
  // The value, through reshapes that are its only readers, read by one
  // 16-bit cast; the reshapes and the cast among the ops right after the
  // writer (casts of its other results, reshapes), so that the cast's
  // result lives from the writer (carve-plan-memory).
  Value u = v;
  while (u.hasOneUse() && isa<ReshapeOp>(*u.getUsers().begin()))
    u = u.getUsers().begin()->getResult(0);
  if (!u.hasOneUse())
    return Value();
  auto c = dyn_cast<CastOp>(*u.getUsers().begin());
  if (!c || !is16(cast<ShapedType>(c.getType()).getElementType()))
    return Value();
  for (Operation *n = w->getNextNode(); n && isa<CastOp, ReshapeOp>(n); n = n->getNextNode())
    if (n == c.getOperation())
      return c.getResult();
  return Value();
}

Value logitsOverwrittenBy(Value copy, const PlanAttrs &plan) {
  if (plan.target != "cuda" || (plan.precision != "bf16" && plan.precision != "fp16"))
    return Value();
  auto c = copy.getDefiningOp<CastOp>();
  if (!c)
    return Value();
  auto w = c.getInput().getDefiningOp<CrossEntropyGradOp>();
  auto lt = w ? dyn_cast<RankedTensorType>(w.getOperand(0).getType()) : RankedTensorType();
  Type e = elementOf(copy);
  if (!w || w->getNextNode() != c.getOperation() ||
      w->getAttrOfType<IntegerAttr>(kShardedRowsAttr) || !lt || lt.getRank() != 2 ||
      !((plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16())) ||
      !neverStoredF32(c.getInput(), plan))
    return Value();
  Value l16 = stored16(w.getOperand(0), w, plan.precision);
  auto numel = [](Value v) { return cast<RankedTensorType>(v.getType()).getNumElements(); };
  if (!l16 || elementOf(l16) != e || numel(l16) != numel(copy))
    return Value();
  return l16;
}

bool neverStoredF32(Value v, const PlanAttrs &plan) {
  if (plan.target != "cuda" || plan.precision == "fp32")
    return false;
  auto t = dyn_cast<RankedTensorType>(v.getType());
  if (!t || !t.getElementType().isF32() || t.getNumElements() == 0)
    return false;
  auto is16 = [&](Type e) {
    return (plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16());
  };
  Operation *w = v.getDefiningOp();
  if (Value copy = paramGradCopy16(v, plan))
    return true; // its writer writes only the copy (rule 3h)
  // carve-fold-views' "producer" on O's transpose: cuDNN's forward writes O
  // in 16 bits into the transpose's copy, and the gradients read it there.
  if (outputCopy16(v))
    return llvm::all_of(v.getUses(), [&](OpOperand &u) {
      return (isa<TransposeOp>(u.getOwner()) && foldOf(u.getOwner()) == kFoldProducer) ||
             reads16(u, plan);
    });
  // Whether the first 16-bit cast of v among the casts right after w exists
  // and every other reader of v reads it (w writes that copy alone).
  auto copyReadAlone = [&] {
    for (Operation *n = w->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
      auto c = cast<CastOp>(n);
      if (c.getInput() != v || !is16(elementOf(c.getResult())))
        continue;
      return llvm::all_of(v.getUses(),
                          [&](OpOperand &u) { return u.getOwner() == n || reads16(u, plan); });
    }
    return false;
  };
  if (w && isa<TransposeOp>(w) && foldOf(w) == kFoldProducer && producerOf(w) &&
      isa<AttentionStatsOp>(producerOf(w)))
    return copyReadAlone();
  // cuDNN's attention gradient writes dq, dk, dv in 16 bits into their
  // copies among the casts right after it (all three: carve-select-kernels'
  // rule 3h): no f32 value where the copy is its only reader.
  if (w && isa<AttentionGradStatsOp>(w)) {
    if (!v.hasOneUse() || !cudnnAttentionRefusal(w, plan).empty())
      return false;
    int copies = 0;
    for (Operation *n = w->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
      for (unsigned i = 0; i < 3; ++i)
        copies += n->getOperand(0) == w->getResult(i) && is16(elementOf(n->getResult(0)));
    return copies == 3 && isa<CastOp>(*v.getUsers().begin());
  }
  if (!w || w->getNumResults() != 1)
    return false;
  // carve-fold-views' "assemble": cuDNN's attention gradient writes the
  // pieces (its dq, dk, dv transposes) in 16 bits into the concat's copy.
  if (int64_t column; assembledInto(w, column))
    return true;
  if (isa<ConcatOp>(w) && foldOf(w) == kFoldAssemble)
    return copyReadAlone();
  if (Attribute group = w->getAttr(kFusionGroupAttr)) {
    // A fused chain's output that the chain rounds, read outside the chain
    // only by 16-bit copies among those right after the chain's root and by
    // ops that read it as such a copy (a matmul's carve.read16): the
    // chain's kernel writes the copies (rule 3f) and no f32 value.
    if (!w->hasAttr(kRound16Attr))
      return false;
    bool copied = false;
    for (OpOperand &use : v.getUses()) {
      Operation *o = use.getOwner();
      if (o->getAttr(kFusionGroupAttr) == group)
        continue; // read in registers by the chain
      auto c = dyn_cast<CastOp>(o);
      if (!c && reads16(use, plan))
        continue; // reads the copy
      if (!c || !is16(elementOf(c.getResult())))
        return false;
      Operation *root = o->getPrevNode();
      while (root && isa<CastOp>(root) && !root->hasAttr(kFusionGroupAttr))
        root = root->getPrevNode();
      if (!root || root->getAttr(kFusionGroupAttr) != group)
        return false;
      // Not the chain's root: a member after it. Every member but the root
      // writes an operand of another member (carve-fuse-elementwise joins
      // an op by that), and members after the root there are none: the
      // root is the member no member reads.
      if (llvm::any_of(root->getUsers(),
                       [&](Operation *u) { return u->getAttr(kFusionGroupAttr) == group; }))
        return false;
      copied = true;
    }
    return copied;
  }
  if (auto c = dyn_cast<CastOp>(w)) { // a view
    if (!is16(elementOf(c.getInput())))
      return false;
    return !v.use_empty() &&
           llvm::all_of(v.getUses(), [&](OpOperand &u) { return reads16(u, plan); });
  }
  const bool mm = (isa<MatmulOp>(w) && !w->hasAttr(kFusionGroupAttr) && !isScatteredProduct(w) &&
                   !gatheredOperand(w) && !isProductMatmul(w)) ||
                  (isa<TransposeOp>(w) && foldOf(w) == kFoldProduct);
  const bool ce = isa<CrossEntropyGradOp>(w) && !w->getAttrOfType<IntegerAttr>(kShardedRowsAttr);
  // Rule 3h's writers: the first 16-bit copy among the casts right after
  // them is written by the op (carve.copy_by_writer).
  // (An add marked "epilogue": its matmul writes the copy.)
  const bool byWriter =
      !w->hasAttr(kFusionGroupAttr) && (foldOf(w).empty() || foldOf(w) == kFoldEpilogue) &&
      !isGatheredOperand(w) &&
      (binaryKernel(w) || isa<UnaryGradOp, LayerNormOp, RmsNormOp, ConcatOp, TransposeOp, RotaryOp,
                              RotaryGradOp, Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(w));
  if (byWriter)
    return copyReadAlone();
  // A GELU its matmul computes ("epilogue"): the matmul writes its copy.
  if (isa<GeluOp>(w) && foldOf(w) == kFoldEpilogue)
    return copyReadAlone();
  if (!mm && !ce) // (vocab-parallel cross-entropy writes f32)
    return false;
  auto copy = dyn_cast_or_null<CastOp>(w->getNextNode());
  if (!copy || copy.getInput() != v || !is16(elementOf(copy.getResult())))
    return false;
  return llvm::all_of(v.getUses(), [&](OpOperand &u) {
    return u.getOwner() == copy.getOperation() || reads16(u, plan);
  });
}

namespace {

/// Whether every reader of `v` (an attention gradient's dq, dk or dv),
/// through reshapes, reads that operand as its 16-bit tensor where one
/// exists (readsExact16's positions, not a folded op): then `v` can be kept
/// as a 16-bit copy alone.
bool gradReadableAs16(Value v) {
  if (v.use_empty())
    return false;
  for (OpOperand &use : v.getUses()) {
    Operation *u = use.getOwner();
    const unsigned k = use.getOperandNumber();
    if (isa<ReshapeOp>(u)) {
      if (!foldOf(u).empty() || !gradReadableAs16(u->getResult(0)))
        return false;
      continue;
    }
    if (!foldOf(u).empty() || isGatheredOperand(u) || u->getNumResults() == 0 ||
        !isF32Tensor(u->getResult(0)))
      return false;
    bool position = false;
    if (u->getAttr(kFusionGroupAttr))
      position = isa<AddOp, SubOp, MulOp, DivOp, NegOp>(u);
    else if (isa<UnaryGradOp, RotaryOp, RotaryGradOp>(u))
      position = k == 0;
    else if (binaryKernel(u))
      position = k < 2;
    else if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(u))
      position = k == 0;
    if (!position)
      return false;
  }
  return true;
}

struct RoundOperands16Pass : carve::impl::CarveRoundOperands16Base<RoundOperands16Pass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (plan->target != "cuda" || plan->precision == "fp32")
      return;
    MLIRContext *ctx = module.getContext();
    Type f16 = plan->precision == "bf16" ? Type(BFloat16Type::get(ctx)) : Float16Type::get(ctx);
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      Block &body = fn.getBody().front();
      // cuDNN's convolutions compute their result in 16 bits (the call widens
      // it): rounded as written (carve.round16), and where a reader reads it
      // as a 16-bit tensor and no 16-bit copy of it exists, a copy right
      // after the convolution, which the call writes itself (carve-select-
      // kernels' rule 3h).
      for (Operation &op : llvm::make_early_inc_range(body.without_terminator())) {
        if (!isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(&op) ||
            !isF32Tensor(op.getResult(0)))
          continue;
        op.setAttr(kRound16Attr, UnitAttr::get(ctx));
        Value r = op.getResult(0);
        if (llvm::any_of(r.getUsers(), [&](Operation *u) {
              auto c = dyn_cast<CastOp>(u);
              return c && elementOf(c.getResult()) == f16;
            }))
          continue; // copied already (the copy moves right after it below)
        // A reader that computes in f32 reads the copy only where one exists
        // (readsExact16): the copy is made, and kept where one would.
        OpBuilder cb(ctx);
        cb.setInsertionPointAfter(&op);
        auto t = cast<RankedTensorType>(r.getType());
        auto copy = CastOp::create(
            cb,
            NameLoc::get(cb.getStringAttr(nodeName(op.getLoc()) + " (16-bit result)"), op.getLoc()),
            RankedTensorType::get(t.getShape(), f16), r);
        if (llvm::none_of(r.getUses(), [&](OpOperand &u) {
              return u.getOwner() != copy.getOperation() && reads16(u, *plan);
            })) {
          copy->erase();
          continue;
        }
        ++numCasts;
      }
      ProgramOrder order(fn);
      const int64_t backwardBegin = order.backwardBegin(true);
      // Each f32 value (through reshapes) that a cuBLAS matmul rounds, with
      // the ops that run those matmuls, in block order of the first.
      llvm::MapVector<Value, SmallVector<Operation *>> readers;
      for (Operation &op : body.without_terminator()) {
        Operation *mm = isa<MatmulOp>(&op) ? &op : nullptr;
        if (isa<TransposeOp>(&op) && foldOf(&op) == kFoldProduct)
          mm = op.getOperand(0).getDefiningOp();
        // cuDNN's convolutions round both operands as cuBLAS does.
        const bool conv = isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(&op);
        if (!conv && (!mm || cublasRunner(mm) != &op))
          continue;
        for (unsigned k = 0; k < 2; ++k) {
          Value v = aliasRoot(conv ? op.getOperand(k) : readOperand(mm, k));
          auto t = dyn_cast<RankedTensorType>(v.getType());
          if (!t || !t.getElementType().isF32() || !t.hasStaticShape() || t.getNumElements() == 0)
            continue;
          // A view of a 16-bit tensor is read as that tensor already.
          if (auto c = v.getDefiningOp<CastOp>(); c && !elementOf(c.getInput()).isF32())
            continue;
          auto &list = readers[v];
          if (list.empty() || list.back() != &op)
            list.push_back(&op);
        }
      }
      // A bias add of a matmul's product (biasedMatmul) that heads a fused
      // chain, rounded as written, with a 16-bit copy and no reader outside
      // the chain but copies: out of the chain, so that carve-fold-views'
      // "epilogue" has the matmul add the bias as it writes the copy (the
      // loop below moves the copy right after it); the chain reads the copy
      // (rule 3g). The same bits: the chain read the rounded sum.
      for (Operation &op : body.without_terminator()) {
        Attribute group = op.getAttr(kFusionGroupAttr);
        if (!group || !op.hasAttr(kRound16Attr) || !biasedMatmul(&op, plan->precision))
          continue;
        bool copied = false, inside = true;
        for (Operation *u : op.getResult(0).getUsers()) {
          if (auto c = dyn_cast<CastOp>(u); c && elementOf(c.getResult()) == f16)
            copied = true;
          else if (u->getAttr(kFusionGroupAttr) != group)
            inside = false;
        }
        if (!copied || !inside)
          continue;
        op.removeAttr(kFusionGroupAttr);
        ++numUnfused;
      }
      // The 16-bit copy of a value its writer rounds (carve.round16) right
      // after the writer, where carve-select-kernels' rule 3d has the copy
      // do the rounding (or 3f, a fused chain's kernel write it).
      for (Operation &op : llvm::make_early_inc_range(body.without_terminator())) {
        auto c = dyn_cast<CastOp>(&op);
        if (!c || elementOf(c.getResult()) != f16 || !elementOf(c.getInput()).isF32())
          continue;
        Operation *def = c.getInput().getDefiningOp();
        if (!def || def->getBlock() != &body || !def->hasAttr(kRound16Attr) || isa<CastOp>(def) ||
            def->getNumResults() != 1)
          continue;
        // A fused chain's member is written where the chain's kernel runs
        // (its root): the copy goes right after the root, where
        // carve-select-kernels' rule 3f has the chain's kernel write it.
        Operation *at = def->hasAttr(kFusionGroupAttr) ? order.rootOf.lookup(def) : def;
        if (!at || at->getBlock() != &body)
          continue;
        bool placed = false; // already among the copies right after it
        for (Operation *n = at->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
          placed |= n == &op;
        if (placed)
          continue;
        // The first such copy only (a send's and a kept copy: one moves).
        if (llvm::any_of(c.getInput().getUsers(), [&](Operation *u) {
              auto o = dyn_cast<CastOp>(u);
              return o && u != &op && elementOf(o.getResult()) == f16 && u->getBlock() == &body &&
                     u->isBeforeInBlock(&op);
            }))
          continue;
        op.moveAfter(at);
        ++numMoved;
      }
      OpBuilder b(ctx);
      // dy of a cuDNN attention gradient (which rounds it to 16 bits), read
      // through a reshape and its transpose to heads only, written by a
      // matmul run by cuBLAS: its 16-bit copy right after the matmul, which
      // carve-select-kernels' rule 3e has the matmul write instead of the
      // f32 value (carve-fold-views has the gradient read dy in place).
      for (Operation &op : body.without_terminator()) {
        auto g = dyn_cast<AttentionGradStatsOp>(&op);
        if (!g || !cudnnAttentionRefusal(g, *plan).empty())
          continue;
        auto t = g.getGrad().getDefiningOp<TransposeOp>();
        if (!t || !t->hasOneUse() || t.getPerm() != ArrayRef<int64_t>{0, 2, 1, 3})
          continue;
        auto r = t.getInput().getDefiningOp<ReshapeOp>();
        if (!r || !r->hasOneUse())
          continue;
        auto m = r.getInput().getDefiningOp<MatmulOp>();
        if (!m || !m->hasOneUse() || cublasRunner(m) != m.getOperation() || m->getBlock() != &body)
          continue;
        b.setInsertionPointAfter(m);
        auto mt = cast<RankedTensorType>(m.getType());
        Location loc =
            NameLoc::get(b.getStringAttr(nodeName(g->getLoc()) + " (16-bit dy)"), m->getLoc());
        CastOp::create(b, loc, RankedTensorType::get(mt.getShape(), f16), m.getResult());
        ++numCasts;
      }
      // dq, dk and dv of a cuDNN attention gradient whose every reader
      // (through reshapes) reads an f32 operand as its 16-bit tensor where
      // one exists (rule 3g: the rotary embedding's gradient, grouped-query
      // attention's sums over the repeated heads): their 16-bit copies right
      // after the gradient, which cuDNN writes (carve-select-kernels' rule
      // 3h), and the readers read views of the copies. The same values:
      // cuDNN's gradients are 16-bit (the call widened them before).
      for (Operation &op : llvm::make_early_inc_range(body.without_terminator())) {
        auto g = dyn_cast<AttentionGradStatsOp>(&op);
        if (!g || !cudnnAttentionRefusal(g, *plan).empty())
          continue;
        bool all = true;
        for (unsigned i = 0; i < 3 && all; ++i)
          all = gradReadableAs16(g->getResult(i));
        if (!all)
          continue;
        b.setInsertionPointAfter(g);
        Value copies[3];
        for (unsigned i = 0; i < 3; ++i) {
          auto t = cast<RankedTensorType>(g->getResult(i).getType());
          Location loc = NameLoc::get(b.getStringAttr(nodeName(g->getLoc()) + " (16-bit " +
                                                      (i == 0   ? "dq"
                                                       : i == 1 ? "dk"
                                                                : "dv") +
                                                      ")"),
                                      g->getLoc());
          copies[i] =
              CastOp::create(b, loc, RankedTensorType::get(t.getShape(), f16), g->getResult(i));
        }
        for (unsigned i = 0; i < 3; ++i) {
          Value r = g->getResult(i);
          auto view = CastOp::create(b, copies[i].getLoc(), r.getType(), copies[i]);
          r.replaceAllUsesExcept(view.getResult(), copies[i].getDefiningOp());
        }
        numCasts += 3;
      }
      // q, k and v of a cuDNN attention forward that are column slices of
      // one tensor (the QKV projection) that carve-fold-views will have
      // cuDNN read in place (its "strided" rule): the tensor rounded as
      // written (the same values for q, k and v, which round it again) and
      // its 16-bit copy right after its writer, which writes it (rules 3e
      // and 3h) instead of the f32 tensor.
      for (Operation &op : body.without_terminator()) {
        auto a = dyn_cast<AttentionStatsOp>(&op);
        std::optional<InPlaceInputs> in =
            a ? inPlaceInputs(a, *plan, /*marked=*/false) : std::nullopt;
        if (!in || in->existingCopy)
          continue;
        Operation *w = in->writer;
        w->setAttr(kRound16Attr, UnitAttr::get(ctx));
        b.setInsertionPointAfter(w);
        auto t = cast<RankedTensorType>(in->source.getType());
        Location loc =
            NameLoc::get(b.getStringAttr(nodeName(w->getLoc()) + " (16-bit q, k, v)"), w->getLoc());
        CastOp::create(b, loc, RankedTensorType::get(t.getShape(), f16), in->source);
        ++numCasts;
      }
      for (auto &[v, ops] : readers) {
        Operation *first = ops.front();
        // The 16-bit copy carve-pack-activations keeps (or a send's), moved
        // before the first reader where it is after it.
        CastOp copy;
        for (Operation *u : v.getUsers())
          if (auto c = dyn_cast<CastOp>(u); c && c->getBlock() == &body &&
                                            elementOf(c.getResult()) == f16 &&
                                            (!copy || c->isBeforeInBlock(copy)))
            copy = c;
        if (copy) {
          if (!copy->isBeforeInBlock(first)) {
            copy->moveBefore(first);
            ++numMoved;
          }
          numReads += ops.size();
          continue;
        }
        if (ops.size() < 2)
          continue; // rounding into the call's scratch costs the same
        // Not across forward and backward: the copy would be kept from one
        // to the other beside the f32 value.
        if ((order.index.lookup(first) < backwardBegin) !=
            (order.index.lookup(ops.back()) < backwardBegin))
          continue;
        // Right after the op that writes it (carve-select-kernels' rule 3e
        // may have that op write the copy itself), or before the first
        // reader.
        Operation *w = v.getDefiningOp();
        if (w && w->getBlock() == &body && !w->hasAttr(kFusionGroupAttr) &&
            (order.index.lookup(w) < backwardBegin) == (order.index.lookup(first) < backwardBegin))
          b.setInsertionPointAfter(w);
        else
          b.setInsertionPoint(first);
        auto t = cast<RankedTensorType>(v.getType());
        Location loc = NameLoc::get(
            b.getStringAttr(nodeName(first->getLoc()) + " (16-bit operand)"), first->getLoc());
        CastOp::create(b, loc, RankedTensorType::get(t.getShape(), f16), v);
        ++numCasts;
        numReads += ops.size();
      }
    }
  }
};

} // namespace

} // namespace carve
