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
#define GEN_PASS_DEF_CARVEFOLDVIEWS
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

bool reshapeStrides(ArrayRef<int64_t> shape, ArrayRef<int64_t> strides, ArrayRef<int64_t> newShape,
                    SmallVectorImpl<int64_t> &out) {
  out.assign(newShape.size(), 0);
  int64_t n = 1, m = 1;
  for (int64_t d : shape)
    n *= d;
  for (int64_t d : newShape)
    m *= d;
  if (n != m || n == 0)
    return false;
  if (shape.empty()) { // a scalar view: every new dimension has size 1
    for (size_t i = 0; i < newShape.size(); ++i)
      out[i] = 1;
    return true;
  }
  // Runs of `shape` that are contiguous within the view, from the last:
  // each must be exactly covered by whole dimensions of the new shape.
  int64_t viewD = (int64_t)newShape.size() - 1;
  int64_t chunkStride = strides.back(), tensorNumel = 1, viewNumel = 1;
  for (int64_t d = (int64_t)shape.size() - 1; d >= 0; --d) {
    tensorNumel *= shape[d];
    if (d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensorNumel * chunkStride)) {
      while (viewD >= 0 && (viewNumel < tensorNumel || newShape[viewD] == 1)) {
        out[viewD] = viewNumel * chunkStride;
        viewNumel *= newShape[viewD];
        --viewD;
      }
      if (viewNumel != tensorNumel)
        return false;
      if (d > 0) {
        chunkStride = strides[d - 1];
        tensorNumel = 1;
        viewNumel = 1;
      }
    }
  }
  return viewD == -1;
}

std::optional<StridedView> sliceViewOf(Value v) {
  SmallVector<ReshapeOp> reshapes;
  while (auto r = v.getDefiningOp<ReshapeOp>()) {
    reshapes.push_back(r);
    v = r.getInput();
  }
  auto sl = v.getDefiningOp<SliceOp>();
  if (!sl)
    return std::nullopt;
  auto in = cast<RankedTensorType>(sl.getInput().getType());
  ArrayRef<int64_t> xs = in.getShape(), starts = sl.getStarts(), steps = sl.getSteps();
  if (!in.hasStaticShape() || starts.size() != xs.size() || steps.size() != xs.size())
    return std::nullopt;
  StridedView view;
  view.base = sl.getInput();
  view.shape.assign(cast<RankedTensorType>(sl.getResult().getType()).getShape().begin(),
                    cast<RankedTensorType>(sl.getResult().getType()).getShape().end());
  view.strides.assign(xs.size(), 1);
  int64_t acc = 1;
  for (int64_t i = (int64_t)xs.size() - 1; i >= 0; --i) {
    if (steps[i] < 1 || starts[i] < 0)
      return std::nullopt;
    view.offset += starts[i] * acc;
    view.strides[i] = acc * steps[i];
    acc *= xs[i];
  }
  // The reshapes, innermost (nearest the slice) first.
  for (auto it = reshapes.rbegin(); it != reshapes.rend(); ++it) {
    ArrayRef<int64_t> ns = cast<RankedTensorType>(it->getResult().getType()).getShape();
    SmallVector<int64_t> st;
    if (!reshapeStrides(view.shape, view.strides, ns, st))
      return std::nullopt;
    view.shape.assign(ns.begin(), ns.end());
    view.strides = std::move(st);
  }
  return view;
}

Value producedInto(Value v) {
  if (!v.hasOneUse())
    return Value();
  Operation *u = *v.getUsers().begin();
  if (isa<TransposeOp>(u) && foldOf(u) == kFoldProducer)
    return u->getResult(0);
  if (isa<AddOp>(u) && foldOf(u) == kFoldAccumulate && isa<OpResult>(v) &&
      cast<OpResult>(v).getResultNumber() == 0 &&
      isa<LayerNormGradOp, RmsNormGradOp>(v.getDefiningOp()))
    return u->getResult(0);
  return Value();
}

