//===- Activations16.cpp - 16-bit activations under bf16/fp16 plans -------===//
//
// carve-round-activations marks the forward values backward reads as
// rounded to the plan's 16-bit format where they are written;
// carve-pack-activations keeps 16-bit copies of them from forward to
// backward (Passes.td states the rules).
//
//===----------------------------------------------------------------------===//

#include "compiler/precision/Precision.h"

#include "compiler/fusion/Fusion.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/SetVector.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEROUNDACTIVATIONS
#define GEN_PASS_DEF_CARVEPACKACTIVATIONS
#include "compiler/precision/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

bool isF32Tensor(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && t.getElementType().isF32() && t.hasStaticShape();
}

/// Whether `use` is an additive attention mask (kept f32: a large negative
/// mask rounds to -inf).
bool isAttentionMask(OpOperand &use) {
  if (auto a = dyn_cast<AttentionOp>(use.getOwner()))
    return a.getMask() && use.get() == a.getMask() && use.getOperandNumber() == 3;
  if (auto g = dyn_cast<AttentionGradOp>(use.getOwner()))
    return g.getMask() && use.get() == g.getMask() && use.getOperandNumber() == 4;
  return false;
}

/// The 16-bit element type of the plan's precision; null under fp32.
Type format16(MLIRContext *ctx, const std::string &precision) {
  if (precision == "bf16")
    return BFloat16Type::get(ctx);
  if (precision == "fp16")
    return Float16Type::get(ctx);
  return Type();
}

struct RoundActivationsPass : carve::impl::CarveRoundActivationsBase<RoundActivationsPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (!format16(module.getContext(), plan->precision))
      return;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      ProgramOrder order(fn);
      const int64_t backwardBegin = order.backwardBegin(true);
      // The values computed from the batch.
      llvm::DenseSet<Value> data;
      for (BlockArgument a : fn.getArguments())
        if (fn.getArgAttr(a.getArgNumber(), kInputAttr))
          data.insert(a);
      for (Operation *op : order.ops)
        if (llvm::any_of(op->getOperands(), [&](Value v) { return data.count(v); }))
          for (Value r : op->getResults())
            data.insert(r);
      // Values that must stay f32: attention masks, and whatever shares
      // their memory.
      llvm::DenseSet<Operation *> keepF32;
      for (Operation *op : order.ops)
        for (OpOperand &use : op->getOpOperands())
          if (isAttentionMask(use)) {
            Operation *def = use.get().getDefiningOp();
            while (def && isa<ReshapeOp>(def)) {
              keepF32.insert(def);
              def = def->getOperand(0).getDefiningOp();
            }
            if (def)
              keepF32.insert(def);
          }
      for (int64_t i = 0; i < backwardBegin; ++i) {
        Operation *op = order.ops[i];
        if (op->getNumResults() != 1 || isa<ConstantOp>(op))
          continue;
        Value r = op->getResult(0);
        bool backward = llvm::any_of(r.getUsers(), [&](Operation *u) {
          auto it = order.index.find(u);
          return it != order.index.end() && it->second >= backwardBegin;
        });
        if (!backward)
          continue;
        // A reshape shares its input's memory: the source is rounded.
        Operation *def = op;
        while (isa<ReshapeOp>(def)) {
          Operation *in = def->getOperand(0).getDefiningOp();
          if (!in || order.index.lookup(in) >= backwardBegin)
            break;
          def = in;
        }
        if (isa<ReshapeOp, ConstantOp>(def) || def->getNumResults() != 1 || keepF32.count(def))
          continue;
        Value v = def->getResult(0);
        if (!isF32Tensor(v) || !data.count(v) || def->hasAttr(kRound16Attr))
          continue;
        def->setAttr(kRound16Attr, UnitAttr::get(op->getContext()));
        ++numMarked;
      }
    }
  }
};

/// A pipeline stage's forward transfers of rounded activations in 16 bits:
/// a send of a rounded value sends a 16-bit copy of it; a receive marked
/// carve.round16 (its sender rounded the value) receives 16 bits, cast to
/// f32 after the receives that run with it, and that cast is marked in its
/// place (Packer keeps the receive's buffer as its copy). Returns the bytes
/// each micro-batch no longer sends.
int64_t sendsAndReceives(func::FuncOp fn, Type f16) {
  ProgramOrder order(fn);
  const int64_t backwardBegin = order.backwardBegin(true);
  int64_t saved = 0;
  for (int64_t i = 0; i < backwardBegin; ++i) {
    Operation *op = order.ops[i];
    OpBuilder b(op);
    if (auto send = dyn_cast<dist::SendOp>(op)) {
      Value v = send.getInput();
      if (!isF32Tensor(v) || !isRounded16(v))
        continue;
      auto t = cast<RankedTensorType>(v.getType());
      Location loc = NameLoc::get(
          b.getStringAttr(nodeName(op->getLoc()) + " (16-bit copy to send)"), op->getLoc());
      Value copy = CastOp::create(b, loc, RankedTensorType::get(t.getShape(), f16), v);
      send->setOperand(0, copy);
      saved += t.getNumElements() * 2;
    } else if (auto recv = dyn_cast<dist::RecvOp>(op)) {
      Value r = recv.getResult();
      if (!op->hasAttr(kRound16Attr) || !isF32Tensor(r))
        continue;
      auto t = cast<RankedTensorType>(r.getType());
      r.setType(RankedTensorType::get(t.getShape(), f16));
      op->removeAttr(kRound16Attr);
      // After the receives posted with this one (they are waited for
      // together, before the first op that is not a receive).
      int64_t k = i + 1;
      while (k < (int64_t)order.ops.size() && isa<dist::RecvOp>(order.ops[k]))
        ++k;
      b.setInsertionPoint(k < (int64_t)order.ops.size() ? order.ops[k]
                                                        : fn.getBody().front().getTerminator());
      auto back = CastOp::create(b, op->getLoc(), t, r);
      back->setAttr(kRound16Attr, b.getUnitAttr());
      r.replaceAllUsesExcept(back.getResult(), back);
    }
  }
  return saved;
}

