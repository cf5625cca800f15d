//===- Epilogues.cpp - what cuBLASLt's epilogues compute ------------------===//
//
// The queries of Fusion.h about the ops a GEMM computes in its epilogue
// (carve-fold-views' "epilogue": a bias add, GELU's gradient) and the
// bias gradients a weight gradient's GEMM sums (carve-select-kernels' rule
// 3i), shared by carve-fold-views, carve-plan-memory, carve-select-kernels
// and the emitter.
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

using namespace mlir;

namespace carve {

Operation *epilogueMatmulOf(Operation *add, Value *bias) {
  if (!add || foldOf(add) != kFoldEpilogue)
    return nullptr;
  if (auto g = dyn_cast<UnaryGradOp>(add)) { // GELU's gradient: dy is the product
    auto m = g.getOperand(1).getDefiningOp<MatmulOp>();
    if (!m || !m->hasOneUse())
      return nullptr;
    if (bias)
      *bias = g.getOperand(0);
    return m;
  }
  if (auto g = dyn_cast<GeluOp>(add)) { // GELU of a bias add its matmul computes
    Operation *a = g.getInput().getDefiningOp();
    return a && isa<AddOp>(a) ? epilogueMatmulOf(a, bias) : nullptr;
  }
  if (!isa<AddOp>(add))
    return nullptr;
  for (unsigned i = 0; i < 2; ++i)
    if (auto m = add->getOperand(i).getDefiningOp<MatmulOp>(); m && m->hasOneUse()) {
      if (bias)
        *bias = add->getOperand(1 - i);
      return m;
    }
  return nullptr;
}

Operation *biasedMatmul(Operation *add, StringRef precision, Value *bias) {
  if (!add || !isa<AddOp>(add) || (precision != "bf16" && precision != "fp16"))
    return nullptr;
  auto t = dyn_cast<RankedTensorType>(add->getResult(0).getType());
  if (!t || !t.getElementType().isF32() || t.getRank() < 2)
    return nullptr;
  for (unsigned i = 0; i < 2; ++i) {
    auto m = add->getOperand(i).getDefiningOp<MatmulOp>();
    Value b = add->getOperand(1 - i);
    auto bt = dyn_cast<RankedTensorType>(b.getType());
    if (!m || !m->hasOneUse() || m.getType() != t || m->hasAttr(kFusionGroupAttr) ||
        !foldOf(m).empty() || isScatteredProduct(m) || gatheredOperand(m) || isProductMatmul(m) ||
        cast<RankedTensorType>(m.getRhs().getType()).getRank() != 2 ||
        cast<RankedTensorType>(m.getLhs().getType()).getRank() < 2 || !bt || bt.getRank() != 1 ||
        !bt.getElementType().isF32() || bt.getShape()[0] != t.getShape().back() ||
        !exact16(b, m, precision))
      continue;
    if (bias)
      *bias = b;
    return m;
  }
  return nullptr;
}

Operation *dgeluMatmul(Operation *grad, StringRef precision) {
  auto g = dyn_cast_or_null<UnaryGradOp>(grad);
  if (!g || g.getFn() != "gelu_tanh" || (precision != "bf16" && precision != "fp16") ||
      g->hasAttr(kFusionGroupAttr) || (!foldOf(g).empty() && foldOf(g) != kFoldEpilogue))
    return nullptr;
  auto t = dyn_cast<RankedTensorType>(g.getType());
  auto m = g.getOperand(1).getDefiningOp<MatmulOp>();
  if (!t || !t.getElementType().isF32() || t.getRank() < 2 || !m || !m->hasOneUse() ||
      m.getType() != t || m->hasAttr(kFusionGroupAttr) || !foldOf(m).empty() ||
      isScatteredProduct(m) || gatheredOperand(m) || isProductMatmul(m) ||
      cast<RankedTensorType>(m.getRhs().getType()).getRank() != 2 ||
      cast<RankedTensorType>(m.getLhs().getType()).getRank() < 2)
    return nullptr;
  // cuBLASLt reads the GELU input in D's layout: rows of the last
  // dimension, a leading dimension divisible by 8 (EPILOGUE_AUX_LD).
  if (t.getShape().back() % 8 != 0 || g.getOperand(0).getType() != t ||
      !exact16(g.getOperand(0), m, precision))
    return nullptr;
  return m;
}

bool onlyRead16(Value r) {
  auto kernelOf = [](Operation *op) {
    auto k = op->getAttrOfType<StringAttr>(kKernelAttr);
    return k ? k.getValue() : StringRef();
  };
  SmallVector<Value> pending{r};
  while (!pending.empty()) {
    Value v = pending.pop_back_val();
    for (OpOperand &use : v.getUses()) {
      Operation *u = use.getOwner();
      if (isa<ReshapeOp>(u)) {
        pending.push_back(u->getResult(0));
        continue;
      }
      if (isa<CastOp>(u) && (u->hasAttr(kCopyByWriterAttr) || u->hasAttr(kCopyInFusedAttr)))
        continue;
      if (u->hasAttr(kBiasGradInGemmAttr))
        continue;
      // A matmul computed by the transpose of its product: that call's flags.
      Operation *call = u;
      if (isa<MatmulOp>(u) && kernelOf(u) == "none" && u->hasOneUse())
        call = *u->getUsers().begin();
      auto flags = call->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      const unsigned k = use.getOperandNumber();
      const StringRef ck = kernelOf(call);
      if (flags && k < flags.size() && flags[k] && !ck.empty() && ck != "none" &&
          (call == u || foldOf(call) == kFoldProduct))
        continue;
      return false;
    }
  }
  return true;
}

Operation *biasGradReduceOf(Operation *gemm) {
  auto which = gemm ? gemm->getAttrOfType<IntegerAttr>(kBiasGradOfAttr) : IntegerAttr();
  if (!which)
    return nullptr;
  Operation *mm = isa<MatmulOp>(gemm) ? gemm : gemm->getOperand(0).getDefiningOp();
  if (!mm || !isa<MatmulOp>(mm))
    return nullptr;
  // The call's a is the matmul's first operand, or for a product's
  // transpose (b^T a^T) its second.
  const bool product = !isa<MatmulOp>(gemm);
  const unsigned k = (which.getInt() == 0) == product ? 1 : 0;
  Value v = mm->getOperand(k);
  if (auto t = v.getDefiningOp<TransposeOp>(); t && foldOf(t) == kFoldOperand)
    v = t.getInput();
  while (auto r = v.getDefiningOp<ReshapeOp>())
    v = r.getInput();
  SmallVector<Value> pending{v};
  while (!pending.empty()) {
    Value x = pending.pop_back_val();
    for (Operation *u : x.getUsers()) {
      if (isa<ReshapeOp>(u))
        pending.push_back(u->getResult(0));
      else if (isa<ReduceSumOp>(u) && u->hasAttr(kBiasGradInGemmAttr))
        return u;
    }
  }
  return nullptr;
}

Operation *epilogueGeluOf(Operation *matmul) {
  Operation *a = epilogueAddOf(matmul);
  if (!a || !isa<AddOp>(a))
    return nullptr;
  for (Operation *u : a->getResult(0).getUsers())
    if (isa<GeluOp>(u) && foldOf(u) == kFoldEpilogue)
      return u;
  return nullptr;
}

Operation *biasGeluMatmul(Operation *gelu, StringRef precision) {
  auto g = dyn_cast_or_null<GeluOp>(gelu);
  if (!g || g.getApproximate() != "tanh" || (precision != "bf16" && precision != "fp16") ||
      !g->hasAttr(kRound16Attr) || (!foldOf(g).empty() && foldOf(g) != kFoldEpilogue))
    return nullptr;
  auto t = dyn_cast<RankedTensorType>(g.getType());
  if (!t || !t.getElementType().isF32() || t.getRank() < 2 || t.getShape().back() % 8 != 0)
    return nullptr;
  // A fused chain of its own (no member of its group beside it), or none.
  if (Attribute group = g->getAttr(kFusionGroupAttr)) {
    for (Value v : g->getOperands())
      if (Operation *d = v.getDefiningOp(); d && d->getAttr(kFusionGroupAttr) == group)
        return nullptr;
    for (Operation *u : g->getUsers())
      if (u->getAttr(kFusionGroupAttr) == group)
        return nullptr;
  }
  Operation *a = g.getInput().getDefiningOp();
  if (!a || !isa<AddOp>(a) || foldOf(a) != kFoldEpilogue)
    return nullptr;
  return epilogueMatmulOf(a);
}

Operation *epilogueAddOf(Operation *matmul) {
  if (!matmul || !isa<MatmulOp>(matmul) || !matmul->hasOneUse())
    return nullptr;
  Operation *u = *matmul->getUsers().begin();
  return epilogueMatmulOf(u) == matmul ? u : nullptr;
}

} // namespace carve