/// For an add marked "accumulate": its operand that is the norm gradient's
/// input gradient (0 or 1), or -1.
static int accumulatedOperand(Operation *add) {
  if (!isa<AddOp>(add) || foldOf(add) != kFoldAccumulate)
    return -1;
  for (unsigned i = 0; i < 2; ++i) {
    Value v = add->getOperand(i);
    if (isa<OpResult>(v) && cast<OpResult>(v).getResultNumber() == 0 &&
        isa<LayerNormGradOp, RmsNormGradOp>(v.getDefiningOp()) && v.hasOneUse())
      return (int)i;
  }
  return -1;
}

Operation *producerOf(Operation *op) {
  if (isa<TransposeOp>(op) && foldOf(op) == kFoldProducer)
    return op->getOperand(0).getDefiningOp();
  if (int i = accumulatedOperand(op); i >= 0)
    return op->getOperand(i).getDefiningOp();
  return nullptr;
}

Value accumulatedResidual(Operation *normGrad) {
  if (!isa<LayerNormGradOp, RmsNormGradOp>(normGrad) || !normGrad->getResult(0).hasOneUse())
    return Value();
  Operation *add = *normGrad->getResult(0).getUsers().begin();
  const int i = accumulatedOperand(add);
  return i < 0 ? Value() : add->getOperand(1 - i);
}

Operation *assembledInto(Operation *t, int64_t &column) {
  column = 0;
  if (!isa<TransposeOp>(t) || foldOf(t) != kFoldProducer || !t->getResult(0).hasOneUse())
    return nullptr;
  Value piece = t->getResult(0);
  Operation *u = *piece.getUsers().begin();
  if (isa<ReshapeOp>(u)) {
    if (!u->getResult(0).hasOneUse())
      return nullptr;
    piece = u->getResult(0);
    u = *piece.getUsers().begin();
  }
  if (!isa<ConcatOp>(u) || foldOf(u) != kFoldAssemble)
    return nullptr;
  for (Value x : u->getOperands()) {
    if (x == piece)
      return u;
    column += cast<RankedTensorType>(x.getType()).getShape().back();
  }
  return nullptr;
}

Value outputCopy16(Value o) {
  auto r = dyn_cast<OpResult>(o);
  if (!r || r.getResultNumber() != 0 || !isa<AttentionStatsOp>(r.getOwner()))
    return Value();
  for (Operation *u : o.getUsers()) {
    if (!isa<TransposeOp>(u) || foldOf(u) != kFoldProducer)
      continue;
    for (Operation *n = u->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
      Type e = cast<RankedTensorType>(n->getResult(0).getType()).getElementType();
      if (n->getOperand(0) == u->getResult(0) && (e.isBF16() || e.isF16()))
        return n->getResult(0);
    }
  }
  return Value();
}

std::optional<StridedPiece> stridedPieceOf(Operation *op) {
  if (!op || foldOf(op) != kFoldStrided)
    return std::nullopt;
  if (isa<CastOp>(op))
    op = op->getOperand(0).getDefiningOp();
  if (!op || !isa<TransposeOp>(op) || foldOf(op) != kFoldStrided)
    return std::nullopt;
  std::optional<StridedView> view = foldedViewOf(op->getOperand(0));
  if (!view)
    return std::nullopt;
  Operation *w = view->base.getDefiningOp();
  if (!w)
    return std::nullopt;
  for (Operation *n = w->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    Type e = cast<RankedTensorType>(n->getResult(0).getType()).getElementType();
    if (n->getOperand(0) == view->base && (e.isBF16() || e.isF16()))
      return StridedPiece{n->getResult(0), view->offset,
                          cast<RankedTensorType>(view->base.getType()).getShape().back()};
  }
  return std::nullopt;
}

Operation *assemblerOf(Operation *concat) {
  if (!isa<ConcatOp>(concat) || foldOf(concat) != kFoldAssemble || concat->getNumOperands() == 0)
    return nullptr;
  Value x = concat->getOperand(0);
  if (auto r = x.getDefiningOp<ReshapeOp>())
    x = r.getInput();
  Operation *t = x.getDefiningOp();
  return t ? producerOf(t) : nullptr;
}

