//===- FoldTransposes.cpp - carve-fold-transposes -------------------------===//
//
// The rules are in Passes.td; the emitter (compiler/codegen) reads
// carve.fold back with foldedTransposes.
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEFOLDTRANSPOSES
#include "compiler/fusion/Passes.h.inc"
} // namespace carve

namespace carve {

bool swapsLastTwo(TransposeOp t) {
  ArrayRef<int64_t> p = t.getPerm();
  int64_t r = (int64_t)p.size();
  if (r < 2)
    return false;
  for (int64_t i = 0; i < r - 2; ++i)
    if (p[i] != i)
      return false;
  return p[r - 2] == r - 1 && p[r - 1] == r - 2;
}

StringRef foldOf(Operation *op) {
  auto a = op->getAttrOfType<StringAttr>(kFoldAttr);
  return a ? a.getValue() : StringRef();
}

Value readOperand(Operation *op, unsigned k) {
  Value v = op->getOperand(k);
  Operation *d = v.getDefiningOp();
  return d && isa<MatmulOp>(op) && foldOf(d) == kFoldOperand ? d->getOperand(0) : v;
}

bool isProductMatmul(Operation *op) {
  return isa<MatmulOp>(op) && op->hasOneUse() && foldOf(*op->getUsers().begin()) == kFoldProduct;
}

Operation *scatteredMatmul(Operation *op) {
  if (!isa<GatherGradOp>(op) || foldOf(op) != kFoldScatter)
    return nullptr;
  Value v = op->getOperand(0);
  while (auto r = v.getDefiningOp<ReshapeOp>())
    v = r.getInput();
  return v.getDefiningOp<MatmulOp>();
}

bool isScatteredProduct(Operation *op) {
  if (!isa<MatmulOp, ReshapeOp>(op) || !op->hasOneUse())
    return false;
  Operation *u = *op->getUsers().begin();
  while (isa<ReshapeOp>(u) && u->hasOneUse())
    u = *u->getUsers().begin();
  if (!scatteredMatmul(u))
    return false;
  // The chain from `op` down must start at the matmul.
  Operation *d = op;
  while (isa<ReshapeOp>(d))
    d = d->getOperand(0).getDefiningOp();
  return d && d == scatteredMatmul(u);
}

Value aliasRoot(Value v) {
  while (v.getDefiningOp() && isa<ReshapeOp>(v.getDefiningOp()))
    v = v.getDefiningOp()->getOperand(0);
  return v;
}

Operation *gatheredOperand(Operation *op) {
  if (!isa<MatmulOp>(op))
    return nullptr;
  Operation *g = aliasRoot(readOperand(op, 1)).getDefiningOp();
  return g && isa<GatherOp>(g) && foldOf(g) == kFoldGather ? g : nullptr;
}

bool isGatheredOperand(Operation *op) {
  if (isa<ReshapeOp>(op))
    op = aliasRoot(op->getResult(0)).getDefiningOp();
  return op && isa<GatherOp>(op) && foldOf(op) == kFoldGather;
}

} // namespace carve

