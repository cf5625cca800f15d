//===- ConcatSliceGrads.cpp - sums of slice gradients as one concat --------===//
//
// carve-concat-slice-grads: the gradient of a split tensor, a sum of
// zero-padded slice gradients, becomes one carve.concat (the rules are in
// Passes.td).
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

#include <algorithm>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVECONCATSLICEGRADS
#include "compiler/fusion/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {

/// An add that may be part of a tree: f32 or f64, no attribute (a fusion
/// group, a rounding, an annotation would be lost).
bool plainAdd(Operation *op) {
  auto add = dyn_cast_or_null<AddOp>(op);
  if (!add || !op->getDiscardableAttrDictionary().empty())
    return false;
  Type t = add.getResult().getType();
  Type e = cast<ShapedType>(t).getElementType();
  return (e.isF32() || e.isF64()) && add.getLhs().getType() == t && add.getRhs().getType() == t;
}

/// The leaves of the add tree rooted at `root` (each read only by the
/// tree), with the tree's inner adds; false where a leaf is no
/// slice_grad or an inner add is read outside the tree.
bool collect(AddOp root, SmallVectorImpl<SliceGradOp> &leaves, SmallVectorImpl<Operation *> &adds) {
  SmallVector<Value> work = {root.getLhs(), root.getRhs()};
  adds.push_back(root);
  while (!work.empty()) {
    Value v = work.pop_back_val();
    Operation *d = v.getDefiningOp();
    if (!d || !v.hasOneUse())
      return false;
    if (plainAdd(d)) {
      adds.push_back(d);
      work.push_back(d->getOperand(0));
      work.push_back(d->getOperand(1));
      continue;
    }
    auto sg = dyn_cast<SliceGradOp>(d);
    if (!sg || sg.getType() != root.getType() || !d->getDiscardableAttrDictionary().empty())
      return false;
    leaves.push_back(sg);
  }
  return true;
}

/// The axis along which the leaves tile the result, with the leaves in
/// order along it; -1 where they do not tile it.
int64_t tilingAxis(SmallVectorImpl<SliceGradOp> &leaves) {
  auto type = dyn_cast<RankedTensorType>(leaves.front().getType());
  if (!type || !type.hasStaticShape())
    return -1;
  ArrayRef<int64_t> shape = type.getShape();
  int64_t axis = -1;
  for (SliceGradOp s : leaves) {
    ArrayRef<int64_t> st = s.getStarts(), en = s.getEnds(), sp = s.getSteps();
    if ((int64_t)st.size() != type.getRank() || en.size() != st.size() || sp.size() != st.size())
      return -1;
    for (int64_t i = 0; i < type.getRank(); ++i) {
      if (sp[i] != 1 || st[i] < 0 || en[i] > shape[i] || st[i] >= en[i])
        return -1;
      if (st[i] == 0 && en[i] == shape[i])
        continue;
      if (axis != -1 && axis != i)
        return -1; // parts along two axes
      axis = i;
    }
  }
  if (axis == -1)
    return -1; // every part the whole tensor: a true sum
  llvm::sort(leaves, [&](SliceGradOp a, SliceGradOp b) {
    return a.getStarts()[axis] < b.getStarts()[axis];
  });
  int64_t at = 0;
  for (SliceGradOp s : leaves) {
    if (s.getStarts()[axis] != at)
      return -1; // a gap or an overlap
    at = s.getEnds()[axis];
  }
  return at == shape[axis] ? axis : -1;
}

struct ConcatSliceGradsPass : impl::CarveConcatSliceGradsBase<ConcatSliceGradsPass> {
  void runOnOperation() override {
    for (auto fn : getOperation().getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      // Roots: adds no plain add of a tree reads (taken last to first, so a
      // root is decided before the adds below it).
      SmallVector<AddOp> roots;
      fn.walk([&](AddOp add) {
        if (!plainAdd(add))
          return;
        const bool inner =
            add.getResult().hasOneUse() && plainAdd(*add.getResult().getUsers().begin());
        if (!inner)
          roots.push_back(add);
      });
      for (AddOp root : roots) {
        SmallVector<SliceGradOp> leaves;
        SmallVector<Operation *> adds;
        if (!collect(root, leaves, adds) || leaves.size() < 2)
          continue;
        const int64_t axis = tilingAxis(leaves);
        if (axis < 0)
          continue;
        OpBuilder b(root);
        SmallVector<Value> parts;
        for (SliceGradOp s : leaves)
          parts.push_back(s.getGrad());
        // The parts' gradients are all defined before the root (the adds
        // read the slice gradients, which read them).
        auto cat =
            ConcatOp::create(b, root.getLoc(), root.getType(), parts, b.getI64IntegerAttr(axis));
        root.getResult().replaceAllUsesWith(cat.getResult());
        // The tree's adds, root first, then the leaves.
        for (Operation *a : adds)
          a->dropAllUses(), a->erase();
        for (SliceGradOp s : leaves)
          s->erase();
        ++numConcats;
        numSliceGrads += leaves.size();
      }
    }
  }
};

} // namespace

} // namespace carve