/// One function's rounded forward values and their 16-bit copies.
class Packer {
public:
  Packer(func::FuncOp fn, Type f16, const PlanAttrs &plan)
      : fn(fn), f16(f16), plan(plan), order(fn) {
    backwardBegin = order.backwardBegin(true);
  }

  /// Packs every rounded forward value that backward reads; returns the
  /// number packed and adds the f32 bytes no longer kept to `saved`.
  int run(int64_t &saved) {
    int packed = 0;
    Operation *ret = fn.getBody().front().getTerminator();
    std::vector<Operation *> ops(order.ops.begin(), order.ops.begin() + backwardBegin);
    for (Operation *op : ops) {
      if (op->getNumResults() != 1 || isa<ReshapeOp>(op))
        continue;
      Value root = op->getResult(0);
      // A gather its matmuls gather themselves (carve.fold = "gather") is
      // never in memory: its table is kept instead, and nothing is copied.
      if (!isF32Tensor(root) || foldOf(op) == kFoldOperand || foldOf(op) == kFoldGather ||
          !op->hasAttr(kRound16Attr))
        continue;
      // A received 16-bit activation (sendsAndReceives): the receive's
      // buffer is the copy backward reads.
      Value received;
      if (isa<CastOp>(op) && !isF32Tensor(op->getOperand(0)))
        received = op->getOperand(0);
      // The root and the forward reshapes sharing its memory.
      llvm::SetVector<Value> alias;
      alias.insert(root);
      for (size_t k = 0; k < alias.size(); ++k)
        for (Operation *u : alias[k].getUsers())
          if (isa<ReshapeOp>(u) && isForward(u))
            alias.insert(u->getResult(0));
      int64_t last = order.readAt(op), first = -1;
      bool refuse = false, backward = false;
      for (Value a : alias)
        for (Operation *u : a.getUsers()) {
          if (u == ret || isa<dist::SendOp>(u) || foldOf(u) == kFoldOperand) {
            refuse = true;
            continue;
          }
          if (isForward(u)) {
            last = std::max(last, order.readAt(u));
          } else {
            backward = true;
            int64_t i = order.index.lookup(u);
            first = first < 0 ? i : std::min(first, i);
          }
        }
      if (refuse || !backward || last >= first)
        continue;
      auto t = cast<RankedTensorType>(root.getType());
      std::string node = nodeName(op->getLoc());
      OpBuilder b(op->getContext());
      // A copy that cuDNN's attention (its last forward reader, as q, k or
      // v) reads as stored is made just before it; any other just after
      // the last forward reader.
      Operation *lastReader = order.ops[last];
      bool beforeAttention = false;
      if (isa<AttentionStatsOp>(lastReader) && cudnnAttentionRefusal(lastReader, plan).empty())
        for (unsigned k = 0; k < 3; ++k)
          beforeAttention |= alias.contains(lastReader->getOperand(k));
      if (beforeAttention)
        b.setInsertionPoint(lastReader);
      else
        b.setInsertionPointAfter(lastReader);
      Location fwdLoc = NameLoc::get(b.getStringAttr(node + " (16-bit copy)"), op->getLoc());
      Value copy = received
                       ? received
                       : CastOp::create(b, fwdLoc, RankedTensorType::get(t.getShape(), f16), root)
                             .getResult();
      b.setInsertionPoint(order.ops[first]);
      Location bwdLoc = NameLoc::get(
          b.getStringAttr(std::string(kBackwardPrefix) + node + " (16-bit copy)"), op->getLoc());
      Value back = CastOp::create(b, bwdLoc, t, copy).getResult();
      for (Value a : alias) {
        Value with = back;
        if (a != root)
          with = ReshapeOp::create(b, bwdLoc, a.getType(), back).getResult();
        a.replaceUsesWithIf(with, [&](OpOperand &use) {
          Operation *u = use.getOwner();
          return u != with.getDefiningOp() && u != back.getDefiningOp() &&
                 u != copy.getDefiningOp() && !isForward(u) && order.index.count(u);
        });
      }
      if (!received)
        saved += t.getNumElements() * 4;
      ++packed;
    }
    return packed;
  }

private:
  bool isForward(Operation *op) const {
    auto it = order.index.find(op);
    return it != order.index.end() && it->second < backwardBegin;
  }

  func::FuncOp fn;
  Type f16;
  const PlanAttrs &plan;
  ProgramOrder order;
  int64_t backwardBegin = 0;
};

struct PackActivationsPass : carve::impl::CarvePackActivationsBase<PackActivationsPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    Type f16 = format16(module.getContext(), plan->precision);
    if (!f16)
      return;
    int64_t saved = 0, sent = 0;
    for (auto fn : module.getOps<func::FuncOp>())
      if (isEmittedFunction(fn)) {
        sent += sendsAndReceives(fn, f16);
        numPacked += Packer(fn, f16, *plan).run(saved);
      }
    numBytesSaved += saved;
    numSendBytesSaved += sent;
  }
};

} // namespace

} // namespace carve