Value consumedFrom(Value v) {
  Operation *d = v.getDefiningOp();
  return d && isa<TransposeOp>(d) && foldOf(d) == kFoldConsumer ? d->getOperand(0) : Value();
}

std::optional<StridedView> foldedViewOf(Value v) {
  Value root = aliasRoot(v);
  Operation *d = root.getDefiningOp();
  if (!d || !isa<SliceOp>(d) || foldOf(d) != kFoldView)
    return std::nullopt;
  return sliceViewOf(v);
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

/// Whether every reader of `v` (through reshapes) is a transpose run on its
/// own (not folded, not fused) that can read it as a strided view.
bool readInPlaceByTransposes(Value v, int depth = 0) {
  if (v.use_empty() || depth > 16)
    return false;
  for (Operation *u : v.getUsers()) {
    if (isa<ReshapeOp>(u)) {
      if (!readInPlaceByTransposes(u->getResult(0), depth + 1))
        return false;
      continue;
    }
    auto t = dyn_cast<TransposeOp>(u);
    if (!t || !foldOf(t).empty() || t->hasAttr(kFusionGroupAttr) || !sliceViewOf(t.getInput()))
      return false;
  }
  return true;
}

/// The transposes of a cuDNN attention gradient's dq, dk and dv to
/// [b, t, h, d] (each gradient's only reader, none rounded as written), or
/// empty.
SmallVector<TransposeOp, 3> gradientTransposes(AttentionGradStatsOp g, const PlanAttrs &plan) {
  if (!cudnnAttentionRefusal(g, plan).empty())
    return {};
  SmallVector<TransposeOp, 3> ts;
  for (Value r : {g.getQueryGrad(), g.getKeyGrad(), g.getValueGrad()}) {
    if (!r.hasOneUse() || cast<RankedTensorType>(r.getType()).getRank() != 4)
      return {};
    auto t = dyn_cast<TransposeOp>(*r.getUsers().begin());
    if (!t || t.getPerm() != ArrayRef<int64_t>{0, 2, 1, 3} || !foldOf(t).empty() ||
        t->hasAttr(kFusionGroupAttr) || t->hasAttr(kRound16Attr) || t->getBlock() != g->getBlock())
      return {};
    ts.push_back(t);
  }
  return ts;
}

/// The transpose of dy from [b, t, h, d] that a cuDNN attention gradient
/// reads (its only reader, dy not rounded as written), or null.
TransposeOp dyTranspose(AttentionGradStatsOp g, const PlanAttrs &plan) {
  if (!cudnnAttentionRefusal(g, plan).empty())
    return TransposeOp();
  auto t = g.getGrad().getDefiningOp<TransposeOp>();
  if (!t || !t->hasOneUse() || cast<RankedTensorType>(t.getType()).getRank() != 4 ||
      t.getPerm() != ArrayRef<int64_t>{0, 2, 1, 3} || !foldOf(t).empty() ||
      t->hasAttr(kFusionGroupAttr) || t->hasAttr(kRound16Attr) || t->getBlock() != g->getBlock())
    return TransposeOp();
  // dy only: q, k, v, o and the statistics are read as they are.
  for (unsigned i = 0; i < 5; ++i)
    if (g->getOperand(i) == t.getResult())
      return TransposeOp();
  return t;
}

/// Whether `use` reads its value as the 16-bit copy made right after the
/// value's writer: a matmul run by cuBLAS (directly, or through reshapes and
/// "operand" transposes; it rounds its operands to the copy's bits) or a
/// sum, mean or max (which reads the exact copy of a value marked
/// carve.round16: carve-select-kernels' rule 3g). What neverStoredF32
/// (compiler/precision) then confirms for an assembled concat.
bool readsCopy16(OpOperand &use) {
  Operation *u = use.getOwner();
  if (isa<ReshapeOp>(u) || (isa<TransposeOp>(u) && foldOf(u) == kFoldOperand)) {
    Value r = u->getResult(0);
    return !r.use_empty() && llvm::all_of(r.getUses(), [](OpOperand &x) { return readsCopy16(x); });
  }
  if (isa<MatmulOp>(u))
    return use.getOperandNumber() < 2 && !u->hasAttr(kFusionGroupAttr) && !isScatteredProduct(u) &&
           !gatheredOperand(u);
  return isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(u) && use.getOperandNumber() == 0 &&
         foldOf(u).empty() && !u->hasAttr(kFusionGroupAttr);
}

/// The concat that a cuDNN attention gradient's dq, dk and dv transposes
/// (`ts`, marked "producer") feed, each through a reshape merging heads and
/// head dimension ([b, t, h, d] -> [b, t, h * d]), as its three operands
/// along the last axis, under a bf16/fp16 plan, with the plan's 16-bit copy
/// among the casts right after it and every other reader reading that copy
/// (readsCopy16); null otherwise.
ConcatOp assemblable(ArrayRef<TransposeOp> ts, const PlanAttrs &plan) {
  if (ts.size() != 3 || (plan.precision != "bf16" && plan.precision != "fp16"))
    return ConcatOp();
  ConcatOp c;
  for (TransposeOp t : ts) {
    if (!t->hasOneUse())
      return ConcatOp();
    auto r = dyn_cast<ReshapeOp>(*t->getUsers().begin());
    if (!r || !r->hasOneUse())
      return ConcatOp();
    ArrayRef<int64_t> in = cast<RankedTensorType>(t.getType()).getShape();
    ArrayRef<int64_t> out = cast<RankedTensorType>(r.getType()).getShape();
    if (in.size() != 4 || out.size() != 3 || out[0] != in[0] || out[1] != in[1] ||
        out[2] != in[2] * in[3])
      return ConcatOp();
    auto cc = dyn_cast<ConcatOp>(*r->getUsers().begin());
    if (!cc || (c && cc != c))
      return ConcatOp();
    c = cc;
  }
  auto type = cast<RankedTensorType>(c.getType());
  if (c->getNumOperands() != 3 || c.getAxis() != type.getRank() - 1 ||
      !type.getElementType().isF32() || !foldOf(c).empty() || c->hasAttr(kFusionGroupAttr) ||
      c->getBlock() != ts.front()->getBlock())
    return ConcatOp();
  for (unsigned i = 0; i < 3; ++i)
    for (unsigned j = 0; j < i; ++j)
      if (c->getOperand(i) == c->getOperand(j))
        return ConcatOp();
  auto is16 = [&](Type e) {
    return (plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16());
  };
  CastOp copy;
  for (Operation *n = c->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    auto k = cast<CastOp>(n);
    if (k.getInput() == c.getResult() &&
        is16(cast<RankedTensorType>(k.getType()).getElementType())) {
      copy = k;
      break;
    }
  }
  if (!copy)
    return ConcatOp();
  for (OpOperand &use : c.getResult().getUses())
    if (use.getOwner() != copy.getOperation() && !readsCopy16(use))
      return ConcatOp();
  return c;
}

/// The transpose of a cuDNN attention forward's output O to [b, t, h, d]
/// whose 16-bit copy (the plan's format, the first among the casts right
/// after it) every other reader reads (readsCopy16), where O's other readers
/// are cuDNN attention gradients (reading it as o); null otherwise. The
/// forward can write O in 16 bits into the copy, and the gradients read it
/// there.
TransposeOp outputTranspose(AttentionStatsOp a, const PlanAttrs &plan) {
  if ((plan.precision != "bf16" && plan.precision != "fp16") ||
      !cudnnAttentionRefusal(a, plan).empty())
    return TransposeOp();
  TransposeOp t;
  for (OpOperand &use : a.getResult().getUses()) {
    Operation *u = use.getOwner();
    if (auto g = dyn_cast<AttentionGradStatsOp>(u)) {
      if (use.getOperandNumber() != 3 || !cudnnAttentionRefusal(g, plan).empty() ||
          llvm::any_of(g->getOperands().take_front(3),
                       [&](Value x) { return x == a.getResult(); }) ||
          g.getGrad() == a.getResult())
        return TransposeOp();
      continue;
    }
    auto tt = dyn_cast<TransposeOp>(u);
    if (!tt || t || tt.getPerm() != ArrayRef<int64_t>{0, 2, 1, 3} || !foldOf(tt).empty() ||
        tt->hasAttr(kFusionGroupAttr) || tt->getBlock() != a->getBlock())
      return TransposeOp();
    t = tt;
  }
  if (!t || cast<RankedTensorType>(t.getType()).getRank() != 4)
    return TransposeOp();
  auto is16 = [&](Type e) {
    return (plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16());
  };
  Operation *copy = nullptr;
  for (Operation *n = t->getNextNode(); n && isa<CastOp>(n) && !copy; n = n->getNextNode())
    if (n->getOperand(0) == t.getResult() &&
        is16(cast<RankedTensorType>(n->getResult(0).getType()).getElementType()))
      copy = n;
  if (!copy)
    return TransposeOp();
  for (OpOperand &use : t.getResult().getUses())
    if (use.getOwner() != copy && !readsCopy16(use))
      return TransposeOp();
  return t;
}

/// q, k and v of a cuDNN attention forward `a` under a bf16/fp16 plan that
/// can be read in place from the 16-bit copy of the one rank-3 f32 tensor
/// they are column slices of (through a slice marked "view" and a reshape to
/// [b, t, h, d], then a transpose to [b, h, t, d]: the QKV projection), where
/// each transpose rounds as written (carve.round16), runs on its own, has its
/// 16-bit copy among the casts right after it (read only through f32 views
/// by cuDNN attention gradients at the same operand) and
/// is read otherwise only by cuDNN attention forwards and gradients at the
/// same operand; the tensor is read by nothing else and written by a binary
/// op or a matmul run by cuBLAS (not fused, not folded: ops that write a
/// 16-bit copy of their result, rules 3e and 3h). nullopt otherwise.
} // namespace