namespace {

using namespace carve;

bool hasRankTwo(Value v) { return cast<RankedTensorType>(v.getType()).getRank() >= 2; }

/// Whether `op`, a gather or gather_grad of `table`, runs along the table's
/// last axis, in f32 or f64 with i64 indices, and is neither a vocab-parallel
/// one nor in a fused kernel: what rules 3 and 4 ask of both.
bool alongLastAxis(Operation *op, RankedTensorType table, Value indices, int64_t axis) {
  const int64_t rank = table.getRank();
  return rank >= 1 && (axis == rank - 1 || axis == -1) &&
         (table.getElementType().isF32() || table.getElementType().isF64()) &&
         cast<RankedTensorType>(indices.getType()).getElementType().isInteger(64) &&
         !op->hasAttr(kShardedRowsAttr) && !op->hasAttr(kFusionGroupAttr);
}

/// The matmul whose product `g` scatters, when matmul_gather_grad can run
/// the two as one (Passes.td, rule 3); null otherwise.
MatmulOp scatterable(GatherGradOp g) {
  auto table = cast<RankedTensorType>(g.getResult().getType());
  auto indices = cast<RankedTensorType>(g.getIndices().getType());
  const int64_t rank = table.getRank();
  if (!alongLastAxis(g, table, g.getIndices(), g.getAxis()))
    return MatmulOp();
  Value v = g->getOperand(0);
  while (auto r = v.getDefiningOp<ReshapeOp>()) {
    if (!r->hasOneUse())
      return MatmulOp();
    v = r.getInput();
  }
  auto m = v.getDefiningOp<MatmulOp>();
  if (!m || !m->hasOneUse() || m->getBlock() != g->getBlock() || m->hasAttr(kRound16Attr) ||
      !hasRankTwo(m.getLhs()) || !hasRankTwo(m.getRhs()))
    return MatmulOp();
  ArrayRef<int64_t> ys = cast<RankedTensorType>(m.getResult().getType()).getShape();
  const int64_t mm = ys[ys.size() - 2], n = ys.back(), ni = indices.getNumElements();
  int64_t nb = 1, outer = 1;
  for (size_t i = 0; i + 2 < ys.size(); ++i)
    nb *= ys[i];
  for (int64_t i = 0; i + 1 < rank; ++i)
    outer *= table.getShape()[i];
  if (n == 0 || ni == 0 || ni % n != 0 || mm % (ni / n) != 0 || nb * (mm / (ni / n)) != outer)
    return MatmulOp();
  return m;
}

/// Whether every reader of `v` (a gather's result, or a reshape or an
/// "operand" transpose of it) is, through reshapes and "operand"
/// transposes, a matmul of `block` reading it as its right operand only,
/// each batch matrix of it whole rows of `ni` indices (Passes.td, rule 4).
bool readAsGatheredOperand(Value v, Block *block, int64_t ni) {
  if (v.use_empty())
    return false;
  for (OpOperand &use : v.getUses()) {
    Operation *u = use.getOwner();
    if (u->getBlock() != block)
      return false;
    if (isa<ReshapeOp>(u) || (isa<TransposeOp>(u) && foldOf(u) == kFoldOperand)) {
      if (!readAsGatheredOperand(u->getResult(0), block, ni))
        return false;
      continue;
    }
    auto m = dyn_cast<MatmulOp>(u);
    if (!m || use.getOperandNumber() != 1 || aliasRoot(readOperand(m, 0)) == aliasRoot(v) ||
        isProductMatmul(m) || m->hasAttr(kRound16Attr) || !hasRankTwo(m.getLhs()))
      return false;
    ArrayRef<int64_t> bs = cast<RankedTensorType>(readOperand(m, 1).getType()).getShape();
    if (bs.size() < 2 || (bs[bs.size() - 2] * bs.back()) % ni != 0)
      return false;
  }
  return true;
}

/// Whether the matmuls reading `g` can gather its values themselves
/// (matmul_gathered; Passes.td, rule 4).
bool gatherable(GatherOp g) {
  auto table = cast<RankedTensorType>(g.getData().getType());
  auto indices = cast<RankedTensorType>(g.getIndices().getType());
  // Rounded to 16 bits as written (carve.round16, a bf16/fp16 plan's kept
  // activation) is no obstacle: only matmuls read it, and they round their
  // inputs to the plan's format themselves, which rounds the gathered values
  // to the same bits.
  if (!alongLastAxis(g, table, g.getIndices(), g.getAxis()) || indices.getNumElements() == 0)
    return false;
  // A parameter's table would be read where the matmuls run, which ZeRO-3's
  // gathers of parameters do not know.
  if (auto a = dyn_cast<BlockArgument>(aliasRoot(g.getData())))
    if (cast<func::FuncOp>(a.getOwner()->getParentOp()).getArgAttr(a.getArgNumber(), kParamAttr))
      return false;
  return readAsGatheredOperand(g.getResult(), g->getBlock(), indices.getNumElements());
}

struct FoldTransposesPass : carve::impl::CarveFoldTransposesBase<FoldTransposesPass> {
  using CarveFoldTransposesBase::CarveFoldTransposesBase;

  void runOnOperation() override {
    for (auto fn : getOperation().getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      Builder b(fn.getContext());
      // A transpose undoing another reads the other's input: backward's
      // transpose of forward's transposed weight reads the weight, so the
      // forward transpose folds into its matmul and nothing weight-sized is
      // kept from forward to backward.
      SmallVector<TransposeOp> undoing;
      fn.walk([&](TransposeOp t) {
        auto inner = t.getInput().getDefiningOp<TransposeOp>();
        if (!inner || inner.getPerm().size() != t.getPerm().size())
          return;
        ArrayRef<int64_t> p = inner.getPerm(), q = t.getPerm();
        for (size_t i = 0; i < q.size(); ++i)
          if (p[q[i]] != (int64_t)i)
            return;
        undoing.push_back(t);
      });
      for (TransposeOp t : undoing) {
        if (!undoTransposes)
          break;
        t.getResult().replaceAllUsesWith(t.getInput().getDefiningOp<TransposeOp>().getInput());
        t->erase();
        ++numUndone;
      }
      fn.walk([&](TransposeOp t) {
        if (!swapsLastTwo(t))
          return;
        if (auto m = t.getInput().getDefiningOp<MatmulOp>()) {
          if (m->hasOneUse() && hasRankTwo(m.getLhs()) && hasRankTwo(m.getRhs())) {
            t->setAttr(kFoldAttr, b.getStringAttr(kFoldProduct));
            ++numIntoProduct;
            return;
          }
        }
        if (!t->use_empty() &&
            llvm::all_of(t->getUsers(), [](Operation *u) { return isa<MatmulOp>(u); })) {
          t->setAttr(kFoldAttr, b.getStringAttr(kFoldOperand));
          ++numIntoOperand;
        }
      });
      if (scatterProducts)
        fn.walk([&](GatherGradOp g) {
          if (scatterable(g)) {
            g->setAttr(kFoldAttr, b.getStringAttr(kFoldScatter));
            ++numScattered;
          }
        });
      if (gatherOperands)
        fn.walk([&](GatherOp g) {
          if (gatherable(g)) {
            g->setAttr(kFoldAttr, b.getStringAttr(kFoldGather));
            ++numGathered;
          }
        });
    }
  }
};

} // namespace