std::optional<InPlaceInputs> carve::inPlaceInputs(AttentionStatsOp a, const PlanAttrs &plan,
                                                  bool marked) {
  if ((plan.precision != "bf16" && plan.precision != "fp16") ||
      !cudnnAttentionRefusal(a, plan).empty())
    return std::nullopt;
  auto is16 = [&](Type e) {
    return (plan.precision == "bf16" && e.isBF16()) || (plan.precision == "fp16" && e.isF16());
  };
  InPlaceInputs in;
  for (unsigned i = 0; i < 3; ++i) {
    auto t = a->getOperand(i).getDefiningOp<TransposeOp>();
    if (!t || t.getPerm() != ArrayRef<int64_t>{0, 2, 1, 3} || !foldOf(t).empty() ||
        t->hasAttr(kFusionGroupAttr) || !t->hasAttr(kRound16Attr) || t->getBlock() != a->getBlock())
      return std::nullopt;
    for (unsigned j = 0; j < i; ++j)
      if (in.transposes[j] == t)
        return std::nullopt;
    std::optional<StridedView> view =
        marked ? foldedViewOf(t.getInput()) : sliceViewOf(t.getInput());
    if (!view || (in.source && view->base != in.source))
      return std::nullopt;
    in.source = view->base;
    auto st = cast<RankedTensorType>(in.source.getType());
    if (st.getRank() != 3 || !st.hasStaticShape() || !st.getElementType().isF32() ||
        view->shape.size() != 4)
      return std::nullopt;
    // [b, t, h, d] as columns of the source's rows: strides [T W, W, d, 1].
    const int64_t W = st.getShape()[2], T = st.getShape()[1];
    ArrayRef<int64_t> sh = view->shape, str = view->strides;
    if (sh[0] != st.getShape()[0] || sh[1] != T || str[0] != T * W || str[1] != W ||
        str[2] != sh[3] || str[3] != 1 || view->offset < 0 || view->offset + sh[2] * sh[3] > W)
      return std::nullopt;
    // Its copy, and its readers: the copy, cuDNN's attention at operand i.
    CastOp copy;
    for (Operation *n = t->getNextNode(); n && isa<CastOp>(n) && !copy; n = n->getNextNode())
      if (n->getOperand(0) == t.getResult() &&
          is16(cast<RankedTensorType>(n->getResult(0).getType()).getElementType()))
        copy = cast<CastOp>(n);
    if (!copy || !foldOf(copy).empty())
      return std::nullopt;
    // The copy read only through f32 views of it (carve-pack-activations'
    // saved copy) by cuDNN attention gradients at operand i.
    for (Operation *u : copy->getUsers()) {
      if (!isa<CastOp>(u) ||
          !cast<RankedTensorType>(u->getResult(0).getType()).getElementType().isF32())
        return std::nullopt;
      for (OpOperand &g : u->getResult(0).getUses())
        if (!isa<AttentionGradStatsOp>(g.getOwner()) || g.getOperandNumber() != i ||
            !cudnnAttentionRefusal(g.getOwner(), plan).empty())
          return std::nullopt;
    }
    for (OpOperand &use : t.getResult().getUses()) {
      Operation *u = use.getOwner();
      if (u == copy.getOperation())
        continue;
      if (!isa<AttentionStatsOp, AttentionGradStatsOp>(u) || use.getOperandNumber() != i ||
          !cudnnAttentionRefusal(u, plan).empty())
        return std::nullopt;
    }
    in.transposes[i] = t;
    in.copies[i] = copy;
  }
  // The source: read by slices marked "view" alone (or, before
  // carve-fold-views, slices it will mark so), whose transposes (through
  // reshapes) are these three.
  Operation *w = in.source.getDefiningOp();
  if (!w || w->getNumResults() != 1 || w->hasAttr(kFusionGroupAttr) || !foldOf(w).empty() ||
      w->getBlock() != a->getBlock())
    return std::nullopt;
  for (Operation *n = w->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
    if (n->getOperand(0) == in.source &&
        is16(cast<RankedTensorType>(n->getResult(0).getType()).getElementType())) {
      in.existingCopy = cast<CastOp>(n);
      break;
    }
  SmallVector<Value> pending;
  for (OpOperand &use : in.source.getUses()) {
    Operation *u = use.getOwner();
    if (u == in.existingCopy.getOperation())
      continue;
    if (!isa<SliceOp>(u) || (marked ? foldOf(u) != kFoldView
                                    : !foldOf(u).empty() || u->hasAttr(kFusionGroupAttr) ||
                                          !readInPlaceByTransposes(u->getResult(0))))
      return std::nullopt;
    pending.push_back(u->getResult(0));
  }
  while (!pending.empty()) {
    Value v = pending.pop_back_val();
    for (Operation *u : v.getUsers()) {
      if (isa<ReshapeOp>(u)) {
        pending.push_back(u->getResult(0));
        continue;
      }
      if (!llvm::is_contained(in.transposes, u))
        return std::nullopt;
    }
  }
  const bool mm =
      isa<MatmulOp>(w) && !isScatteredProduct(w) && !gatheredOperand(w) && !isProductMatmul(w);
  if (!mm && !binaryKernel(w))
    return std::nullopt;
  in.writer = w;
  // A matmul writes the copy right after it only (rule 3e).
  if (mm && in.existingCopy && w->getNextNode() != in.existingCopy.getOperation())
    return std::nullopt;
  if (marked && !in.existingCopy)
    return std::nullopt; // carve-round-operands16 made none
  return in;
}

namespace {

/// An add of a layer or RMS norm gradient's input gradient (read by the add
/// alone) and a tensor of the same f32 type defined before the norm
/// gradient, where the add is neither fused, folded nor rounded as
/// written: the norm gradient can write the sum.
bool accumulable(AddOp add) {
  if (!foldOf(add).empty() || add->hasAttr(kFusionGroupAttr) || add->hasAttr(kRound16Attr))
    return false;
  auto t = dyn_cast<RankedTensorType>(add.getType());
  if (!t || !t.getElementType().isF32() || t.getNumElements() == 0)
    return false;
  for (unsigned i = 0; i < 2; ++i) {
    Value dx = add->getOperand(i), res = add->getOperand(1 - i);
    Operation *g = dx.getDefiningOp();
    if (!g || !isa<LayerNormGradOp, RmsNormGradOp>(g) ||
        cast<OpResult>(dx).getResultNumber() != 0 || !dx.hasOneUse() || dx == res ||
        g->getBlock() != add->getBlock() || !foldOf(g).empty() || g->hasAttr(kFusionGroupAttr) ||
        g->hasAttr(kRound16Attr) || dx.getType() != t || res.getType() != t)
      continue;
    // The residual must exist when the norm gradient runs.
    if (Operation *d = res.getDefiningOp())
      if (d->getBlock() != g->getBlock() || !d->isBeforeInBlock(g))
        continue;
    return true;
  }
  return false;
}

struct FoldViewsPass : carve::impl::CarveFoldViewsBase<FoldViewsPass> {
  /// The "strided" rule: the transposes and their copies marked; the
  /// source is rounded as written with its 16-bit copy right after its
  /// writer (carve-round-operands16 made it). The writer then writes the
  /// copy alone (rule 3e or 3h; neverStoredF32, which carve-select-kernels
  /// checks again): every other reader of the source reads it in place there.
  void markInPlace(InPlaceInputs &in) {
    Operation *w = in.writer;
    Builder b(w->getContext());
    w->setAttr(kRound16Attr, b.getUnitAttr());
    for (int i = 0; i < 3; ++i) {
      in.transposes[i]->setAttr(kFoldAttr, b.getStringAttr(kFoldStrided));
      in.copies[i]->setAttr(kFoldAttr, b.getStringAttr(kFoldStrided));
    }
    ++numStrided;
  }

  /// The "epilogue" rule: a bias add of a matmul's product (biasedMatmul),
  /// rounded as written, not fused, whose 16-bit copy is the first cast
  /// right after it and whose other readers read that copy: slices read in
  /// place by transposes marked "strided" (cuDNN reads the copy), or a
  /// fused chain's members (which read the copy as their input, rule 3g:
  /// carve-round-operands16 took the add out of the chain).
  void markEpilogue(AddOp add, const PlanAttrs &plan) {
    Operation *w = add;
    if (!foldOf(w).empty() || w->hasAttr(kFusionGroupAttr) || !w->hasAttr(kRound16Attr) ||
        !biasedMatmul(w, plan.precision))
      return;
    auto copy = dyn_cast_or_null<CastOp>(w->getNextNode());
    Type ce = copy ? cast<RankedTensorType>(copy.getType()).getElementType() : Type();
    if (!copy || copy.getInput() != add.getResult() ||
        !((plan.precision == "bf16" && ce.isBF16()) || (plan.precision == "fp16" && ce.isF16())))
      return;
    for (OpOperand &use : add.getResult().getUses()) {
      Operation *u = use.getOwner();
      if (u == copy.getOperation())
        continue;
      if (u->hasAttr(kFusionGroupAttr) && isFusible(u))
        continue; // a chain's input, read as the copy (rule 3g)
      if (!isa<SliceOp>(u) || foldOf(u) != kFoldView)
        return;
      SmallVector<Value> pending{u->getResult(0)};
      while (!pending.empty()) {
        Value v = pending.pop_back_val();
        for (Operation *r : v.getUsers()) {
          if (isa<ReshapeOp>(r))
            pending.push_back(r->getResult(0));
          else if (!isa<TransposeOp>(r) || foldOf(r) != kFoldStrided)
            return;
        }
      }
    }
    w->setAttr(kFoldAttr, Builder(w->getContext()).getStringAttr(kFoldEpilogue));
    ++numEpilogues;
  }

  /// Whether `w`'s 16-bit copy (of the plan's format) is the first cast
  /// right after it and every other reader of `w` reads that copy
  /// (readsCopy16; neverStoredF32, which carve-select-kernels checks again):
  /// what the "epilogue" rule asks of a GELU and of its gradient, whose
  /// matmul writes only the copy.
  static bool copyReadAlone16(Operation *w, const PlanAttrs &plan) {
    auto copy = dyn_cast_or_null<CastOp>(w->getNextNode());
    Type ce = copy ? cast<RankedTensorType>(copy.getType()).getElementType() : Type();
    if (!copy || copy.getInput() != w->getResult(0) ||
        !((plan.precision == "bf16" && ce.isBF16()) || (plan.precision == "fp16" && ce.isF16())))
      return false;
    return llvm::all_of(w->getResult(0).getUses(), [&](OpOperand &use) {
      return use.getOwner() == copy.getOperation() || readsCopy16(use);
    });
  }

  /// The "epilogue" rule's GELU gradient: a unary_grad of the tanh form
  /// whose gradient is the product of a matmul run by cuBLAS (dgeluMatmul)
  /// and whose 16-bit copy every other reader reads (copyReadAlone16).
  void markDgelu(UnaryGradOp g, const PlanAttrs &plan) {
    if (!dgeluMatmul(g, plan.precision) || !copyReadAlone16(g, plan))
      return;
    Builder b(g->getContext());
    g->setAttr(kFoldAttr, b.getStringAttr(kFoldEpilogue));
    g->setAttr(kRound16Attr, b.getUnitAttr()); // its value is the copy's (rule 3g reads it)
    ++numDgelus;
  }

  /// The "epilogue" rule's GELU: the tanh GELU of a bias add marked
  /// "epilogue" (biasGeluMatmul), alone in its fused chain, whose 16-bit
  /// copy every other reader reads (copyReadAlone16): out of its chain,
  /// computed by the matmul's epilogue.
  void markBiasGelu(GeluOp g, const PlanAttrs &plan) {
    if (!biasGeluMatmul(g, plan.precision) || !foldOf(g).empty() || !copyReadAlone16(g, plan))
      return;
    g->removeAttr(kFusionGroupAttr);
    g->setAttr(kFoldAttr, Builder(g->getContext()).getStringAttr(kFoldEpilogue));
    ++numBiasGelus;
  }

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (plan->target != "cuda")
      return; // the CPU runtime has no transpose_view
    Builder b(module.getContext());
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      fn.walk([&](SliceOp sl) {
        auto t = cast<RankedTensorType>(sl.getResult().getType());
        Type e = t.getElementType();
        if (!foldOf(sl).empty() || sl->hasAttr(kFusionGroupAttr) || t.getNumElements() == 0 ||
            !(e.isF32() || e.isF64() || e.isInteger(64) || e.isInteger(32)))
          return;
        if (!readInPlaceByTransposes(sl.getResult()))
          return;
        sl->setAttr(kFoldAttr, b.getStringAttr(kFoldView));
        ++numFolded;
      });
      fn.walk([&](AttentionStatsOp a) {
        if (std::optional<InPlaceInputs> in = inPlaceInputs(a, *plan, /*marked=*/true))
          markInPlace(*in);
        if (TransposeOp t = outputTranspose(a, *plan)) {
          t->setAttr(kFoldAttr, b.getStringAttr(kFoldProducer));
          ++numOutputs;
        }
      });
      fn.walk([&](AttentionGradStatsOp g) {
        SmallVector<TransposeOp, 3> ts = gradientTransposes(g, *plan);
        for (TransposeOp t : ts) {
          t->setAttr(kFoldAttr, b.getStringAttr(kFoldProducer));
          ++numProduced;
        }
        if (ConcatOp c = assemblable(ts, *plan)) {
          c->setAttr(kFoldAttr, b.getStringAttr(kFoldAssemble));
          c->setAttr(kRound16Attr, b.getUnitAttr()); // its values are 16-bit pieces
          ++numAssembled;
        }
        if (TransposeOp t = dyTranspose(g, *plan)) {
          t->setAttr(kFoldAttr, b.getStringAttr(kFoldConsumer));
          ++numConsumed;
        }
      });
      fn.walk([&](AddOp a) { markEpilogue(a, *plan); });
      if (plan->precision == "bf16" || plan->precision == "fp16") {
        fn.walk([&](GeluOp g) { markBiasGelu(g, *plan); });
        fn.walk([&](UnaryGradOp g) { markDgelu(g, *plan); });
      }
      fn.walk([&](AddOp a) {
        if (accumulable(a)) {
          a->setAttr(kFoldAttr, b.getStringAttr(kFoldAccumulate));
          ++numAccumulated;
        }
      });
    }
  }
};

} // namespace
